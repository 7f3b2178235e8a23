"""The one domain exception: bad input or an impossible request, shown to a user as one line (exit code 2)."""


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


def raise_interrupt(signum: int, frame: object) -> None:
    """A signal handler that makes the signal (SIGTERM) take Ctrl-C's path: a KeyboardInterrupt."""
    raise KeyboardInterrupt
