"""Putting a finished report into its directory (`report --out DIR`) so that nothing is lost: only files gcbench
wrote there are replaced or removed, and a kill at any moment leaves the old report or the new one.

DIR/.gcbench-report.json lists the report's own files with their SHA-256; a file not listed (or changed since) is
the user's: it is never overwritten, moved or removed, and one that has a report file's name stops the write. The
new report is made in a hidden staging folder inside DIR (same file system: each move is one atomic rename), whose
journal names every file about to be replaced; each old file is kept (a hard link) until the new manifest is in
place, the one step that commits. A write that fails puts the old files back at once; a write that was killed is
finished or put back by the next `report --out DIR` before it starts (the manifest says which), and its staging
folder removed. Only report.md, whose figures are separate files, can show a mix of old and new figures, and
only between a kill in the last moves and the next run; report.html embeds its figures and is always whole.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import secrets
from collections.abc import Callable
from pathlib import Path

from gcbench.errors import GcbenchError
from gcbench.results.store import missing_folders, remove_empty
from gcbench.text import plain

MANIFEST = ".gcbench-report.json"
# + a random id: the staging folder, inside DIR. Earlier versions made theirs beside DIR (tempfile.mkdtemp) with no
# mark of their own: a user's folder can look the same, so one a kill left there is never removed (issue 48).
STAGING = ".gcbench-report-"
STAGING_NAME = re.compile(r"\.gcbench-report-[0-9a-f]{8}")
FIGURE_NAME = re.compile(r"figures/[1-9]-[a-z0-9-]+\.(png|svg)")  # what write_figures names its files
PAGES = ("report.md", "report.html")  # moved last: a reader opens these


def _own(rel: object) -> bool:
    """A name this module writes in DIR: a page, the manifest, a figure. The manifest and a staging folder's journal
    are files in DIR, which anyone who hands over the folder wrote: a name in them that is not one of these (an
    absolute path, ../, a folder that is a link) is never moved, replaced or removed."""
    return isinstance(rel, str) and (rel in PAGES or rel == MANIFEST or FIGURE_NAME.fullmatch(rel) is not None)


def publish(out: Path, make: Callable[[Path], None]) -> list[Path]:
    """Make the report with `make(folder)` (report.md, report.html, figures/ under `folder`) and put it into `out`;
    the report's files as written, pages first. GcbenchError, with `out` as it was, where that cannot be done."""
    where = repr(plain(out))
    check_folder(out, pages=False)  # the pages once a killed write is recovered, under the lock (below)
    created = missing_folders(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
    except OSError as e:
        remove_empty(created)
        raise GcbenchError(f"cannot write the report to {where}: {e.strerror or e}") from None
    stage: Path | None = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel, even on a kill
        except BlockingIOError:
            raise GcbenchError(f"another `gcbench report` is writing to {where} now; run again when it has "
                               "finished") from None
        for old in sorted(out.glob(STAGING + "*")):  # none can be live: their writers held this lock
            if _is_staging(old):
                recover(out, old)
        _refuse_theirs(out, PAGES)  # before the figures are drawn: the common refusal, at once
        stage = out / (STAGING + secrets.token_hex(4))
        (stage / "new").mkdir(parents=True)
        make(stage / "new")
        written = [out / rel for rel in _swap(out, stage)]
    except OSError as e:
        raise GcbenchError(f"cannot write the report to {where}: {e.strerror or e}; the previous report is left "
                           "as it was") from None
    finally:
        if stage is not None and _settled(out, stage):
            shutil.rmtree(stage, ignore_errors=True)
        os.close(fd)
        remove_empty(created)  # only where nothing was written
    return sorted(written, key=lambda p: (p.name not in PAGES, str(p)))


def check_folder(out: Path, pages: bool = True) -> None:
    """GcbenchError where a report cannot go into `out` as it stands (a file, figures as a link, and with `pages` a
    page there that is not gcbench's): said before a command prints its tables, and again by publish, under its
    lock. A killed write's staging folder leaves the pages to publish, which finishes or undoes it first."""
    where = repr(plain(out))
    try:
        if out.exists() and not out.is_dir():
            raise GcbenchError(f"{where} is a file, not a directory")
        if (out / "figures").is_symlink():  # its figures would be written, replaced and removed where it points
            raise GcbenchError(f"{where} holds figures as a link, not a folder: it is left as it is; move it away or "
                               "write the report elsewhere")
        if pages and out.is_dir() and not any(_is_staging(old) for old in out.glob(STAGING + "*")):
            _refuse_theirs(out, PAGES)
    except OSError as e:  # a name too long for the file system, a folder on the way that cannot be read
        raise GcbenchError(f"cannot write the report to {where}: {e.strerror or e}") from None


def recover(out: Path, stage: Path) -> None:
    """Finish or undo the write that left `stage` behind (killed): committed (the manifest is its own) -> remove
    what it replaced; not committed -> put every old file back and remove the new ones it had moved in."""
    journal = _journal(stage)  # None: killed before or while writing its journal, which precedes every move
    if journal is not None:
        if _manifest(out).get("id") == journal["id"]:
            _remove_ours(out, journal["obsolete"])
        else:
            _undo(out, stage, journal)
    shutil.rmtree(stage, ignore_errors=True)


def _settled(out: Path, stage: Path) -> bool:
    """Nothing in `stage` is needed any more: its write committed, or it has no old file left to put back (one that
    could not be put back stays, for the next run's `recover`)."""
    journal = _journal(stage)
    if journal is None:
        return True
    return _manifest(out).get("id") == journal["id"] or not any(p.is_file() for p in (stage / "old").rglob("*"))


def _journal(stage: Path) -> dict | None:
    """`stage`'s journal, None where it has none that reads (a write killed before or while writing it)."""
    if not _regular(stage / "journal.json"):
        return None
    try:
        return json.loads((stage / "journal.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None


def _is_journal(journal: object) -> bool:
    """A journal as _swap writes it, naming only files of a report (_own)."""
    if not isinstance(journal, dict) or not isinstance(journal.get("id"), str) or \
            not isinstance(journal.get("figures_made", False), bool):
        return False
    lists = [journal.get(k) for k in ("files", "had")]
    maps = [journal.get(k) for k in ("new", "obsolete")]
    return all(isinstance(names, list) and all(map(_own, names)) for names in lists) and \
        all(isinstance(shas, dict) and all(_own(rel) and isinstance(sha, str) for rel, sha in shas.items())
            for shas in maps)


def _swap(out: Path, stage: Path) -> list[str]:
    """Move the report made in `stage`/new into `out`; the files moved in (the manifest aside)."""
    new, old = stage / "new", stage / "old"
    files = _files(new)
    ours = _refuse_theirs(out, files)
    txid = secrets.token_hex(8)
    shas = {rel: _sha(new / rel) for rel in files}
    obsolete = {rel: sha for rel, sha in ours.items() if rel not in shas}
    (new / MANIFEST).write_text(json.dumps({"id": txid, "files": shas}, indent=1) + "\n")
    # Figures first, the pages after them, the manifest last: its rename is the commit.
    order = sorted(files, key=lambda rel: (rel in PAGES, PAGES.index(rel) if rel in PAGES else 0, rel)) + [MANIFEST]
    journal = {"id": txid, "files": order, "new": shas | {MANIFEST: _sha(new / MANIFEST)},
               "had": [rel for rel in order if _exists(out / rel)],  # put back, never removed: maybe drawn the same
               "figures_made": not (out / "figures").exists(), "obsolete": obsolete}
    _write_synced(stage / "journal.json", json.dumps(journal))
    try:
        (out / "figures").mkdir(exist_ok=True)
        for rel in order:
            if _exists(out / rel):
                (old / rel).parent.mkdir(parents=True, exist_ok=True)
                _keep(out / rel, old / rel)
            os.replace(new / rel, out / rel)
    except BaseException:
        _undo(out, stage, journal)  # an error, Ctrl-C or SIGTERM: the old report, whole
        raise
    try:
        _remove_ours(out, obsolete)
    except OSError:
        pass  # committed: an earlier figure left behind is no reason to report a failure
    return files


def _refuse_theirs(out: Path, files: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The report now in `out` (as `_ours`); GcbenchError where one of `files` is there but is not its own."""
    ours = _ours(out)
    theirs = [rel for rel in files if _exists(out / rel) and ((sha := _sha(out / rel)) is None or ours.get(rel) != sha)]
    if _exists(out / "figures") and (not (out / "figures").is_dir() or (out / "figures").is_symlink()):
        theirs.insert(0, "figures")
    if theirs:
        raise GcbenchError(f"{plain(out)!r} already has {', '.join(map(plain, theirs[:3]))}"
                           f"{' ...' if len(theirs) > 3 else ''}, not written by gcbench (or changed since): it is "
                           "left as it is; move it away (or write the report elsewhere)")
    return ours


def _undo(out: Path, stage: Path, journal: dict) -> None:
    """Put back every file the journal's write replaced (one not yet replaced is still the old one), and remove
    the ones it added (by their content: a file the user made since stays)."""
    for rel in reversed(journal["files"]):
        kept = stage / "old" / rel
        if kept.exists() and _exists(out / rel) and os.path.samefile(kept, out / rel):
            kept.unlink()  # not replaced yet (rename between two links of one file would do nothing)
        elif kept.exists():
            os.replace(kept, out / rel)
        elif rel not in journal["had"] and (sha := _sha(out / rel)) is not None and sha == journal["new"].get(rel):
            (out / rel).unlink()
    if journal.get("figures_made"):
        remove_empty([out / "figures"])


def _ours(out: Path) -> dict[str, str]:
    """The files of the report now in `out` (path relative to out -> SHA-256). Without a manifest (a report of an
    earlier gcbench), the files its pages and figures are named like, where its pages say it is a gcbench report."""
    manifest = _manifest(out)
    if manifest:
        return manifest.get("files", {})
    heads = {"report.md": "# gcbench report", "report.html": "<title>gcbench report"}
    found = {}
    for page, mark in heads.items():
        if not _regular(out / page):
            continue
        try:
            with open(out / page, "rb") as f:
                if mark.encode() in f.read(400):
                    found[page] = _sha(out / page)
        except OSError:
            continue
    if "report.md" in found:
        # An earlier gcbench's figures are those its report.md links to (PNG and SVG), nothing else in figures/:
        # a file of the user's there may look like one (figures/8-my-notes.png) and must stay.
        page = (out / "report.md").read_text(errors="replace")
        linked = set(re.findall(r"\((figures/[^()\s]+\.(?:png|svg))\)", page))
        for rel in sorted(linked):
            path = out / rel
            if FIGURE_NAME.fullmatch(rel) and path.is_file() and not path.is_symlink():
                found[rel] = _sha(path)
    return found


def _remove_ours(out: Path, files: dict[str, str]) -> None:
    """Remove the files of an earlier report that the new one no longer has, each only if it is as gcbench wrote
    it."""
    for rel, sha in files.items():
        if _exists(out / rel) and not (out / rel).is_symlink() and _sha(out / rel) == sha:
            (out / rel).unlink()


def _manifest(out: Path) -> dict:
    """The manifest in `out`: its id and the report's files (name -> SHA-256), names not a report's left out
    (_own); {} where there is none that reads."""
    if not _regular(out / MANIFEST):
        return {}
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {}
    return {"id": manifest.get("id"),
            "files": {rel: sha for rel, sha in manifest["files"].items() if _own(rel) and isinstance(sha, str)}}


def _is_staging(folder: Path) -> bool:
    """A staging folder this module made (its name, its contents): only such a folder is finished and removed."""
    if not STAGING_NAME.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
        return False
    if not {p.name for p in folder.iterdir()} <= {"new", "old", "journal.json"}:
        return False
    for top, dirs, files in os.walk(folder):  # a link in it would move or replace files where it points
        if any(os.path.islink(os.path.join(top, name)) for name in dirs + files):
            return False
    journal = _journal(folder)
    return journal is None or _is_journal(journal)


def _keep(path: Path, kept: Path) -> None:
    """`path`'s file, also at `kept` (a hard link; a copy where the file system has none)."""
    try:
        os.link(path, kept)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(path, kept)


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _regular(path: Path) -> bool:
    """A regular file, not a link: only such a file is read (a FIFO would block the read) or counted as ours."""
    return not path.is_symlink() and path.is_file()


def _sha(path: Path) -> str | None:
    if not _regular(path):
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
