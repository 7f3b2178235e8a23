"""Configurations claimed by the sweep that runs them, so that sweeps sharing one results file run each once.

A claim is an exclusive flock on a small file in `.<results name>.claims/` beside the results file, one per
configuration (a model, seq and batch: its policies run and are timed paired together). The kernel drops a flock
when its process dies, `kill -9` included: a dead sweep's claim is free at once, with no pid to check. The sweep
holding a claim removes its file before letting go; one that took the lock of a file removed meanwhile (the path
no longer names its inode) tries again. What a claim left by a killed sweep leaves behind, the next sweep removes.
Where no claim can be made (a folder this process cannot write in), sweeps run as if alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from gcbench.results.store import lock, same_file


class Claim:
    """A configuration held by this sweep until `release`."""

    def __init__(self, fd: int | None, path: Path | None):
        self._fd, self._path = fd, path

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self._path.unlink(missing_ok=True)  # while held: whoever waits on this inode sees it gone and retries
            self._path.parent.rmdir()
        except OSError:
            pass  # other claims in the folder: the last one out removes it
        finally:
            os.close(self._fd)
            self._fd = None


class Claims:
    """The claims on the configurations of one results file, shared by every sweep writing to it."""

    def __init__(self, out: Path):
        self.folder = out.parent / f".{out.name}.claims"

    def _path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.claim"

    def take(self, key: str, wait: bool = False, stop: Callable[[], bool] | None = None,
             what: str | None = None) -> Claim | None:
        """The claim on `key`; None when another sweep holds it (`wait`: wait for it, until `stop()` is True;
        `what` names it in the line saying so). Ctrl-C and SIGTERM end a wait."""
        path = self._path(key)
        while True:
            try:
                self.folder.mkdir(exist_ok=True)
            except OSError:
                return Claim(None, None)  # cannot claim here (a read-only folder): run as if alone
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except FileNotFoundError:
                continue  # the folder was removed meanwhile by the last claim going away: make it again
            except OSError:
                return Claim(None, None)
            try:
                if wait:
                    held = lock(fd, path, stop, what)
                else:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        held = True
                    except BlockingIOError:
                        held = False
                if held and same_file(path, fd):
                    fd, claim = None, Claim(fd, path)
                    return claim
                if not held:
                    return None
            finally:
                if fd is not None:
                    os.close(fd)

    def clean(self) -> None:
        """Remove the claims of sweeps that died (kill -9), and the folder once empty."""
        try:
            paths = list(self.folder.glob("*.claim"))
        except OSError:
            return
        for path in paths:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if same_file(path, fd):
                    path.unlink()
            except OSError:
                pass  # held: a running sweep's
            finally:
                os.close(fd)
        try:
            self.folder.rmdir()
        except OSError:
            pass

