"""What every launcher shares, written once: the interface (Launcher), what a failed paired timing gives back
(PairingFailed), the record of a config that produced no measurement, the last lines of a failed process's output,
and stopping a process."""


from __future__ import annotations

import os
import signal
import subprocess
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gcbench.resolved import ResolvedRun
from gcbench.results.schema import Status, new_record

TAIL_LINES = 30  # of a failed process's output, kept in its record (stderr_tail)
OnPhase = Callable[[str], None]  # called with each phase of a run as it starts ("building model", "warm-up 1/3")


@dataclass(frozen=True)
class PairingFailed:
    """What a paired timing gives back when it could not time the policies (the child died, ran out of memory or of
    time): why, in one line. The policies keep their own, unpaired, step times."""

    why: str


class Launcher(Protocol):
    """Runs configurations somewhere (inline.InProcessRunner, process.ProcessRunner); one record each."""

    timeout_s: float | None  # None: cannot be enforced (in this process)

    def __call__(self, spec: ResolvedRun, on_phase: OnPhase) -> dict[str, Any]: ...

    def paired(self, specs: list[ResolvedRun], baseline: str,
               on_phase: OnPhase) -> dict[str, Any] | PairingFailed: ...


def failure_record(spec: ResolvedRun | dict[str, Any], status: str, error: str, env: dict | None = None,
                   **extra: Any) -> dict[str, Any]:
    """The record of a config that produced no measurement (skipped, timeout, error, an oom not run); `spec` is a
    run or its record's spec fields; `env` what the process that tried it saw (None: none reported)."""
    fields = spec if isinstance(spec, dict) else spec.as_record()
    return new_record(fields, status, error, **extra, env=env)


def error_record(spec: ResolvedRun, error: BaseException) -> dict[str, Any]:
    """The record of a config whose run raised: the error in one line, the traceback's last lines beside it."""
    tail = "\n".join(traceback.format_exc().splitlines()[-TAIL_LINES:])
    return failure_record(spec, Status.ERROR, f"{type(error).__name__}: {error}"[:500], stderr_tail=tail)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a process's output."""
    return "\n".join(text.splitlines()[-lines:])


def read_tail(path: str | Path | int, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a process's log file, by its path or an open descriptor (read from its last
    16 KiB; a descriptor with pread, leaving its offset where the writer has it)."""
    if isinstance(path, int):
        size = os.fstat(path).st_size
        return tail(os.pread(path, min(size, 16384), max(0, size - 16384)).decode(errors="replace"), lines)
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        return tail(f.read().decode(errors="replace"), lines)


def died(who: str, exitcode: int | None, output: str, without: str) -> str:
    """Why a process gave no result, in one line: how it ended and the last line it printed ("child killed by
    SIGKILL (the kernel's OOM killer?): ...", "torchrun exited with code 1 and no rank reported: ...")."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        how = f"{who} killed by {name}" + (" (the kernel's OOM killer?)" if name == "SIGKILL" else "")
    else:
        how = f"{who} exited with code {exitcode} {without}"
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    return f"{how}: {last}"[:500] if last else how


def stop(proc: Any, grace_s: float, term_s: float = 5.0) -> None:
    """Wait `grace_s` for a process (a multiprocessing.Process or a subprocess.Popen) to exit by itself, then
    SIGTERM and `term_s` more (torchrun stops its ranks in that time), then SIGKILL; reaped before returning, so
    that the next config starts on a device this one released."""
    def wait(seconds: float | None) -> bool:  # True once it exited
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(seconds)
            except subprocess.TimeoutExpired:
                return False
            return True
        proc.join(seconds)
        return not proc.is_alive()

    if wait(grace_s):
        return
    proc.terminate()
    if not wait(term_s):
        proc.kill()
        wait(None)
