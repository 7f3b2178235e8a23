"""The GPU numbers the README and docs/gpu.md quote (between their `gpu-results` markers), rendered from the records
of every GPU folder under results/gpu/ (never typed by hand): a section per GPU, each leading with the configs where
the policy changes the peak, beside the time it costs.

What leads: the whole models at the default levers (bf16, AdamW, no adapter), where some policy saves at least
MIN_SAVING of none's peak; the largest models first, at most PER_MODEL shapes of one model and SHAPES in all.
Configs where no policy moves the peak are named after the table (there the optimizer step or the model state sets
the peak, and a newcomer should not read them as what checkpointing does). OOM records are not quoted: the table
holds what ran. Reports (figures, every record) are in docs/gpu-report/<gpu>/.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gcbench.results.schema import Status, config_key, config_label, peak_bytes, policy_label
from gcbench.results.store import read_records
from gcbench.text import md_text
from gcbench.units import fmt_bytes
from gcbench.validate.plan import ROOT
from gcbench.validate.unpack import RESERVED, SLUG

BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
NO_RECORD = "No GPU record yet: no GPU window has run tier 1 of the plan."
MIN_SAVING = 0.10  # a policy "changes the peak" when it saves this much of none's
FLAT = 0.05  # no policy moves the peak by this much: named, not tabled
PER_MODEL, SHAPES = 2, 4
WIDTH = 100  # the README's prose lines; the table's rows stay within it too


@dataclass
class Shape:
    """One config under several policies (the records of one file that differ in the policy alone)."""
    records: list[dict[str, Any]]

    @property
    def none(self) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if policy_label(r) == "none"), None)

    @property
    def levers(self) -> list[str]:
        # config_label names the levers set away from their defaults after the shape and policy
        return config_label(self.records[0]).split(" · ")[1:]

    @property
    def plain(self) -> bool:
        """The whole model at the default levers: what a newcomer's first run would be."""
        return not self.records[0].get("layers") and not self.levers

    def saving(self) -> float:
        """The largest share of none's peak a policy saves (0 without none's peak)."""
        none = self.none
        base = peak_bytes(none) if none else None
        return max((1 - peak_bytes(r) / base for r in self.records), default=0.0) if base else 0.0

    def spread(self) -> float:
        peaks = [peak_bytes(r) for r in self.records]
        return 1 - min(peaks) / max(peaks)

    def name(self) -> str:
        first = self.records[0]
        blocks = f" ({first['layers']} blocks)" if first.get("layers") else ""
        return md_text(" · ".join([f"{first['model']}{blocks} · seq {first['seq_len']} · batch "
                                    f"{first['batch_size']}", *self.levers]))


def quoted_block(root: Path) -> str:
    """The whole quoted block: a section per GPU folder under `root`/results/gpu/ (by name), or NO_RECORD."""
    gpus = root / ROOT
    folders = sorted(f for f in gpus.iterdir() if f.is_dir() and SLUG.fullmatch(f.name)
                     and f.name not in RESERVED) if gpus.is_dir() else []
    sections = [gpu_results_block(f, shown=f.relative_to(root).as_posix()) for f in folders]
    return "\n\n".join(s for s in sections if s != NO_RECORD) or NO_RECORD


def gpu_results_block(folder: Path, shown: str | None = None) -> str:
    """One GPU's section: where it was measured, the configs where the policy changes the peak (peak, activation
    peak, step time and its ratio to none's per policy), the configs where none does, the prediction error, the
    harness overhead. `shown`: the folder as the text names it (its path from the repository root)."""
    shapes = _shapes(folder)
    if not shapes:
        return NO_RECORD
    lead = _lead(shapes)
    first = (lead[0] if lead else shapes[0]).records[0]
    env = {k: md_text(v) for k, v in (first.get("env") or {}).items() if v is not None}  # text of the archive's
    head = (f"Measured on {env.get('gpu_name', 'a GPU')} (torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
            f"driver {env.get('driver', '?')}), gcbench {str(env.get('git_sha', '?'))[:8]}; records in "
            f"`{shown or folder.as_posix()}/`, figures and every record in its report.")
    parts = [_wrap(head)]
    if lead:
        parts += [_wrap(f"Where the policy changes the peak ({md_text(first.get('precision'))}, "
                        f"{md_text(first.get('optimizer'))}, "
                        "the whole model):"), _table(lead), _wrap(
            "peak: max_memory_allocated over the whole step; activations: the forward and backward peak above the "
            "weights, gradients and optimizer state; time x none: the step time against none's, timed paired and "
            "interleaved (with † where only the medians of separate runs compare).")]
    else:
        parts.append(_wrap(f"No policy changes the peak by {MIN_SAVING:.0%} or more in these records."))
    flat = [s for s in shapes if s.spread() < FLAT and len(s.records) > 1]
    if flat:
        parts.append(_wrap(f"No policy moves the peak by {FLAT:.0%} at " + "; ".join(
            _flat_text(s) for s in sorted(flat, key=lambda s: not s.plain)[:3]) + "."))
    parts += [_wrap(line) for line in (_prediction_line(shapes), _overhead_line(folder / "overhead.txt")) if line]
    return "\n\n".join(parts)


def _shapes(folder: Path) -> list[Shape]:
    """The OK records of `folder`'s files, by file and config apart from the policy; a config in two files is
    shown from the one that holds the most policies. Fit trials are a search, not a comparison: left out."""
    found: dict[tuple[Any, ...], Shape] = {}
    for path in sorted(folder.glob("*.jsonl")):
        groups: dict[str, Shape] = {}
        for r in read_records(path):
            # what ran on a GPU (a CPU record dropped in a GPU folder is no GPU number to quote)
            if r.get("status") == Status.OK and peak_bytes(r) and not r.get("fit_id") and \
                    str(r.get("device")).startswith("cuda") and (r.get("env") or {}).get("gpu_name"):
                key = config_key(r, ignore=("policy", "policy_options"))
                groups.setdefault(key, Shape([])).records.append(r)
        for shape in groups.values():
            first = shape.records[0]
            name = (first["model"], first.get("layers"), first["seq_len"], first["batch_size"], *shape.levers)
            if name not in found or len(shape.records) > len(found[name].records):
                found[name] = shape
    return list(found.values())


def _lead(shapes: list[Shape]) -> list[Shape]:
    """The shapes the section leads with: plain ones that save (any that save where no plain one does), the largest
    models first, then the largest saving."""
    saving = [s for s in shapes if s.none is not None and s.saving() >= MIN_SAVING]
    chosen = [s for s in saving if s.plain] or saving
    chosen.sort(key=lambda s: (-(s.records[0].get("n_params") or 0), -s.saving()))
    lead: list[Shape] = []
    for shape in chosen:
        if sum(s.records[0]["model"] == shape.records[0]["model"] for s in lead) < PER_MODEL:
            lead.append(shape)
    return lead[:SHAPES]


def _table(shapes: Sequence[Shape]) -> str:
    lines = ["| config | policy | peak | activations | step | time x none |", "|---|---|---:|---:|---:|---:|"]
    for shape in shapes:
        none = shape.none
        for i, r in enumerate(sorted(shape.records, key=lambda r: policy_label(r) != "none")):
            act = r.get("activation_peak_bytes")
            ms = _median(r)
            lines.append(f"| {shape.name() if i == 0 else ''} | {md_text(policy_label(r))} | "
                         f"{fmt_bytes(peak_bytes(r))} | {fmt_bytes(act) if act is not None else '-'} | "
                         f"{f'{ms:.1f} ms' if ms else '-'} | "
                         f"{_time_ratio(r, none)} |")
    return "\n".join(lines)


def _time_ratio(record: dict[str, Any], none: dict[str, Any] | None) -> str:
    """The paired ratio the record holds against none, else the ratio of the medians (marked †)."""
    if policy_label(record) == "none":
        return "1.00"
    if record.get("time_ratio") and record.get("time_ratio_vs") == "none":
        return f"{record['time_ratio']:.2f}"
    ms, base = _median(record), _median(none) if none else None
    return f"{ms / base:.2f}†" if ms and base else "-"


def _flat_text(shape: Shape) -> str:
    peaks = sorted(peak_bytes(r) for r in shape.records)
    low, high = fmt_bytes(peaks[0]), fmt_bytes(peaks[-1])
    span = low if low == high else f"{low.split()[0]}–{high}" if low.split()[1] == high.split()[1] else \
        f"{low}–{high}"
    lowest = min(shape.records, key=peak_bytes)
    why = ", the optimizer step's peak" if lowest.get("peak_phase") == "optimizer" else ""
    return f"{shape.name()} ({span} under {len(shape.records)} policies{why})"


def _prediction_line(shapes: list[Shape]) -> str | None:
    errors = [abs(r["predicted_peak_bytes"] - peak_bytes(r)) / peak_bytes(r) for s in shapes for r in s.records
              if r.get("predicted_peak_bytes")]
    if not errors:
        return None
    return (f"Peaks predicted before the window vs measured (max_memory_allocated), over the {len(errors)} of this "
            f"GPU's records that carry their run's own prediction (--predict on): median error "
            f"{statistics.median(errors):.1%}, worst {max(errors):.1%}.")


def _median(record: dict[str, Any]) -> float | None:
    if record.get("step_ms_median"):
        return float(record["step_ms_median"])
    steps = record.get("step_ms") or []
    return statistics.median(steps) if steps else None


def _overhead_line(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if "ratio gcbench / bare" in line), None)
    return f"Harness overhead: {md_text(line.strip())}." if line else None


def _wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)
