"""The results store: append-only JSON Lines, one record per line (the schema is schema.py).

Appends cannot tear: a record is one `write` of its whole line on an O_APPEND descriptor, under an exclusive lock,
flushed and fsynced; when the write fails (a full disk, Ctrl-C) the file is truncated back to its size before, so
it is left exactly as it was. Readers and writers accept regular files only (not /dev/zero, a FIFO, a directory).
Waiting for another writer's lock can be interrupted (Ctrl-C, SIGTERM), and says after a moment what it waits for.

A record written again later (a sweep's record once its paired timing is added) replaces its own line (rewrite.py),
so that the file holds each record once; where a killed writer or an older gcbench left two versions under one
`record_id`, readers get the newest, where the first one stood, and the next writer compacts them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gcbench.errors import GcbenchError, signals_held
from gcbench.results.schema import ADDED_SPEC_FIELDS, READABLE_VERSIONS, SCHEMA_VERSION, config_key, record_problem
from gcbench.text import plain

# Waiting for another process's lock on a results file: how often to try again (a blocking flock would hold off
# Ctrl-C and SIGTERM until it returns), and after how long to say what is awaited.
LOCK_POLL_S = 0.05
LOCK_NOTICE_S = 2.0


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
    """Fail now (GcbenchError) if records could not be appended to `path`, leaving nothing behind: neither the
    file nor the folders made to try it (the first record makes them again; a refused command leaves none)."""
    check_regular(path)
    missing = missing_folders(path.absolute().parent)
    try:
        existed = path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            if not existed:
                _remove_if_unused(path, f.fileno())
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    finally:
        remove_empty(missing)


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those above it that do not exist yet, deepest first: what making it would create."""
    missing, path = [], folder.absolute()
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) this process made, up to the first that is not empty: one that another
    process, or a report, wrote into meanwhile stays, with those above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def check_appendable(path: Path) -> None:
    """Everything that would stop a record from being appended to `path` later, checked before any work: a regular
    file (or none yet) that can be written, whose records this gcbench reads (GcbenchError otherwise: a newer
    schema_version, a corrupt line in the middle). A torn last line is no obstacle: `drop_truncated_last_line`
    cuts it off before the append."""
    ensure_writable(path)
    if path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            read_records(path, checked=True)


def append_record(path: Path, record: dict[str, Any], written: Callable[[], None] | None = None) -> str | None:
    """Append one record as one line, all or nothing: on any failure (ENOSPC, EIO) the file is truncated back to its
    size before (removed if this call created it) and a GcbenchError says why. Under the file's lock, a half-written
    last line (a writer killed mid-line) is cut off first and returned, for the caller to warn about; after a new
    record it would be a corrupt line in the middle. Ctrl-C and SIGTERM end a wait for another writer's lock (nothing
    written); once the lock is held they wait until the file is whole again, so they arrive as a KeyboardInterrupt
    after the record is in: `written` is called as soon as it is (fsynced)."""
    check_regular(path)
    data = (json.dumps(record, default=str) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    fd, created = open_locked(path, create=True)  # type: ignore[misc]
    try:
        with signals_held():
            dropped = drop_torn_tail(fd, str(path))
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
        # Removed under the lock, and only while the path still names this file: a writer waiting for the lock
        # finds its file unlinked and opens the path anew (above).
        if created and os.fstat(fd).st_size == 0 and same_file(path, fd):
            path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return dropped


def open_locked(path: Path, create: bool = False) -> tuple[int, bool] | None:
    """`path` opened for appending with its exclusive lock held (concurrent writers: repairing or truncating back
    then cuts only our own; Ctrl-C ends the wait) and whether this call created it; None: no file, `create` off.
    Opened anew while the path names another file once the lock is held: the writer that held it removed the empty
    file it had made, or renamed a rewrite over it (rewrite.py)."""
    while True:
        try:
            created = create and not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0), 0o666)
        except OSError as e:
            if isinstance(e, FileNotFoundError) and not create:
                return None
            raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
        try:
            lock(fd, path)
        except BaseException:
            os.close(fd)  # never holding the lock, it removes nothing: the file may be another writer's now
            raise
        if same_file(path, fd):
            return fd, created
        os.close(fd)


def _remove_if_unused(path: Path, fd: int) -> None:
    """Remove the empty file `path` this process just made to try it, unless another writer opened it meanwhile and
    holds or takes its lock (then it is theirs: append_record's writer that finds its file unlinked opens it anew)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    if os.fstat(fd).st_size == 0 and same_file(path, fd):
        path.unlink()


def same_file(path: Path, fd: int) -> bool:
    """Whether `path` is (still) the file open as `fd`."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def lock(fd: int, path: Path, stop: Callable[[], bool] | None = None, what: str | None = None) -> bool:
    """Take `fd`'s exclusive flock, waiting for another holder in short polls: Ctrl-C and SIGTERM end the wait (a
    KeyboardInterrupt), as does `stop()` turning True (then False is returned; True once the lock is held). After
    LOCK_NOTICE_S of waiting, one line on stderr says what is awaited (`what`, else the file) and, where
    /proc/locks tells, the pid holding it."""
    waited_since, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if stop is not None and stop():
            return False
        if not told and time.monotonic() - waited_since >= LOCK_NOTICE_S:
            told = True
            holder = lock_holder(fd)
            sys.stderr.write(f"gcbench: waiting for {plain(what or path)}: locked by "
                             f"{f'process {holder}' if holder else 'another process'} (Ctrl-C stops waiting)\n")
            sys.stderr.flush()
        time.sleep(LOCK_POLL_S)


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on `fd`'s file, from /proc/locks (Linux); None where it does not say."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; a waiter's line has "->" after the number
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == where and parts[4].isdigit():
            return int(parts[4])
    return None


def torn_record(line: str | bytes) -> bool:  # a record cut short by a killed writer starts as one does: "{"
    return line.lstrip()[:1] in ("{", b"{")


def drop_torn_tail(fd: int, where: str) -> str | None:
    """Cut the last line off the file when it lacks its newline and is a record cut short (`torn_record`); return
    it. A whole object without its newline (written by hand) gets one; any other line: GcbenchError naming `where`."""
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
    if not torn_record(tail):
        raise GcbenchError(f"{where}: not a JSON object ({tail[:40].decode(errors='replace')!r}): not a results "
                           "file? Nothing was written to it")
    os.ftruncate(fd, start)
    return tail.decode(errors="replace")


def _write_all(fd: int, data: bytes) -> None:
    """One write of the whole line (a regular file takes it whole unless the disk fills up mid-way)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def drop_truncated_last_line(path: Path) -> str | None:
    """Cut a half-written last line (a writer killed mid-line) off `path`, under its lock, and return it; None when
    the file ends cleanly or does not exist."""
    check_regular(path)
    if (opened := open_locked(path)) is None:
        return None
    fd = opened[0]
    try:
        with signals_held():
            dropped = drop_torn_tail(fd, str(path))
            os.fsync(fd)
        return dropped
    finally:
        os.close(fd)


def read_records(path: Path, checked: bool = False) -> list[dict[str, Any]]:
    """All records of one file. A corrupt last line (a killed run) is warned about and skipped; a corrupt line
    elsewhere, or a record of another schema version, is an error. A record written again under the same
    `record_id` (a sweep adds its paired timing) is read once: its newest version, where the first one stood.
    `checked`: each a record tables and runs can use (schema.record_problem), else a GcbenchError naming it."""
    check_regular(path)
    try:
        lines = path.read_bytes().decode().splitlines()
    except FileNotFoundError:  # gone since it was seen: another command's probe (ensure_writable), no records
        return []
    except OSError as e:
        raise GcbenchError(f"cannot read results {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise GcbenchError(f"{str(path)!r} is not a results file (not UTF-8 text)") from None
    parsed = parse_records(lines, str(path))
    for line, record in parsed if checked else ():
        if (problem := record_problem(record)) is not None:
            raise GcbenchError(f"{path}:{line}: not a gcbench record: {problem}")
    records = [record for _, record in parsed]
    return [records[i] for i in newest_positions(records)]


def parse_records(lines: list[str], where: str) -> list[tuple[int, dict[str, Any]]]:
    """Each record of a file's `lines` with its line number (from 1), as read_records reads them (one that
    imports records checks them before they are written: validate --import)."""
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_int=_record_int)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except BeyondRecords as e:  # a whole line, not one cut short: refused wherever it stands
            raise GcbenchError(f"{where}:{i}: corrupt results line ({e})") from None
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the JSON parser follows
            if i == len(lines) and torn_record(line):
                warnings.warn(f"{where}:{i}: ignoring a truncated last line (an interrupted run)", stacklevel=3)
                continue
            raise GcbenchError(f"{where}:{i}: corrupt results line (not a JSON object): mend or delete that line "
                               "to read this file or add to it" if records or torn_record(line) else  # none yet:
                               f"{where}:{i}: not a JSON object ({line.strip()[:40]!r}): not a results file?"
                               ) from None
        version = record.get("schema_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):  # true == 1 in Python, not in a schema
            newer = isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION
            raise GcbenchError(
                f"{where}:{i}: schema_version {version!r}, but this gcbench reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
                + (" (written by a newer gcbench: upgrade to read or add to it)" if newer else ""))
        records.append((i, {**ADDED_SPEC_FIELDS, **record}))
    return records


class BeyondRecords(ValueError):
    """A number no record holds: an integer past 64 bits (pandas and float() would overflow on it later)."""


def _record_int(text: str) -> int:
    """json's parse_int for records: every integer a record holds (bytes, FLOPs, sizes, seeds) fits in 64 bits."""
    value = int(text) if len(text) <= 20 else None
    if value is None or not -2**63 <= value < 2**64:
        raise BeyondRecords(f"an integer of {len(text.lstrip('-'))} digits, beyond the 64 bits any value of a "
                            "record fits in")
    return value


def newest_positions(records: list[dict[str, Any]]) -> list[int]:
    """Which of `records` (in file order) a reader gets: a record written again is read once, its newest version
    where the first one stood (positions into `records`, in the order they are read)."""
    # A later version of a record is the same config (a random record_id, and the config checked too: a record
    # never replaces another config's, even in a file a person or a script merged by hand).
    at: dict[str, int] = {}
    kept: list[int] = []
    for i, record in enumerate(records):
        rid = record.get("record_id")
        if isinstance(rid, str) and rid in at and config_key(records[kept[at[rid]]]) == config_key(record):
            kept[at[rid]] = i
            continue
        if isinstance(rid, str):
            at[rid] = len(kept)
        kept.append(i)
    return kept


def records_after(path: Path, seen: set[bytes]) -> list[dict[str, Any]]:
    """The whole records of `path` whose line is not in `seen` (added to it): what another writer added or rewrote
    (a newer version of a record, rewrite.py) since `seen` was filled. Lines that do not read as records are left to
    read_records to judge. Read by line, not by offset: a rewrite moves the lines after the one it replaces."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):  # none yet (writing to it says what is wrong with the path)
        return []
    except OSError as e:
        raise GcbenchError(f"cannot read results {str(path)!r}: {e.strerror or e}") from None
    records = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        if line in seen:
            continue
        seen.add(line)
        try:
            record = json.loads(line, parse_int=_record_int)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append({**ADDED_SPEC_FIELDS, **record})
    return records


def result_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories to the *.jsonl files directly inside them, not in their subfolders: `results/` holds what
    the commands write by default (runs.jsonl, sweep.jsonl, fit.jsonl), and its subfolders other records (this
    project's own in cpu/, gpu/<gpu>/, timing-experiment/), which are read when named. Subfolders left out are
    a warning; a folder with records only in subfolders an error that names them."""
    files: list[Path] = []
    for p in map(Path, paths):
        try:
            p.is_dir()
        except OSError as e:  # a name too long, a loop of links: is_dir() raises rather than answer False
            raise GcbenchError(f"cannot read results {str(p)[:200]!r}: {e.strerror or e}") from None
        if p.is_dir():
            found = sorted(f for f in p.glob("*.jsonl") if f.is_file())
            nested = sorted({f.relative_to(p).parts[0] for f in p.glob("*/**/*.jsonl")})
            shown = ", ".join(f"{str(p / name)!r}" for name in nested[:3]) + (", ..." if len(nested) > 3 else "")
            if not found:
                raise GcbenchError(f"{str(p)!r} holds no *.jsonl results" + (
                    f" (subfolders are not read unless named: {shown})" if nested else ""))
            if nested:
                warnings.warn(f"{str(p)!r}: its subfolders are not read unless named ({shown})", stacklevel=2)
            files.extend(found)
        elif p.exists():
            check_regular(p)
            files.append(p)
        else:
            raise GcbenchError(f"no such results file: {str(p)!r}")
    if not files:
        raise GcbenchError("no results files given")
    return files
