"""The tables `gcbench sweep` prints: the grid before it runs (--dry-run), every config's status and headline
numbers after, and the largest config that fit. Plain records in, rich Tables out: nothing here runs a sweep."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
from rich import box
from rich.markup import escape
from rich.table import Table

from gcbench.report.grids import largest_fit_grid
from gcbench.report.tables import rich_table
from gcbench.results.frame import results_frame
from gcbench.results.schema import STATUSES, peak_bytes, policy_label
from gcbench.units import fmt_bytes

STATUS_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "timeout": "red", "error": "bold red"}


def grid_table(configs: Iterable[tuple[dict[str, Any], str | None]], results_file: str | Path,
               caption: str = "") -> Table:
    """`--dry-run`: every config of the grid, and whether the results file already holds it. `configs`: in grid
    order, (the spec as a record, the status of its record in `results_file`, or None when it is still to run);
    `caption`: the options every config shares."""
    configs = list(configs)
    to_run = sum(status is None for _, status in configs)
    table = Table(title=f"{len(configs)} configs ({to_run} to run, {len(configs) - to_run} already in "
                        f"{results_file})", caption=caption)
    for col in ("#", "model", "seq", "batch", "policy", "in results file"):
        table.add_column(col, justify="right" if col in ("#", "seq", "batch") else "left")
    for i, (record, status) in enumerate(configs, 1):
        table.add_row(str(i), record["model"], str(record["seq_len"]), str(record["batch_size"]),
                      policy_label(record), status or "to run")
    return table


def summary_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per config: the columns a sweep summary shows (raw units)."""
    return pd.DataFrame([{
        "model": r["model"], "seq_len": r["seq_len"], "batch_size": r["batch_size"], "policy": policy_label(r),
        "status": r["status"], "step_ms_median": r.get("step_ms_median"), "peak_bytes": peak_bytes(r),
        "activation_peak_bytes": r.get("activation_peak_bytes"), "tokens_per_s": r.get("tokens_per_s"),
        "note": r.get("error"),
    } for r in records])


def summary_table(records: list[dict[str, Any]]) -> Table:
    """The table a sweep prints at the end: every config of the grid with its status and headline numbers. Why a
    config did not run is a numbered note under the table (each distinct reason once, at full width), so that the
    table keeps to 80 columns however long the reasons are."""
    frame = summary_frame(records)
    counts = Counter(frame["status"]) if len(frame) else Counter()
    title = f"{len(frame)} configs: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    models = sorted(set(frame["model"])) if len(frame) else []
    if len(models) == 1:  # one model: name it once in the title, keep the table within 80 columns
        title = f"{models[0]} · {title}"
    columns = ["model", "seq", "batch", "policy", "status", "step ms", "peak", "act. peak", "tokens/s"]
    if len(models) == 1:
        columns.remove("model")
    notes: dict[str, int] = {}  # reason -> its number, in order of first appearance
    rows = []
    for row in frame.itertuples(index=False):
        ok = row.status == "ok"
        note = "" if ok or not row.note else f"({notes.setdefault(str(row.note), len(notes) + 1)})"
        rows.append([*([] if len(models) == 1 else [row.model]), str(row.seq_len), str(row.batch_size), row.policy,
                     row.status, f"{row.step_ms_median:.1f}" if ok else "-",
                     fmt_bytes(row.peak_bytes) if ok else "-", fmt_bytes(row.activation_peak_bytes) if ok else "-",
                     f"{row.tokens_per_s:,.0f}" if ok else "-", note])
    caption = ["peak: CUDA max_memory_allocated, or on CPU the live-tensor tracker's peak; act. peak: fwd+bwd peak "
               "above model state"] + [f"({n}) {escape(text)}" for text, n in notes.items()]
    # A light box (no vertical rules) so that the config and its numbers fit an 80-column terminal.
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="\n".join(caption), caption_justify="left")
    if notes:
        columns.append("note")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if col in ("model", "policy", "status") else "right", no_wrap=True,
                         min_width=max(len(r[i]) for r in rows) if rows else None)
    status = columns.index("status")
    for cells in rows:
        cells = cells[:len(columns)]
        cells[status] = f"[{STATUS_STYLE[cells[status]]}]{cells[status]}[/]"
        table.add_row(*cells)
    return table


def largest_fit_table(records: list[dict[str, Any]], width: int | None = None) -> Table | None:
    """`gcbench report`'s "largest config that fit" table for these records; None when nothing ran out of memory
    (then "largest" would only mean "largest in the grid"). `width`: the terminal's (see tables.rich_table)."""
    if not any(r["status"] == "oom" for r in records):
        return None
    # The same frame `gcbench report` builds from a results file (results.load adds policy_label and source).
    rows = [{**r, "policy_label": policy_label(r), "source": "sweep"} for r in records]
    grid = largest_fit_grid(results_frame(pd.json_normalize(rows, max_level=1)))
    grid.title = "largest config that fit, per policy"
    return rich_table(grid, width)
