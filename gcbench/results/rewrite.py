"""Rewriting a results file in place: a record's newer version over its own line, and the lines a killed writer
left superseded compacted away, so that the file holds each record once.

A results file is read by plain tools too (`jq`, `pandas.read_json(lines=True)`), which take every line as a record:
a record written again (a sweep's record once its paired timing is in) must replace its line, not follow it. Under
the lock every writer takes (store.lock), the whole file is written anew beside it and renamed over it (os.replace,
then the folder fsynced): a reader sees the old file or the new one, never a mix, and a kill at any moment leaves
one of the two, whole. A writer that waited for the lock on the replaced file finds that the path names another
file now and opens it anew (store.append_record). A folder that takes no new file (read-only, or sticky and another
user's) gets the newer version appended instead, as an older gcbench wrote it. Lines that do not read as records are kept as they are, for read_records to judge.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gcbench.errors import GcbenchError, signals_held
from gcbench.results.schema import ADDED_SPEC_FIELDS, config_key
from gcbench.results.store import append_record, check_appendable, check_regular, drop_torn_tail, open_locked

TEMPORARY_SUFFIX = ".rewrite"  # the new file beside the old one until it is renamed over it


def open_for_writing(path: Path) -> None:
    """What a command that appends to `path` does before its work: store.check_appendable (everything that would
    stop the record, refused now), then the versions of one record a killed writer or an older gcbench left there
    compacted (compact_records), so that the file it leaves holds each record once."""
    check_appendable(path)
    compact_records(path)


def replace_record(path: Path, record: dict[str, Any]) -> str | None:
    """Write `record` over the line of the record with its `record_id` (and config), in place, and drop any other
    version of it a killed writer left; appended when the file has none (or no file is there). Returns a torn last
    line that was cut off (a writer killed mid-line), for the caller to warn about."""
    rid = record.get("record_id")
    if not isinstance(rid, str):
        raise ValueError("replace_record needs a record with a record_id")
    data = (json.dumps(record, default=str) + "\n").encode()
    key = config_key({**ADDED_SPEC_FIELDS, **record})
    found = False

    def replaced(lines: list[bytes]) -> list[bytes]:
        nonlocal found
        out = []
        for line in lines:
            if _identity(line) == (rid, key):
                if not found:
                    out.append(data)
                found = True
            else:
                out.append(line)
        return out

    outcome = _rewrite(path, replaced)
    dropped = outcome.dropped if outcome is not None else None
    if outcome is None or not found or not outcome.written:
        # no line of it here, or the folder takes no new file (a sticky or read-only folder): the newer version
        # appended, which readers take (and the next writer that can compacts)
        dropped = append_record(path, record) or dropped
    return dropped


def compact_records(path: Path) -> int:
    """Keep each record of `path` once: where several lines hold versions of one record (same `record_id` and
    config: a writer killed between the two writes of a replacement cannot leave them, an older gcbench did), the
    newest takes the first one's place. Returns how many lines went; the file is not touched when none would."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except OSError:
        return 0
    if len(lines) == len(_compacted(lines)):
        return 0  # the common case, decided without the lock: nothing to write
    outcome = _rewrite(path, _compacted)
    return outcome.removed if outcome is not None and outcome.written else 0


def _compacted(lines: list[bytes]) -> list[bytes]:
    at: dict[tuple[str, str], int] = {}
    out: list[bytes] = []
    for line in lines:
        identity = _identity(line)
        if identity is not None and identity in at:
            out[at[identity]] = line if line.endswith(b"\n") else line + b"\n"
            continue
        if identity is not None:
            at[identity] = len(out)
        out.append(line)
    return out


def _identity(line: bytes) -> tuple[str, str] | None:
    """A line's record_id and config, or None for a line without a record_id (or not a record)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("record_id"), str):
        return None
    return record["record_id"], config_key({**ADDED_SPEC_FIELDS, **record})  # an older schema's line as read


@dataclass(frozen=True)
class Rewritten:
    dropped: str | None  # a torn last line cut off (a writer killed mid-line)
    removed: int  # lines that went
    written: bool  # False: nothing to change, or the folder took no new file (the file left as it was)


def _rewrite(path: Path, change: Callable[[list[bytes]], list[bytes]]) -> Rewritten | None:
    """Apply `change` to the lines of `path` under its lock and write the result atomically in its place (nothing
    written when the lines stay the same); None when there is no file. A link is followed: the file it names is the
    one replaced, not the link."""
    check_regular(path)
    path = Path(os.path.realpath(path))
    if (opened := open_locked(path)) is None:
        return None
    fd = opened[0]
    try:
        with signals_held():
            _remove_stale_temporaries(path)  # under the lock: a writer killed mid-rewrite left them
            dropped = drop_torn_tail(fd, str(path))  # a writer killed mid-line: cut off in place first
            os.fsync(fd)
            lines = _read_all(fd).splitlines(keepends=True)
            changed = change(lines)
            if changed == lines:
                return Rewritten(dropped, 0, False)
            try:
                _replace_file(path, fd, b"".join(changed))
            except PermissionError:
                return Rewritten(dropped, 0, False)
            return Rewritten(dropped, len(lines) - len(changed), True)
    except OSError as e:
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or str(e)
        raise GcbenchError(f"cannot write results to {str(path)!r}: {why}; the file is left as it was") from None
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    """The whole file: pread returns at most about 2 GiB a call on Linux."""
    size, chunks, at = os.fstat(fd).st_size, [], 0
    while at < size:
        chunk = os.pread(fd, min(size - at, 1 << 30), at)
        if not chunk:
            break
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _remove_stale_temporaries(path: Path) -> None:
    for stale in path.parent.glob(f"{glob.escape(_temporary_prefix(path))}*{TEMPORARY_SUFFIX}"):
        stale.unlink(missing_ok=True)


def _replace_file(path: Path, fd: int, data: bytes) -> None:
    """`data` written to a new file beside `path` (its mode and group), fsynced, renamed over `path`, the folder
    fsynced."""
    st = os.fstat(fd)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path), suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(handle, st.st_mode & 0o7777)
        try:
            os.fchown(handle, -1, st.st_gid)  # a shared file stays its group's (the owner is whoever writes)
        except OSError:
            pass
        view = memoryview(data)
        while view:
            view = view[os.write(handle, view):]
        os.fsync(handle)
        os.close(handle)
        handle = -1
        os.replace(temp, path)
    except BaseException:
        if handle >= 0:
            os.close(handle)
        Path(temp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
