"""The one domain exception: bad input or an impossible request, shown to a user as one line (exit code 2); how
Ctrl-C and SIGTERM reach the code (a KeyboardInterrupt, held where a step must not be cut in two); and quieting the
libraries whose own log lines would come before that one line."""

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class GcbenchError(Exception):
    """A problem the user can fix (bad option, unknown name, no room on the device); never a bug."""


class WontFit(GcbenchError):
    """A config that cannot fit in the memory it may use, known before anything is allocated: its model state or its
    predicted peak is larger. `by_cap`: the limit is --memory-cap (a smaller device, simulated), not the device."""

    def __init__(self, message: str, *, by_cap: bool):
        super().__init__(message)
        self.by_cap = by_cap

    @property
    def limit(self) -> str:
        """What it does not fit: "cap" (--memory-cap; final) or "free" (the device's free memory now)."""
        return "cap" if self.by_cap else "free"


class DeadlineReached(Exception):
    """A long job stopped cleanly before work that would pass its deadline (`gcbench validate --deadline`): what
    finished is written, and the same command resumes from there. Not an error."""


def raise_interrupt(signum: int, frame: object) -> None:
    """A signal handler that makes the signal (SIGTERM) take Ctrl-C's path: a KeyboardInterrupt."""
    raise KeyboardInterrupt


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM inside the block and deliver the first one right after it, to the handlers in place
    before (a KeyboardInterrupt): a file half changed, a child started whose pid is not yet known, worker threads
    half started. Python runs handlers in the main thread only, so only there is anything held. Handlers are
    swapped, not the signal mask: a mask holds a signal for one thread, and the kernel gives it to another (rich's
    refresh thread, a sweep's workers), whose flag the main thread then handles inside the block all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in caught[:1]:
            signal.raise_signal(sig)


@contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Library logger `name` (and its children) shows only records of `level` and above inside the block: what it
    would log (each retry of a download, a traceback for a size it cannot compute, an optional kernel missing) the
    one line gcbench prints says better."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
