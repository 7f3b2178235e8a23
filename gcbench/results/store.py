"""The results store: append-only JSON Lines, one record per line (the schema is schema.py)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.results.schema import SCHEMA_VERSION

def ensure_writable(path: Path) -> None:
    """Fail now (GcbenchError) if records could not be appended to `path`, leaving nothing behind."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise GcbenchError(f"cannot write results to {str(path)!r}: {e.strerror or e}") from None
    if not existed:
        path.unlink()


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line, flushed and fsynced: a crash loses at most the line being written."""
    line = json.dumps(record, default=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        # A killed writer can leave a last line without its newline; start ours on a fresh line.
        if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            f.write(b"\n")
        f.write(line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def drop_truncated_last_line(path: Path) -> str | None:
    """Cut a half-written last line (a writer killed mid-line) off `path` and return it; None when the file
    ends cleanly. Needed before appending: after a new record it would be a corrupt line in the middle."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    tail = data[start:]
    try:
        if isinstance(json.loads(tail or b"{}"), dict):
            return None
    except ValueError:
        pass
    with open(path, "r+b") as f:
        f.truncate(start)
        os.fsync(f.fileno())
    return tail.decode(errors="replace")


def read_records(path: Path) -> list[dict[str, Any]]:
    """All records of one file. A corrupt last line (a killed run) is warned about and skipped; a corrupt line
    elsewhere, or a record of another schema version, is an error."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise GcbenchError(f"cannot read results {str(path)!r}: {e.strerror or e}") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if i == len(lines):
                warnings.warn(f"{path}:{i}: ignoring a truncated last line (an interrupted run)", stacklevel=2)
                continue
            raise GcbenchError(f"{path}:{i}: corrupt results line (not a JSON object)") from None
        version = record.get("schema_version")
        if version != SCHEMA_VERSION:
            raise GcbenchError(
                f"{path}:{i}: schema_version {version!r}, but this gcbench reads version {SCHEMA_VERSION}")
        records.append(record)
    return records


def result_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories to the *.jsonl files inside them."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.jsonl"))
            if not found:
                raise GcbenchError(f"{str(p)!r} holds no *.jsonl results")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise GcbenchError(f"no such results file: {str(p)!r}")
    if not files:
        raise GcbenchError("no results files given")
    return files
