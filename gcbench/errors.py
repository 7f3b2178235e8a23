"""The one domain exception: bad input or an impossible request, shown to a user as one line (exit code 2)."""


class GcbenchError(Exception):
    """A problem the user can fix (bad option, unknown name, no room on the device); never a bug."""


class WontFit(GcbenchError):
    """A config that cannot fit in the memory it may use, known before anything is allocated: its model state or its
    predicted peak is larger. `by_cap`: the limit is --memory-cap (a smaller device, simulated), not the device."""

    def __init__(self, message: str, *, by_cap: bool):
        super().__init__(message)
        self.by_cap = by_cap
