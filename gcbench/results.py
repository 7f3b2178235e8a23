"""The results store: append-only JSON Lines, one Record per line, loaded into pandas.

Stored values are raw: bytes, milliseconds, FLOPs. Units are converted only for display.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from gcbench.errors import GcbenchError

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "timeout", "error", "skipped")


def policy_label(record: dict[str, Any]) -> str:
    """A record's policy as written on the command line: "every-k:k=2", "sqrtn"."""
    opts = record.get("policy_options") or {}
    return record["policy"] + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def peak_bytes(record: dict[str, Any]) -> int | None:
    """A record's measured peak: the CUDA allocator's, or on CPU the live-tensor tracker's (never mixed up)."""
    return record.get("peak_allocated_bytes", record.get("peak_tracked_bytes"))


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


def load(*paths: str | Path) -> pd.DataFrame:
    """Every record of the given files/directories as one DataFrame, a row per config; `env` is flattened
    to `env.*` columns, `source` names the file and `policy_label` is the policy with its options ("every-k:k=2";
    flattening would otherwise scatter the options over NaN-padded `policy_options.*` columns)."""
    rows = []
    for path in result_files(paths or ("results",)):
        for record in read_records(path):
            label = policy_label(record) if "policy" in record else None
            rows.append({**record, "policy_label": label, "source": str(path)})
    return pd.json_normalize(rows, max_level=1) if rows else pd.DataFrame()
