"""The one domain exception: bad input or an impossible request, shown to a user as one line (exit code 2)."""


class GcbenchError(Exception):
    """A problem the user can fix (bad option, unknown name, no room on the device); never a bug."""
