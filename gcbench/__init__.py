"""gcbench: measure what activation checkpointing saves in memory and costs in time."""

__version__ = "0.1.0"

from gcbench.errors import GcbenchError  # noqa: E402
from gcbench.spec import RunSpec  # noqa: E402
from gcbench.worker import run  # noqa: E402
from gcbench.results import load  # noqa: E402
from gcbench.sweep import sweep  # noqa: E402  (the function; `from gcbench.sweep import ...` still reaches the module)
from gcbench.estimate import estimate  # noqa: E402  (the function, as for sweep)

__all__ = ["GcbenchError", "RunSpec", "estimate", "load", "run", "sweep", "__version__"]
