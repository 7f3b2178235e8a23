"""Sweeps: a grid of RunSpecs (grid.SweepSpec), each config run in a fresh child process with a timeout, one
record appended per config as it finishes, resumable, and an OOM recorded as a result.

    grid = SweepSpec.load("sweeps/smoke.toml", {"steps": 2})   # or SweepSpec.load(None, {"model": ..., ...})
    records = Sweep(grid).run()                                 # or gcbench.sweep("sweeps/smoke.toml")

Statuses: ok | oom | timeout | error (with the last lines of the child's stderr) | skipped (a config that needs
at least as much memory as one that already ran out, with the reason). See docs/sweep.md.
orchestrate.py runs the grid, progress.py shows it; where each config runs (a child, this process, a GPU of its
own, a Slurm job) is the launcher's (gcbench/launch/).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.grid import SweepSpec, parse_options
from gcbench.sweeps.orchestrate import Sweep

__all__ = ["Sweep", "SweepSpec", "sweep"]


def sweep(config: str | Path | SweepSpec | None = None, *, rerun: bool = False, retry_failed: bool = False,
          skip_after_oom: bool = True, progress: bool = True, **options: Any) -> list[dict[str, Any]]:
    """Run a sweep from Python, exactly as `gcbench sweep` does; returns the grid's records in grid order.

        gcbench.sweep(model="tiny-llama", seq=[32, 64], batch=[1, 2], policy=["none", "full"], device="cpu",
                      out="results/tiny.jsonl")
        gcbench.sweep("sweeps/smoke.toml", steps=2)     # keyword options override the file

    Options take the CLI names (memory_cap or "memory-cap"). KeyboardInterrupt propagates after the running child
    is stopped; the records already written stay and the next call resumes.
    """
    if isinstance(config, SweepSpec):
        values, run = parse_options(options, where="sweep()")
        grid = dataclasses.replace(config, values={**config.values, **values}, **run)
    else:
        grid = SweepSpec.load(config, options, where="sweep()")
    console = Console(stderr=True) if progress else None
    return Sweep(grid, rerun=rerun, retry_failed=retry_failed, skip_after_oom=skip_after_oom, console=console).run()
