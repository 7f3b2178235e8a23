"""gcbench: measure what activation checkpointing saves in memory and costs in time."""

__version__ = "0.1.0"

from gcbench.errors import GcbenchError  # noqa: E402
from gcbench.spec import RunSpec  # noqa: E402
from gcbench.worker import run  # noqa: E402
from gcbench.results import load  # noqa: E402

__all__ = ["GcbenchError", "RunSpec", "load", "run", "__version__"]
