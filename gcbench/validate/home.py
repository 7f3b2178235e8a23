"""Bringing a GPU window's results home in one move: the archive `gcbench validate --archive` wrote on the GPU
machine is merged into results/gpu/<gpu>/ here, the report re-rendered into docs/gpu-report/, and the GPU numbers
the README and docs/gpu.md quote regenerated from the records (between their `gpu-results` markers; never by hand).

A smoke archive (results/gpu-smoke/..., the fake GPU or tiny models) is merged and reported into its own folder and
never quoted: those are no GPU numbers.
"""

from __future__ import annotations

import re
import statistics
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.results.schema import Status, peak_bytes, policy_label
from gcbench.results.store import read_records
from gcbench.units import fmt_bytes
from gcbench.validate.plan import ROOT, SMOKE_ROOT

QUOTED = ("README.md", "docs/gpu.md")  # the files whose GPU numbers come from the records
BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
REPORT = Path("docs/gpu-report")
MAX_MEMBER_BYTES = 256 * 2**20
_PLAIN = re.compile(r"[A-Za-z0-9._-]+")  # the names validate writes (gpu_slug, step names, report files)


@dataclass
class Imported:
    folder: Path
    smoke: bool
    files: int = 0
    records_added: int = 0
    report: Path | None = None
    quoted: list[Path] = field(default_factory=list)


def import_archive(archive: Path, root: Path = Path(".")) -> Imported:
    """Merge `archive` into `root`/results/gpu[-smoke]/<gpu>/ (records are added, never removed: a line already
    here is not added twice), then render the report and update the quotes. Bad archives are refused before
    anything is written."""
    members = _members(archive)
    prefix = PurePosixPath(*PurePosixPath(members[0][0].name).parts[:3])
    result = Imported(root / prefix, smoke=prefix.parts[1] == SMOKE_ROOT.name)
    result.folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        for member, relative in members:
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            target = result.folder / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.suffix == ".jsonl":
                result.records_added += _merge_lines(target, data.decode())
            else:
                _write_bytes(target, data)
            result.files += 1
    from gcbench.report.document import write_report
    from gcbench.results.frame import load_results, results_frame

    result.report = result.folder / "report" if result.smoke else root / REPORT
    frame, _ = load_results([result.folder])
    write_report(results_frame(frame), result.report)
    if not result.smoke:
        block = gpu_results_block(result.folder, shown=prefix.as_posix())
        for name in QUOTED:
            if update_quote(root / name, block):
                result.quoted.append(root / name)
    return result


def _members(archive: Path) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    """The archive's files with their paths inside the GPU's folder; GcbenchError for anything else."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
    except (OSError, tarfile.TarError, EOFError) as e:
        raise GcbenchError(f"{str(archive)[:200]!r}: not an archive gcbench validate --archive wrote ({e})") from None
    found = []
    folders = set()
    for member in members:
        path = PurePosixPath(member.name)
        parts = path.parts
        if not member.isfile() or path.is_absolute() or ".." in parts or len(parts) < 4 \
                or parts[0] != "results" or parts[1] not in (ROOT.name, SMOKE_ROOT.name) \
                or not re.fullmatch(r"[a-z0-9-]+", parts[2]) or not all(_PLAIN.fullmatch(p) for p in parts[3:]) \
                or member.size > MAX_MEMBER_BYTES:
            raise GcbenchError(f"{str(archive)[:200]!r}: unexpected entry {member.name[:120]!r} (an archive of "
                               "gcbench validate holds results/gpu/<gpu>/ files only)")
        folders.add(parts[:3])
        found.append((member, PurePosixPath(*parts[3:])))
    if len(folders) != 1:
        raise GcbenchError(f"{str(archive)[:200]!r}: holds {len(folders)} GPU folders, expected one")
    return found


def _merge_lines(target: Path, text: str) -> int:
    """Append the archive's lines that `target` lacks; how many were added."""
    have = target.read_text().splitlines() if target.exists() else []
    known = set(have)
    new = [line for line in text.splitlines() if line.strip() and line not in known]
    if new:
        _write_bytes(target, ("".join(f"{line}\n" for line in have + new)).encode())
    return len(new)


def _write_bytes(target: Path, data: bytes) -> None:
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data)
    partial.replace(target)


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


def gpu_results_block(folder: Path, shown: str | None = None) -> str:
    """The markdown the README and docs/gpu.md quote: per policy of tier 1's config the measured peak, the
    prediction and its error, the step time and its ratio to none; then the harness overhead. From the records.
    `shown`: the folder as the text names it (its path from the repository root)."""
    tier1 = sorted(folder.glob("*-policies.jsonl"))
    records = [r for path in tier1 for r in read_records(path) if r.get("status") == Status.OK]
    if not records:
        return "No GPU record yet: no GPU window has run tier 1 of the plan."
    env = {k: v for k, v in (records[-1].get("env") or {}).items() if v is not None}
    first = records[0]
    lines = [f"Measured on {env.get('gpu_name', 'a GPU')} (torch {env.get('torch', '?')}, CUDA "
             f"{env.get('cuda', '?')}, driver {env.get('driver', '?')}), gcbench {str(env.get('git_sha', '?'))[:8]}: "
             f"{first['model']} with "
             f"{first.get('layers') or 'all'} blocks, seq {first['seq_len']}, batch {first['batch_size']}, "
             f"{first.get('precision')}; records in `{shown or folder.as_posix()}/`.", "",
             "| policy | peak allocated | predicted | error | step | time x none |", "|---|---:|---:|---:|---:|---:|"]
    none = next((r for r in records if policy_label(r) == "none"), None)
    none_ms = _median(none) if none else None
    errors = []
    for r in records:
        peak, predicted = peak_bytes(r), r.get("predicted_peak_bytes")
        error = (predicted - peak) / peak if peak and predicted else None
        if error is not None:
            errors.append(abs(error))
        ms = _median(r)
        lines.append(f"| {policy_label(r)} | {fmt_bytes(peak) if peak else '-'} | "
                     f"{fmt_bytes(predicted) if predicted else '-'} ({r.get('prediction_method') or '-'}) | "
                     f"{f'{error:+.1%}' if error is not None else '-'} | {f'{ms:.1f} ms' if ms else '-'} | "
                     f"{f'{ms / none_ms:.2f}' if ms and none_ms else '-'} |")
    if errors:
        lines += ["", f"Prediction error (predicted vs max_memory_allocated): median {statistics.median(errors):.1%}, "
                      f"worst {max(errors):.1%} over {len(errors)} policies."]
    overhead = _overhead_ratio(folder / "overhead.txt")
    if overhead:
        lines += ["", f"Harness overhead: {overhead}."]
    return "\n".join(lines)


def _median(record: dict[str, Any]) -> float | None:
    steps = record.get("step_ms") or []
    return statistics.median(steps) if steps else None


def _overhead_ratio(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if "ratio gcbench / bare" in line), None)
    return line.strip() if line else None
