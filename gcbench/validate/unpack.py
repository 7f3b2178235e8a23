"""An archive from a GPU machine, read whole into memory and checked before anything of it is written: its names,
member types and sizes (from the headers, then while reading), its text, every record line, and that it holds
exactly one GPU's folder (Python's tarfile "data" filter, PEP 706, is the model; this is stricter: it also knows
what a results folder may hold).

The archive is read as a stream, once: a member past the size cap is refused at its header, before its bytes are
inflated (a small archive of zeros can claim gigabytes).
"""

from __future__ import annotations

import gzip
import re
import tarfile
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.results.schema import record_problem
from gcbench.results.store import parse_records
from gcbench.validate.plan import ROOT, SMOKE_ROOT

MAX_ARCHIVE_BYTES = 128 * 2**20  # all members together, unpacked: a whole window's records are under 1 MiB
MAX_MEMBERS = 2000
SUFFIXES = (".jsonl", ".txt", ".ndjson")  # what validate writes into a GPU's folder: records, logs, calibration
RESERVED = ("superseded", "predicted")  # folders beside the GPUs' that hold no GPU's records
SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")  # gpu_slug's shape: "nvidia-h200"
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # step names, logs; no hidden file, no "..", no "."


@dataclass
class Staged:
    """What an archive would add: its GPU folder (results/gpu/<gpu>, from the repository root) and each file's
    text by its path inside that folder; records: each .jsonl file's lines that are records (number, record)."""
    folder: PurePosixPath
    texts: dict[PurePosixPath, str] = field(default_factory=dict)
    records: dict[PurePosixPath, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)

    @property
    def smoke(self) -> bool:
        return self.folder.parent == PurePosixPath(SMOKE_ROOT.as_posix())


def stage_archive(archive: Path) -> Staged:
    """`archive` (a .tar.gz of validate --archive) read and checked whole; GcbenchError, naming the first problem,
    for anything an import must not write."""
    where = f"{str(archive)[:200]!r}"
    files: dict[PurePosixPath, bytes] = {}
    folders: set[PurePosixPath] = set()
    total = 0
    try:
        with gzip.open(archive) as unzipped, tarfile.open(fileobj=_Capped(unzipped, where), mode="r|") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise GcbenchError(f"{where}: more than {MAX_MEMBERS} entries; not an archive of validate")
                path = _member_path(member, where)
                if path is None:
                    continue
                if member.isdir():
                    folders.add(path)
                    continue
                total += member.size
                if total > MAX_ARCHIVE_BYTES:  # from the header, before any of its bytes are inflated
                    raise GcbenchError(f"{where}: its files unpack to more than {MAX_ARCHIVE_BYTES // 2**20} MiB "
                                       f"(at {member.name[:120]!r}); not an archive of validate")
                if path in files:
                    raise GcbenchError(f"{where}: {member.name[:120]!r} is in it twice")
                files[path] = _read(tar, member, MAX_ARCHIVE_BYTES - (total - member.size), where)
    except (OSError, tarfile.TarError, EOFError, zlib.error) as e:
        raise GcbenchError(f"{where}: not an archive gcbench validate --archive wrote ({e})") from None
    staged = Staged(_gpu_folder(files, folders, where))
    _refuse_collisions(files, folders, where)
    for path, data in files.items():
        relative = PurePosixPath(*path.parts[3:])
        try:
            staged.texts[relative] = text = data.decode()
        except UnicodeDecodeError:
            raise GcbenchError(f"{where}: {str(path)!r} is not UTF-8 text") from None
        if path.suffix == ".jsonl":
            staged.records[relative] = _records(text, f"{where}: {path}")
    if not any(staged.records.values()):
        raise GcbenchError(f"{where}: holds no records (no .jsonl line); nothing to import")
    return staged


class _Capped:
    """A stream that refuses to give more than the cap (and the tar headers' room) of inflated bytes: a header
    tarfile reads whole (a pax header) cannot claim gigabytes of memory either."""

    def __init__(self, stream: Any, where: str):
        self.stream, self.where, self.left = stream, where, MAX_ARCHIVE_BYTES + 512 * (2 * MAX_MEMBERS + 20)

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > self.left:
            size = self.left + 1
        data = self.stream.read(size)
        self.left -= len(data)
        if self.left < 0:
            raise GcbenchError(f"{self.where}: it unpacks to more than {MAX_ARCHIVE_BYTES // 2**20} MiB; not an "
                               "archive of validate")
        return data


def _member_path(member: tarfile.TarInfo, where: str) -> PurePosixPath | None:
    """The member's path from the repository root ("./" in front taken off; None for the archive's own "."); a
    GcbenchError for a name or a type an archive of validate never holds."""
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/") if member.isdir() else name
    if name in ("", ".") and member.isdir():
        return None
    path = PurePosixPath(name)
    parts = path.parts
    kind = "" if member.isdir() or (member.isreg() and not member.issparse()) else "not a plain file or folder: "
    plain = name == "/".join(parts) and all(_PLAIN.fullmatch(p) for p in parts[3:])
    inside = len(parts) >= 1 and parts[0] == "results" and (len(parts) < 2 or parts[1] in (ROOT.name, SMOKE_ROOT.name))
    gpu = len(parts) < 3 or (SLUG.fullmatch(parts[2]) is not None and len(parts[2]) <= 64 and parts[2] not in RESERVED)
    ancestor = member.isdir() and len(parts) <= 3
    if kind or not plain or not inside or not gpu or (len(parts) < 4 and not ancestor) \
            or (member.isreg() and path.suffix not in SUFFIXES):
        raise GcbenchError(f"{where}: unexpected entry {kind}{member.name[:120]!r} (an archive of gcbench validate "
                           f"holds results/gpu/<gpu>/*{'|'.join(SUFFIXES)} files only, <gpu> a name like "
                           "nvidia-h200)")
    return path


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, room: int, where: str) -> bytes:
    """The member's bytes, never more than `room` of them whatever its header claimed."""
    handle = tar.extractfile(member)
    data = handle.read(room + 1) if handle is not None else b""
    if len(data) > room:
        raise GcbenchError(f"{where}: its files unpack to more than {MAX_ARCHIVE_BYTES // 2**20} MiB")
    return data


def _gpu_folder(files: dict[PurePosixPath, bytes], folders: set[PurePosixPath], where: str) -> PurePosixPath:
    """The one GPU folder every file (and every folder below results/gpu/<gpu>) is in."""
    found = {PurePosixPath(*p.parts[:3]) for p in files} | {PurePosixPath(*p.parts[:3]) for p in folders
                                                           if len(p.parts) >= 3}
    if len(found) != 1 or not files:
        shown = ", ".join(sorted(str(f) for f in found)[:3])
        raise GcbenchError(f"{where}: holds {len(found)} GPU folders{f' ({shown})' if found else ''}, expected "
                           "one with files")
    return found.pop()


def _refuse_collisions(files: dict[PurePosixPath, bytes], folders: set[PurePosixPath], where: str) -> None:
    """A name that is a file and also a folder of another entry: the archive cannot be unpacked as it is."""
    parents = {parent for path in files for parent in path.parents} | folders
    clash = next((path for path in sorted(files) if path in parents), None)
    if clash is not None:
        raise GcbenchError(f"{where}: {str(clash)!r} is both a file and a folder in it")


def _records(text: str, where: str) -> list[tuple[int, dict[str, Any]]]:
    """Every line of a .jsonl member a record this gcbench reads (blank lines aside); a torn last line too is
    refused here: the GPU side's files end whole when the archive is written."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = parse_records(text.splitlines(), where)
    if caught:  # read_records would skip it, as the end of an interrupted run: an archive's files end whole
        raise GcbenchError(f"{where}: its last line is not a JSON object (cut short?)")
    for number, record in records:
        problem = record_problem(record)
        if problem:
            raise GcbenchError(f"{where}:{number}: not a record ({problem})")
    return records
