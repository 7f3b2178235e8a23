"""Each config in a fresh child process with a timeout, returning the config's record; a child that dies or runs
out of time becomes a record too. The child's side is child.py.

A child's output goes to a log file without a name (tempfile.TemporaryFile), handed to it as an open descriptor:
however the sweep or the child ends (kill -9 included), nothing is left behind in the temporary folder."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gcbench.errors import signals_held
from gcbench.launch.server import context as fork_server_context
from gcbench.launch.base import OnPhase, PairingFailed, died, failure_record, read_tail, stop
from gcbench.launch.slots import HERE, Slot
from gcbench.resolved import ResolvedRun
from gcbench.results.schema import Status, config_label

# Slots side by side start children from several threads: one at a time, since starting swaps sys.modules' __main__.
_START_LOCK = threading.Lock()


class ProcessRunner:
    """Each config in a fresh child process, forked from a fork server that imported torch, transformers and
    gcbench once: a child starts in tens of milliseconds, yet owns its CUDA context and allocator, so an OOM, a
    sticky CUDA error or a segfault cannot touch the next config. `timeout_s` is enforced by killing the child."""

    def __init__(self, timeout_s: float, models: Iterable[str] = (), slot: Slot = HERE,
                 cancel: threading.Event | None = None):
        self.timeout_s = timeout_s
        self.slot = slot  # the GPU or the cores every child of this runner is given
        self.cancel = cancel  # set by the sweep (Ctrl-C while several slots run): stop the child, KeyboardInterrupt
        # The fork server, started with this process's environment (unless the sweep started it already), builds
        # each of the sweep's models on the meta device once (child.py), so that no child imports their modeling
        # code again.
        self._ctx = fork_server_context(models)

    def __call__(self, spec: ResolvedRun, on_phase: OnPhase) -> dict[str, Any]:
        """The config's record: measured by a child, or a failure record when the child died or ran out of time."""
        result, failure = self._run_task({"spec": spec.as_record()}, f"gcbench {config_label(spec.as_record())}",
                                         on_phase)
        if failure is not None:
            status, error, env, tail = failure
            return failure_record(spec, status, error, env=env, stderr_tail=tail)
        return result

    def paired(self, specs: list[ResolvedRun], baseline: str, on_phase: OnPhase) -> dict[str, Any] | PairingFailed:
        """paired.run_paired in a child: {policy label: paired fields}, or PairingFailed when the child failed.
        Its timeout is one config's per policy: it warms up and times each of them."""
        result, failure = self._run_task({"paired": [s.as_record() for s in specs], "baseline": baseline},
                                         f"gcbench paired {config_label(specs[0].as_record())}", on_phase,
                                         self.timeout_s * len(specs))
        return PairingFailed(failure[1]) if failure is not None else result

    def _run_task(self, task: dict[str, Any], name: str, on_phase: OnPhase,
                  timeout_s: float | None = None) -> tuple[Any, tuple | None]:
        """(the child's result, None), or (None, (status, error, env, stderr tail)) for a child that died or ran
        out of time."""
        log = tempfile.TemporaryFile(prefix="gcbench-child-", suffix=".log")
        # Shared with the child, which writes at the end whatever this process reads (pread: no shared offset moved).
        fcntl.fcntl(log.fileno(), fcntl.F_SETFL, fcntl.fcntl(log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        results, results_w = self._ctx.Pipe(duplex=False)
        lifeline_r, lifeline = self._ctx.Pipe(duplex=False)
        # The cwd: the fork server keeps the one it started in, but relative paths (a config.json) are the caller's.
        task = {**task, "slot": self.slot.as_task()}
        proc = self._ctx.Process(target=_run_child,
                                 args=(task, results_w, lifeline_r, InheritedFd(log.fileno()), os.getcwd()),
                                 name=name, daemon=True)
        finished = started = False
        try:
            with _START_LOCK, signals_held(), _main_module_hidden():
                proc.start()
                started = True
            # The child holds these now; our copies would keep the pipes open after it died.
            results_w.close()
            lifeline_r.close()
            result, failure = self._wait(proc, results, on_phase, log.fileno(), timeout_s or self.timeout_s)
            finished = failure is None
            return result, failure
        finally:
            if started:
                stop(proc, grace_s=10.0 if finished else 0.0)
                proc.close()
            for conn in (results, results_w, lifeline, lifeline_r):
                conn.close()
            log.close()

    def _wait(self, proc, results, on_phase: OnPhase, log: int, timeout_s: float) -> tuple[Any, tuple | None]:
        deadline = time.monotonic() + timeout_s
        env, phase = None, "starting"
        while (left := deadline - time.monotonic()) > 0:
            if self.cancel is not None and self.cancel.is_set():
                raise KeyboardInterrupt  # as Ctrl-C does in a sweep of one slot: the child is stopped, nothing kept
            if not results.poll(min(left, 0.25)):
                if proc.is_alive() or results.poll():
                    continue
                msg = None  # died without closing the pipe cleanly
            else:
                try:
                    msg = results.recv()
                except EOFError:
                    msg = None
            if msg is None:
                proc.join(5)
                output = read_tail(log)
                return None, (Status.ERROR, died("child", proc.exitcode, output, "without a result"), env, output)
            kind, payload = msg
            if kind == "record":
                on_phase("child exiting")  # the next config waits for it: its memory must be released first
                return payload, None
            if kind == "env":
                env = payload
            elif kind == "progress":
                phase = payload
                on_phase(payload)
        return None, (Status.TIMEOUT, f"no result within {timeout_s:g} s (was: {phase})", env, read_tail(log))


class InheritedFd:
    """An open file descriptor given to a child as it starts: multiprocessing passes the descriptor itself along
    (as it does a Pipe's), so the child needs no name to open."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return _inherited, (DupFd(self.fd),)


def _inherited(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a child without the caller's __main__. The child runs gcbench.launch.child.run_child and needs nothing from
    the calling script, but multiprocessing would re-run that script in every child (its unguarded top level
    included: a notebook-style script calling gcbench.sweep() would recurse) and cannot at all for `python -`."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to re-import
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _run_child(*args: Any) -> None:
    """A child's entry, named from here: child.py is imported by the fork server only (importing it warms up:
    git sha, model code), never by the sweep."""
    from gcbench.launch.child import run_child

    run_child(*args)
