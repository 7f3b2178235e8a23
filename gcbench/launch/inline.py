"""In this process: every config of a sweep run one after the other where the sweep runs (`--isolation none`).

Starts faster, but less safe: no timeout, a crash or a sticky CUDA error ends the whole sweep, and what one config
leaves in the CUDA caching allocator or in host memory can shift the next one's numbers. For quick CPU checks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.launch.base import OnPhase, PairingFailed, error_record, failure_record
from gcbench.launch.direct import run
from gcbench.launch.slots import HERE, Slot
from gcbench.resolved import ResolvedRun
from gcbench.results.schema import Status


class InProcessRunner:
    """--isolation none: every config in this process (the module's docstring says what that costs)."""

    def __init__(self, timeout_s: float | None = None, models: Iterable[str] = (), slot: Slot = HERE,
                 cancel: threading.Event | None = None):
        self.slot = slot  # always HERE: Sweep refuses slots side by side without process isolation
        self.timeout_s = None  # cannot be enforced without a process to kill

    def __call__(self, spec: ResolvedRun, on_phase: OnPhase) -> dict[str, Any]:
        try:
            return run(spec, on_phase)
        except GcbenchError as e:
            return failure_record(spec, Status.ERROR, str(e))
        except Exception as e:  # noqa: BLE001 - failure is data: the sweep goes on
            return error_record(spec, e)

    def paired(self, specs: list[ResolvedRun], baseline: str, on_phase: OnPhase) -> dict[str, Any] | PairingFailed:
        from gcbench.paired import run_paired

        try:
            return run_paired(specs, baseline, on_phase)
        except Exception as e:  # noqa: BLE001 - a pairing that fails leaves the configs' own timings
            return PairingFailed(f"{type(e).__name__}: {e}"[:500])
