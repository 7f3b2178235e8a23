"""Where a configuration runs: one interface, its implementations side by side.

    direct.py     one config from this process (`gcbench run`, `gcbench.run`): here, or on its ranks
    inline.py     a sweep's configs in this process, one after the other (`--isolation none`)
    process.py    a fresh child per config, forked from a warm fork server, with a timeout (child.py: its side)
    slots.py      children side by side, each on its own GPU (`--devices`) or its own cores (`--jobs`)
    slurm.py      each configuration as a submitit job (`--executor slurm|local`)
    torchrun.py   a sharded config's ranks (`--shard fsdp2 --nproc N`) under torchrun (rank.py: a rank's side)

A launcher takes a resolved run and gives back its record, whatever happened: a config that died, ran out of
memory or of time is a record with its status, never an exception (Ctrl-C and SIGTERM excepted). What every
launcher shares is written once, in base.py: the record of a config that produced no measurement
(`failure_record`), the last lines of a failed process's output (`tail`), stopping a process (`stop`), and what a
failed paired timing gives back (`PairingFailed`). `launcher(isolation, ...)` picks one by the sweep's field.
"""

from __future__ import annotations

from typing import Any

from gcbench.launch.base import (TAIL_LINES, Launcher, OnPhase, PairingFailed, died, error_record, failure_record,
                                 read_tail, stop, tail)
from gcbench.launch.direct import run

__all__ = ["TAIL_LINES", "Launcher", "OnPhase", "PairingFailed", "died", "error_record", "failure_record", "launcher",
           "read_tail", "run", "stop", "tail"]


def launcher(isolation: str, timeout_s: float, **where: Any) -> Launcher:
    """The launcher --isolation names: process (a fresh child per config, process.py) | none (this process,
    inline.py). `where`: the models to warm up, the slot, the cancel event (process.ProcessRunner)."""
    if isolation == "process":
        from gcbench.launch.process import ProcessRunner

        return ProcessRunner(timeout_s, **where)
    from gcbench.launch.inline import InProcessRunner

    return InProcessRunner(timeout_s, **where)
