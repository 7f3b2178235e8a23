"""The results store: append-only JSON Lines, one record per line (the schema is schema.py).

Appends cannot tear: a record is one `write` of its whole line on an O_APPEND descriptor, under an exclusive lock,
flushed and fsynced; when the write fails (a full disk, Ctrl-C) the file is truncated back to its size before, so
it is left exactly as it was. Readers and writers accept regular files only (not /dev/zero, a FIFO, a directory).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import stat
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.results.schema import ADDED_SPEC_FIELDS, READABLE_VERSIONS, SCHEMA_VERSION


def check_regular(path: Path, what: str = "results") -> None:
    """GcbenchError unless `path` is absent or a regular file: a device, FIFO or socket would be read forever or
    swallow records (/dev/zero, /dev/full, /dev/null)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # absent, or not reachable: opening it says why
    if stat.S_ISDIR(mode):
        example = f" (e.g. {path}/runs.jsonl)" if what == "results" else ""
        raise GcbenchError(f"{str(path)!r} is a directory; {what} must be a regular file{example}")
    if not stat.S_ISREG(mode):
        raise GcbenchError(f"{str(path)!r} is not a regular file; {what} must be a regular file")


def ensure_writable(path: Path) -> None:
    """Fail now (GcbenchError) if records could not be appended to `path`, leaving nothing behind."""
    check_regular(path)
    try:
        existed = path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    if not existed:
        path.unlink()


def check_appendable(path: Path) -> None:
    """Everything that would stop a record from being appended to `path` later, checked before any work: a regular
    file (or none yet) that can be written, whose records this gcbench reads (GcbenchError otherwise: a newer
    schema_version, a corrupt line in the middle). A torn last line is no obstacle: `drop_truncated_last_line`
    cuts it off before the append."""
    ensure_writable(path)
    if path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            read_records(path)


def append_record(path: Path, record: dict[str, Any], written: Callable[[], None] | None = None) -> str | None:
    """Append one record as one line, all or nothing: on any failure (ENOSPC, EIO) the file is truncated back to its
    size before (removed if this call created it) and a GcbenchError says why. Under the file's lock, a half-written
    last line (a writer killed mid-line) is cut off first and returned, for the caller to warn about; after a new
    record it would be a corrupt line in the middle. Ctrl-C and SIGTERM wait until the file is whole again, so they
    arrive as a KeyboardInterrupt after the record is in: `written` is called as soon as it is (fsynced)."""
    check_regular(path)
    data = (json.dumps(record, default=str) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    try:
        with _signals_held():
            fcntl.flock(fd, fcntl.LOCK_EX)  # concurrent writers: repairing or truncating back cuts only our own
            dropped = _drop_torn_tail(fd)
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except BaseException as e:
                os.ftruncate(fd, size)
                os.fsync(fd)
                if not isinstance(e, OSError):
                    raise
                why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or str(e)
                raise GcbenchError(f"cannot write results to {str(path)!r}: {why}; the file is left as it was") \
                    from None
            if written is not None:
                written()
    except OSError as e:  # truncating back failed too: say so, without a traceback
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}; its last line may be "
                           "incomplete (the next write removes it)") from None
    except BaseException:
        if created and os.fstat(fd).st_size == 0:
            path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return dropped


def _drop_torn_tail(fd: int) -> str | None:
    """Cut the last line off the file when it lacks its newline and is not a whole JSON object; return it. A whole
    object without a newline (written by hand) stays: a newline is added after it."""
    size = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return None
    start = size
    while start > 0:  # back to the last newline, a block at a time
        block_start = max(0, start - 65536)
        block = os.pread(fd, start - block_start, block_start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            start = block_start + newline + 1
            break
        start = block_start
    tail = os.pread(fd, size - start, start)
    try:
        if isinstance(json.loads(tail), dict):
            _write_all(fd, b"\n")
            return None
    except (ValueError, RecursionError):
        pass
    os.ftruncate(fd, start)
    return tail.decode(errors="replace")


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while the file is changed and deliver them after (the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _write_all(fd: int, data: bytes) -> None:
    """One write of the whole line (a regular file takes it whole unless the disk fills up mid-way)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def drop_truncated_last_line(path: Path) -> str | None:
    """Cut a half-written last line (a writer killed mid-line) off `path`, under its lock, and return it; None when
    the file ends cleanly or does not exist."""
    check_regular(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    try:
        with _signals_held():
            fcntl.flock(fd, fcntl.LOCK_EX)
            dropped = _drop_torn_tail(fd)
            os.fsync(fd)
        return dropped
    finally:
        os.close(fd)


def read_records(path: Path) -> list[dict[str, Any]]:
    """All records of one file. A corrupt last line (a killed run) is warned about and skipped; a corrupt line
    elsewhere, or a record of another schema version, is an error."""
    check_regular(path)
    try:
        lines = path.read_bytes().decode().splitlines()
    except OSError as e:
        raise GcbenchError(f"cannot read results {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise GcbenchError(f"{str(path)!r} is not a results file (not UTF-8 text)") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the JSON parser follows
            if i == len(lines):
                warnings.warn(f"{path}:{i}: ignoring a truncated last line (an interrupted run)", stacklevel=2)
                continue
            raise GcbenchError(f"{path}:{i}: corrupt results line (not a JSON object)") from None
        version = record.get("schema_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):  # true == 1 in Python, not in a schema
            newer = isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION
            raise GcbenchError(
                f"{path}:{i}: schema_version {version!r}, but this gcbench reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
                + (" (written by a newer gcbench: upgrade to read or add to it)" if newer else ""))
        records.append({**ADDED_SPEC_FIELDS, **record})
    return records


def result_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories to the *.jsonl files inside them."""
    files: list[Path] = []
    for p in map(Path, paths):
        try:
            p.is_dir()
        except OSError as e:  # a name too long, a loop of links: is_dir() raises rather than answer False
            raise GcbenchError(f"cannot read results {str(p)[:200]!r}: {e.strerror or e}") from None
        if p.is_dir():
            found = sorted(p.rglob("*.jsonl"))
            if not found:
                raise GcbenchError(f"{str(p)!r} holds no *.jsonl results")
            files.extend(found)
        elif p.exists():
            check_regular(p)
            files.append(p)
        else:
            raise GcbenchError(f"no such results file: {str(p)!r}")
    if not files:
        raise GcbenchError("no results files given")
    return files
