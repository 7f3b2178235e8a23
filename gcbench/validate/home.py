"""Bringing a GPU window's results home in one move: the archive `gcbench validate --archive` wrote on the GPU
machine is checked whole (unpack.py), then merged into results/gpu/<gpu>/ of this checkout, that GPU's report
re-rendered into docs/gpu-report/<gpu>/, and the GPU numbers the README and docs/gpu.md quote regenerated from the
records of every GPU folder (between their `gpu-results` markers; never by hand). A refused archive leaves the tree
as it was: nothing is written before every member has been read and checked.

The checkout is the folder the command runs in, or the nearest one above it whose pyproject.toml is gcbench's (as
git finds its repository): results and reports land beside the README that quotes them, never in a stray folder.

A smoke archive (results/gpu-smoke/..., the fake GPU or tiny models) is merged and reported into its own folder and
never quoted: those are no GPU numbers.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.results.schema import version_order
from gcbench.results.store import newest_positions, parse_records
from gcbench.validate.quote import BEGIN, END, quoted_block
from gcbench.validate.unpack import Staged, stage_archive

QUOTED = ("README.md", "docs/gpu.md")  # the files whose GPU numbers come from the records
REPORTS = Path("docs/gpu-report")  # one report per GPU: docs/gpu-report/<gpu>/
_PROJECT = re.compile(r'^name\s*=\s*"gcbench"\s*$', re.M)


@dataclass
class Imported:
    folder: Path
    smoke: bool
    files: int = 0
    records_added: int = 0
    report: Path | None = None
    quoted: list[Path] = field(default_factory=list)


def checkout_root(start: Path) -> Path:
    """The gcbench checkout `start` is in: itself or the nearest folder above holding gcbench's pyproject.toml;
    GcbenchError where there is none (an import belongs beside the README that quotes it)."""
    for folder in (start.absolute(), *start.absolute().parents):
        if is_checkout(folder):
            return folder
    raise GcbenchError(f"{str(start)[:200]!r} is not in a gcbench checkout (no pyproject.toml of gcbench here or "
                       "above): run validate --import in the checkout the results belong to")


def is_checkout(folder: Path) -> bool:
    try:
        return _PROJECT.search((folder / "pyproject.toml").read_text(errors="replace")) is not None
    except OSError:
        return False


def import_archive(archive: Path, root: Path = Path(".")) -> Imported:
    """Merge `archive` into `root`/results/gpu[-smoke]/<gpu>/ (each record once: a record already here is not added
    twice, a newer version of one replaces it where it stood), then render that GPU's report and update the quotes.
    Bad archives, and archives that cannot be merged into this tree, are refused before anything is written."""
    if not is_checkout(root):
        raise GcbenchError(f"{str(root)[:200]!r} is not a gcbench checkout (no pyproject.toml of gcbench)")
    staged = stage_archive(archive)
    result = Imported(root / staged.folder, smoke=staged.smoke)
    writes = _planned_writes(staged, root, result)
    # What the tree held, for a render that fails on what was merged (a record no table can show, a folder the
    # report cannot read): the results and the quoting pages go back as they were, rather than stay merged without
    # their report (render publishes the report last, whole or not at all).
    before = {target: target.read_bytes() if target.exists() else None for target in writes}
    quoting = {page: page.read_bytes() for page in (root / name for name in QUOTED) if page.is_file()}
    folders = sorted({f for t in writes for f in t.parents if f.is_relative_to(root) and not f.exists()},
                     key=lambda f: len(f.parts), reverse=True)
    try:
        for target, data in writes.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_bytes(target, data)
        result.report, result.quoted = render(root, result.folder, result.smoke)
    except BaseException:
        for target, data in before.items():
            if data is None:
                target.unlink(missing_ok=True)
            else:
                _write_bytes(target, data)
        for page, data in quoting.items():
            if page.read_bytes() != data:
                _write_bytes(page, data)
        for folder in folders:  # deepest first; only those this import made, and only while empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    result.files = len(staged.texts)
    return result


def render(root: Path, folder: Path, smoke: bool = False) -> tuple[Path, list[Path]]:
    """`folder`'s report and the quoted blocks (README.md, docs/gpu.md) made again from the records as they stand:
    after an import, or after records were moved to results/gpu/superseded/. The quotes are written first, the
    report published last (report/publish.py: whole or not at all), so that a caller that keeps the pages' old
    bytes can put everything back when the report fails. Returns the report's folder and the files whose block
    changed."""
    from gcbench.report.document import write_report
    from gcbench.results.frame import load_results, results_frame

    report = folder / "report" if smoke else root / REPORTS / folder.name
    frame, _ = load_results([folder])
    frame["source"] = [os.path.relpath(source, root) for source in frame["source"]]  # named from the checkout
    quoted = []
    if not smoke:
        block = quoted_block(root)
        quoted = [root / name for name in QUOTED if update_quote(root / name, block)]
    write_report(results_frame(frame), report)
    return report, quoted


def _planned_writes(staged: Staged, root: Path, result: Imported) -> dict[Path, bytes]:
    """Each file the import changes and its new bytes (files left as they are left out); GcbenchError where the
    tree cannot take them (a file where a folder must go, or a results file here that does not read)."""
    writes: dict[Path, bytes] = {}
    for relative, text in sorted(staged.texts.items()):
        target = result.folder / relative
        _check_room(target, root)
        old = target.read_bytes() if target.exists() else None
        if relative in staged.records:
            data, added = _merged(target, old, text, staged.records[relative])
            result.records_added += added
        else:
            data = text.encode()
        if data != old:
            writes[target] = data
    if not result.smoke:
        _check_room(root / REPORTS / result.folder.name / "report.md", root)
    return writes


def _check_room(target: Path, root: Path) -> None:
    """`target` can be written as a regular file: every folder on its way from `root` is a folder (or absent) and
    it is a regular file or absent."""
    for folder in reversed(target.parents):
        if folder.is_relative_to(root) and folder != root and (folder.is_symlink() or folder.exists()) \
                and not folder.is_dir():
            raise GcbenchError(f"cannot import into {str(folder)!r}: a file stands where a folder must go")
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise GcbenchError(f"cannot import into {str(target)!r}: not a regular file")
    if len(f".{target.name}.XXXXXXXX.part".encode()) > os.pathconf(root, "PC_NAME_MAX"):  # _write_bytes's partial
        raise GcbenchError(f"cannot import {target.name[:60]!r}...: its name is too long for this file system")


def _merged(target: Path, old: bytes | None, text: str, incoming: list[tuple[int, dict[str, Any]]]) \
        -> tuple[bytes, int]:
    """`target`'s records and the archive's (its newest versions), each record once, as read_records reads them: a
    line equal to one before it dropped, a record's newer version (the same record_id and config) where its first
    one stood. Lines are kept as written (one JSON object each). Returns the new bytes and how many are new."""
    try:
        have_lines = old.decode().splitlines() if old is not None else []
    except UnicodeDecodeError:
        raise GcbenchError(f"{str(target)!r} is not a results file (not UTF-8 text); the archive is not merged into "
                           "it") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line here is dropped, as the next append would
        have = [(have_lines[n - 1], r) for n, r in parse_records(have_lines, str(target))]
    lines = text.splitlines()
    theirs = [(lines[n - 1], r) for n, r in incoming]
    theirs = [theirs[i] for i in newest_positions([r for _, r in theirs])]
    # A version older than one here never replaces it, whichever file it comes in (an archive of an earlier call of
    # the same window, or of an earlier window whose config a later one ran again, imported late).
    newest: dict[str, tuple[str, bool]] = {}
    for _, r in have:
        if isinstance(r.get("record_id"), str):
            newest[r["record_id"]] = max(newest.get(r["record_id"], version_order(r)), version_order(r))
    theirs = [(line, r) for line, r in theirs if not isinstance(r.get("record_id"), str)
              or version_order(r) >= newest.get(r["record_id"], version_order(r))]
    # A line equal to one here (any version of it, even one a later line replaced) is nothing new: re-importing an
    # archive, or an older one, never puts back a version this file already moved past.
    pairs, seen = [], set()
    for line, record in have + theirs:
        same = json.dumps(record, sort_keys=True, default=str)
        if same not in seen:
            seen.add(same)
            pairs.append((line.strip(), record))
    kept = newest_positions([record for _, record in pairs])
    before = len(newest_positions([record for _, record in have]))
    return "".join(f"{pairs[i][0]}\n" for i in kept).encode(), len(kept) - before


def _write_bytes(target: Path, data: bytes) -> None:
    """`target` replaced whole: the new bytes written beside it, fsynced, renamed over it (a failure leaves it as it
    was, and no partial file)."""
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(handle, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~umask)  # not mkstemp's 600
        with os.fdopen(handle, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def update_quote(path: Path, block: str) -> bool:
    """Replace what stands between the markers in `path` with `block`; False when the file has no markers."""
    try:
        text = path.read_text()
    except OSError:
        return False
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        return False
    _write_bytes(path, pattern.sub(lambda _: f"{BEGIN}\n{block.rstrip()}\n{END}", text).encode())
    return True
