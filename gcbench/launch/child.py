"""The child side of a sweep: one process runs one RunSpec and sends its Record back over a pipe.

Children are forked from a multiprocessing fork server that imported torch, transformers and gcbench once
(see process.ProcessRunner), so a child starts in tens of milliseconds instead of the seconds a fresh interpreter
spends on imports. The fork server never touches CUDA: every child still creates its own CUDA context and
allocator, and an OOM, a sticky CUDA error or a segfault dies with it.

A child runs one task: {"spec": a RunSpec as a record} (-> its record), or {"paired": [RunSpecs as records],
"baseline": policy label} (-> {policy label: paired-timing fields}, paired.run_paired).
Messages to the parent, in order: ("env", capture_env dict), ("progress", text)..., ("record", the result).
A child that raises prints the error on its stderr and exits non-zero without a record; the parent then writes
an `error` record holding the last lines of that stderr.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from gcbench import env
from gcbench.errors import GcbenchError
from gcbench.heap import freeze_heap
from gcbench.launch.direct import run
from gcbench.models import build_meta_model, load_config
from gcbench.resolved import resolve_record
from gcbench.paired import run_paired
from gcbench.launch.server import WARM_MODELS_ENV
from gcbench.launch.slots import HERE, Slot


def _warm_up_fork_server() -> None:
    """Work every child would otherwise repeat, done once in the fork server that imports this module."""
    # The git sha: two git processes per child otherwise. The server imported the code now, so this sha is it.
    env.git_sha()
    # transformers imports a family's modeling code lazily, at its first model build: ~0.6 s per child on 2 CPU
    # cores. A meta-device build of each of the sweep's models (no memory, no compute, no CUDA) pulls it in here.
    for model in filter(None, os.environ.get(WARM_MODELS_ENV, "").split("\n")):
        try:
            build_meta_model(load_config(model)[0])
        except Exception:  # noqa: BLE001 - the child that runs it reports it; the fork server must start
            pass
    # Out of the collector's sight, as the gc module's docs advise before fork() without exec(): a child's
    # gc.collect (each run ends with one) then walks only what the child made, not the ~10^6 objects of torch and
    # transformers it inherited (0.16 s per config on 2 cores), and touches none of their shared pages. No
    # collection first (the docs ask for none): it took 0.2 s before the first child could start, to free the
    # little garbage the imports leave.
    freeze_heap()


_warm_up_fork_server()


def run_child(task: dict[str, Any], conn: Connection, lifeline: Connection, log: Any,
              cwd: str | None = None) -> None:
    """Entry point of one child: run the task (relative paths from `cwd`, the sweep's), stream progress, send the
    result; its output goes to `log` (process.InheritedFd: a descriptor of a file without a name)."""
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    if cwd is not None:
        os.chdir(cwd)
    Slot(**task.get("slot", HERE.as_task())).enter()  # before anything touches CUDA: its GPU or cores only
    # The sweep decides when a child stops (it terminates it); Ctrl-C in the terminal is for the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _redirect_output(log.fd)
    except OSError:
        os._exit(70)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log the parent reads
    try:
        specs = [resolve_record(r) for r in task.get("paired", [task.get("spec")])]
        conn.send(("env", env.capture_env(specs[0].device, specs[0].threads)))
        progress = lambda text: conn.send(("progress", text))  # noqa: E731
        record = run_paired(specs, task["baseline"], progress) if "paired" in task else run(specs[0], progress)
    except GcbenchError as e:
        print(f"gcbench: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    conn.send(("record", record))


def _redirect_output(fd: int) -> None:
    # At the file-descriptor level, so C/C++ messages (CUDA, OpenMP, faulthandler) land in the log as well.
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _exit_with_parent(lifeline: Connection) -> None:
    # The parent holds the other end until this child is done; EOF means the sweep died (kill -9): stop at once
    # rather than hold a GPU the next (resumed) sweep is about to measure on.
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(70)
