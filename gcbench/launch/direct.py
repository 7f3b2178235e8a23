"""One config started from this process: measured here (runner.run), or a sharded one on its ranks under torchrun
(torchrun.py), each rank measuring its share in its own process. What `gcbench run`, `gcbench.run`, a sweep's
child and `--isolation none` call."""

from __future__ import annotations

from typing import Any

from gcbench.launch.base import OnPhase
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec


def run(spec: RunSpec | ResolvedRun, progress: OnPhase | None = None, *, refuse_unfit: bool = False) -> dict[str, Any]:
    """Measure one config and return its record: in this process, or for a sharded config on its ranks under
    torchrun (each rank measures in its own process, their records merge into one). An out-of-memory is a result
    (status 'oom'); `refuse_unfit`: raise WontFit instead when the device itself is too small (runner.run)."""
    from gcbench.fsdp import in_rank
    from gcbench.runner import run as run_here  # torch: imported when a config runs

    spec = resolve(spec)
    spec.check_runnable()
    if spec.shard != "none" and not in_rank():
        from gcbench.launch.torchrun import run_sharded

        return run_sharded(spec, progress or (lambda _: None))
    return run_here(spec, progress, refuse_unfit=refuse_unfit)
