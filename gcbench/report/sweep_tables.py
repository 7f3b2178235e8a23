"""The tables `gcbench sweep` prints: the grid before it runs (--dry-run), every config's status and headline
numbers after, and the largest config that fit. Plain records in, rich Tables out: nothing here runs a sweep."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
from rich import box
from rich.console import Group
from rich.table import Table

from gcbench.report.cells import OTHER_BASELINE, largest_fit_grid, time_ratio_text
from gcbench.report.tables import rich_table
from gcbench.results.frame import given, paired_ratio_trusted, results_frame
from gcbench.fields import RUN_FIELDS, Role
from gcbench.results.schema import LEVER_FIELDS, STATUSES, lever_text, note_kinds, peak_bytes, policy_label
from gcbench.text import fits, markup
from gcbench.units import fmt_bytes, plural

STATUS_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "timeout": "red", "error": "bold red"}


def setup_texts(records: list[dict[str, Any]]) -> list[str] | None:
    """Per record, the setup fields (fields.py: the levers and the rest of a setup) that differ between `records`,
    in a few words ("32 layers · adamw-loop · optimizer in backward"); None when no such field varies."""
    varying = [f for f in RUN_FIELDS if f.role in (Role.LEVER, Role.SETUP)
               and len({str(r.get(f.name)) for r in records}) > 1]
    if not varying:
        return None
    return [" · ".join(w for f in varying if (w := f.text(r) or f.unset)) for r in records]


def grid_table(configs: Iterable[tuple[dict[str, Any], str | None]], results_file: str | Path,
               caption: str = "") -> Table:
    """`--dry-run`: every config of the grid, and whether the results file already holds it. `configs`: in grid
    order, (the spec as a record, the status of its record in `results_file`, or None when it is still to run);
    `caption`: the options every config shares."""
    configs = list(configs)
    to_run = sum(status is None for _, status in configs)
    table = Table(title=f"{plural(len(configs), 'config')} ({to_run} to run, {len(configs) - to_run} already in "
                        f"{markup(results_file)})", caption=markup(caption))
    setups = setup_texts([record for record, _ in configs])
    for col in ("#", "model", *(["setup"] if setups else []), "seq", "batch", "policy", "in results file"):
        table.add_column(col, justify="right" if col in ("#", "seq", "batch") else "left")
    for i, (record, status) in enumerate(configs, 1):
        table.add_row(str(i), markup(record["model"]), *([markup(setups[i - 1])] if setups else []),
                      str(record["seq_len"]), str(record["batch_size"]), markup(policy_label(record)),
                      status or "to run")
    return table


def summary_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per config: the columns a sweep summary shows (raw units)."""
    setups = setup_texts(records) or [""] * len(records)
    return pd.DataFrame([{
        "model": r["model"], "setup": setup, "seq_len": r["seq_len"], "batch_size": r["batch_size"],
        "policy": policy_label(r),
        "status": r["status"], "step_ms_median": r.get("step_ms_median"), "peak_bytes": peak_bytes(r),
        "activation_peak_bytes": r.get("activation_peak_bytes"), "tokens_per_s": r.get("tokens_per_s"),
        "timing_stable": r.get("timing_stable"), "time_ratio": r.get("time_ratio"),
        "time_ratio_vs": r.get("time_ratio_vs"), "time_ratio_ci": r.get("time_ratio_ci"),
        "note": r.get("error") if r["status"] != "ok" else _ok_note(r),
    } for r, setup in zip(records, setups)])


def _ok_note(record: dict[str, Any]) -> str | None:
    """Why a config that ran is not trusted or not paired, in words shared by every config alike (one footnote for
    all the configs with the same reasons; each record's timing_notes has its own numbers)."""
    parts = []
    if record.get("timing_stable") is False:
        parts.append("timing not trusted: " + ", ".join(note_kinds(record)))
    if record.get("paired_error"):
        parts.append(record["paired_error"])
    return "; ".join(parts) or None


def summary_table(records: list[dict[str, Any]], width: int | None = None) -> Table:
    """The table a sweep prints at the end: every config of the grid with its status and headline numbers. Why a
    config did not run, or why its timing is not trusted, is a numbered note under the table (each distinct reason
    once, at full width). Given a terminal `width`, `act. peak` and then `tokens/s` are left out where the table
    would not fit otherwise."""
    frame = summary_frame(records)
    counts = Counter(frame["status"]) if len(frame) else Counter()
    title = f"{plural(len(frame), 'config')}: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    models = sorted(set(frame["model"])) if len(frame) else []
    if len(models) == 1:  # one model: name it once in the title, keep the table within 80 columns
        title = f"{markup(models[0])} · {title}"
    # the levers beyond precision and optimizer (in backward, accumulation, sharding) that every config has (a
    # setup column shows them otherwise)
    varying = tuple(f for f in LEVER_FIELDS if len({str(r.get(f)) for r in records}) > 1)
    if records and (shared := lever_text(records[0], leave_out=(*varying, "precision", "optimizer"))):
        title = f"{shared} · {title}"
    paired = len(frame) > 0 and frame["time_ratio"].notna().any()
    columns = ["model", "setup", "seq", "batch", "policy", "status", "step ms", "time x", "peak", "act. peak",
               "tokens/s", "note"]
    notes: dict[str, int] = {}  # reason -> its number, in order of first appearance
    rows = []
    for row in frame.itertuples(index=False):
        ok = row.status == "ok"
        # A failure's reason, or why a timing is not trusted (each distinct text once, numbered under the table).
        note = "" if not given(row.note) else f"({notes.setdefault(str(row.note), len(notes) + 1)})"
        unstable = "~" if ok and _false(row.timing_stable) else ""
        rows.append([markup(row.model), markup(row.setup), str(row.seq_len), str(row.batch_size), markup(row.policy),
                     row.status,
                     f"{unstable}{row.step_ms_median:.1f}" if ok else "-", _time_ratio(row),
                     fmt_bytes(row.peak_bytes) if ok else "-", fmt_bytes(row.activation_peak_bytes) if ok else "-",
                     f"{row.tokens_per_s:,.0f}" if ok else "-", note])
    caption = []
    if paired:
        caption.append("time x: step time relative to none, paired: the policies of one seq x batch run interleaved "
                       "in one process; ~ = its 95% interval is wider than +-10%")
        if (frame["time_ratio_vs"].notna() & (frame["time_ratio_vs"] != "none")).any():
            caption.append(f"{OTHER_BASELINE} = none did not fit: relative to the cheapest policy that ran, the one "
                           f"at 1.00x{OTHER_BASELINE}")
    if len(frame) and frame["timing_stable"].map(_false).any():
        caption.append("~step ms = timing not trusted (the note says why; each record's timing_notes has the numbers)")
    caption += [f"({n}) {markup(text, lines=True)}" for text, n in notes.items()]
    setups = len(frame) > 0 and (frame["setup"] != "").any()
    dropped = {c for c, keep in (("model", len(models) > 1), ("setup", setups), ("time x", paired),
                                 ("note", bool(notes))) if not keep}
    # last, a long setup ("lora:r=8 · loss chunked") wraps in its column rather than cut the numbers off
    for optional in (None, "act. peak", "tokens/s", WRAP_SETUP):
        dropped |= {optional} - {None, WRAP_SETUP}
        peaks = "peak: CUDA max_memory_allocated, or on CPU the live-tensor tracker's peak" + (
            "" if "act. peak" in dropped else "; act. peak: fwd+bwd peak above model state")
        table = _summary(title, [peaks, *caption], [c for c in columns if c not in dropped], columns, rows,
                         wrap_setup=optional == WRAP_SETUP)
        if fits(table, width):
            break
    return table


WRAP_SETUP = "wrap setup"


def _summary(title: str, caption: list[str], shown: list[str], columns: list[str], rows: list[list[str]],
             wrap_setup: bool = False) -> Table:
    # A light box (no vertical rules) so that the config and its numbers fit an 80-column terminal.
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="\n".join(caption), caption_justify="left")
    index = [columns.index(c) for c in shown]
    for col, i in zip(shown, index):
        wraps = wrap_setup and col == "setup"
        table.add_column(col, justify="left" if col in ("model", "setup", "policy", "status") else "right",
                         no_wrap=not wraps, overflow="fold" if wraps else "ellipsis",
                         min_width=max(len(r[i]) for r in rows) if rows and not wraps else None)
    for row in rows:
        cells = [row[i] for i in index]
        if "status" in shown:
            at = shown.index("status")
            cells[at] = f"[{STATUS_STYLE[cells[at]]}]{cells[at]}[/]"
        table.add_row(*cells)
    return table


def _false(value: Any) -> bool:
    """A given false (timing_stable False), not a missing one (None, or NaN in a DataFrame)."""
    return given(value) and not value


def _time_ratio(row) -> str:
    """A paired time ratio as the summary shows it; ~ when its 95% interval is wider than +-10%."""
    ratio = row.time_ratio
    if row.status != "ok" or ratio is None or ratio != ratio:
        return "-"
    return time_ratio_text(ratio, row.time_ratio_vs, paired_ratio_trusted(ratio, row.time_ratio_ci))


def largest_fit_table(records: list[dict[str, Any]], width: int | None = None) -> Table | Group | None:
    """`gcbench report`'s "largest config that fit" table for these records; None when nothing ran out of memory
    (then "largest" would only mean "largest in the grid"). `width`: the terminal's (see tables.rich_table)."""
    if not records:
        return None
    # The same frame `gcbench report` builds from a results file (results.load adds policy_label and source).
    rows = [{**r, "policy_label": policy_label(r), "source": "sweep"} for r in records]
    grid = largest_fit_grid(results_frame(pd.json_normalize(rows, max_level=1)))
    return None if grid is None else rich_table(grid, width)
