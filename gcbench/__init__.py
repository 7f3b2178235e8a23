"""gcbench: measure what activation checkpointing saves in memory and costs in time.

The library calls the CLI makes, importable without paying for torch until one is used (PEP 562):

    import gcbench
    record = gcbench.run(gcbench.RunSpec(model="tiny-llama", seq_len=64, batch_size=2, policy="full"))
    records = gcbench.sweep("sweeps/smoke.toml")
    df = gcbench.load("results/")  # results/*.jsonl; subfolders only when named
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from gcbench.errors import GcbenchError

try:
    __version__ = version("gcbench")
except PackageNotFoundError:  # run from a source tree that was never installed (python -m gcbench)
    __version__ = "0+unknown"

# public name -> module that defines it; imported at first use
_LAZY = {
    "RunSpec": "gcbench.spec",
    "resolve": "gcbench.resolved",
    "run": "gcbench.launch",
    "sweep": "gcbench.sweeps",
    "estimate": "gcbench.estimators",
    "load": "gcbench.results.frame",
}

__all__ = ["GcbenchError", "RunSpec", "estimate", "load", "resolve", "run", "sweep", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gcbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
