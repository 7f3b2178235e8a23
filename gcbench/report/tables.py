"""Tables for the terminal (rich): predictions (`gcbench estimate`) and the report's grids (`gcbench report`),
which leave out their least useful columns on a narrow terminal. One run's table (`gcbench run`) is run_table.py:
it needs no pandas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gcbench.report.cells import Grid, fit_grids, largest_fit_grid, prediction_grid, results_grid
from gcbench.results.frame import FAILED
from gcbench.fields import run_field
from gcbench.values import Switch
from gcbench.results.schema import PHASE_SHORT, LEVER_FIELDS, lever_text, policy_label
from gcbench.units import byte_unit, fmt_bytes

if TYPE_CHECKING:
    import pandas as pd

LEVERS = {name: run_field(name).heading for name in LEVER_FIELDS}  # lever -> its column's heading


def _lever_cell(field: str, value: Any) -> str:
    if isinstance(run_field(field).kind, Switch):
        return "yes" if value else "no"
    return str(value)


def estimate_table(rows: list[dict[str, Any]], memory_bytes: int | None = None) -> Table:
    """The table `gcbench estimate` prints: one row per config and method (rows are Estimate.as_record()s: `policy`
    the name with `policy_options` beside it, or, from older code, the whole label in `policy`; a cell no method
    could predict has `peak_bytes` None and why in `not_available`). Byte columns share one unit, chosen for the
    largest peak; what all rows share goes into the title (the model, precision, optimizer...), what varies gets a
    column; the caption says why a cell is n/a or predicted by another method than asked (`stands_in`)."""
    first, predicted_rows = rows[0], [r for r in rows if r["peak_bytes"] is not None]
    scale, unit = byte_unit(max((r["peak_bytes"] for r in predicted_rows), default=0))
    models = {r["model"] + (f" ({r['layers']} blocks)" if r.get("layers") else "") for r in rows}
    predicted = "torch.cuda.max_memory_allocated" if first["target"] == "cuda" else "CPU live-tensor peak"
    kernels = ", ".join(sorted({r["attention_kernel"] for r in predicted_rows}))
    varying = [f for f in LEVERS if len({str(r.get(f)) for r in rows}) > 1]
    shared = lever_text(first, leave_out=tuple(varying))
    title = (f"{', '.join(sorted(models)) + ' · ' if len(models) == 1 else ''}predicted peak of one training step "
             f"({predicted}){' · ' + shared if shared else ''} · attention: {kernels}")
    sharded = any(r.get("shard") not in (None, "none") for r in rows)
    notes = [f"{unit}; activ. = everything else at the peak; in = the phase that reaches the peak (opt: the "
             f"optimizer step, which checkpointing cannot lower); B/p = model state bytes per parameter"
             + ("; sharded rows: per rank, B/p over all ranks (docs/scale.md)" if sharded else "")
             + (f"; fits = peak <= {fmt_bytes(memory_bytes)}" if memory_bytes else "")]
    stand_ins = sorted({r["stands_in"] for r in predicted_rows if r.get("stands_in")})
    notes += [f"† simulated instead: {escape(reason)}" for reason in stand_ins]
    notes += [f"n/a: {escape(reason)}" for reason in dict.fromkeys(r["not_available"] for r in rows
                                                                   if r["peak_bytes"] is None)]
    # no padding: the box puts one space between columns, so that a grid with a lever or two fits 80 columns
    table = Table(title=title, caption="\n".join(notes), header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption_justify="left", padding=0)
    columns = (["model"] if len(models) > 1 else []) + ["seq", "batch", "policy"] + [LEVERS[f] for f in varying] \
        + ["method", "params", "grads", "optim.", "activ.", "peak", "in", "B/p"]
    left = {"model", "policy", "method", "fits", "in", *(LEVERS[f] for f in varying)}
    for col in columns + (["fits"] if memory_bytes else []) + ["time"]:
        table.add_column(col, justify="left" if col in left else "right")
    for r in rows:
        cells = [str(r["model"])] if len(models) > 1 else []
        cells += [str(r["seq_len"]), str(r["batch_size"]), policy_label(r)]
        cells += [_lever_cell(f, r.get(f)) for f in varying]
        cells.append(r["method"] + ("†" if r.get("stands_in") else ""))
        if r["peak_bytes"] is None:
            table.add_row(*cells, *["[dim]n/a[/]"] * (7 + bool(memory_bytes)), "-")
            continue
        cells += [f"{r[k] / scale:.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")]
        cells.append(f"[bold]{r['peak_bytes'] / scale:.2f}[/]")
        cells.append(PHASE_SHORT.get(r["peak_phase"], "-"))
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        cells.append(f"{state * (r.get('nproc') or 1) / r['n_params']:.1f}" if r.get("n_params") else "-")
        if memory_bytes:
            cells.append("[green]yes[/]" if r["peak_bytes"] <= memory_bytes else "[red]no[/]")
        cells.append(f"{r['seconds']:.2f}s")
        table.add_row(*cells)
    return table


def rich_table(grid: Grid, width: int | None = None) -> Table:
    """The grid as a rich Table. Given a terminal `width`, the grid's optional columns are left out (least useful
    first) until the table fits without breaking numbers apart; report.md and report.html keep every column."""
    hidden: list[int] = []
    # The natural (unwrapped) width: measured on an unbounded console, since a bounded one clamps to its width.
    fits = lambda t: width is None or Console(width=100_000).measure(t).maximum <= width  # noqa: E731
    while True:
        table = _rich_table(grid, hidden)
        if fits(table):
            return table
        if len(hidden) == len(grid.optional):
            # The essential columns alone are still too wide: drop the vertical rules (as the sweep summary does).
            return _rich_table(grid, hidden, compact=True)
        hidden.append(grid.optional[len(hidden)])


def _rich_table(grid: Grid, hidden: list[int], compact: bool = False) -> Table:
    shown = [i for i in range(len(grid.headers)) if i not in hidden]
    light = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if compact else {}
    table = Table(title=grid.title or None, caption=grid.caption or None, header_style="bold",
                  caption_justify="left", **light)
    for i in shown:
        numeric = i in grid.numeric
        # Numbers never wrap; their headers break after the first word instead ("peak\nx none").
        header = grid.headers[i].replace(" ", "\n", 1) if numeric else grid.headers[i]
        # Short labels (policies, statuses) stay on one line; long ones (setups, notes) and headers may wrap.
        widest = max((len(row[i]) for row in grid.rows), default=0)
        longest_word = max(map(len, header.split()), default=0)
        table.add_column(header, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold",
                         min_width=None if numeric or widest > 16 else max(widest, longest_word))
    for i, row in enumerate(grid.rows):
        cells = [Text(row[j], style="bold red") if row[j].rstrip("*") in FAILED.values() else Text(row[j])
                 for j in shown]
        table.add_row(*cells, end_section=i in grid.section_ends and i != len(grid.rows) - 1)
    return table


def terminal_tables(frame: pd.DataFrame, width: int | None = None) -> list[Table | str]:
    """What `gcbench report` prints: per device a heading line, a results table per setup, the largest fits.
    `width`: the terminal's, so that narrow terminals get the essential columns only."""
    out: list[Table | str] = []
    for dev_label, dev in frame.groupby("device_label", sort=False):
        out.append(f"[bold]{dev_label}[/] — {len(dev)} configs; peak memory = {dev['peak_label'].iloc[0]}")
        for _, part in dev.groupby("setup", sort=False):
            out.append(rich_table(results_grid(part), width))
        if (largest := largest_fit_grid(dev)) is not None:
            largest.title = "largest config that fit, per policy"
            out.append(rich_table(largest, width))
        out += [rich_table(grid, width) for grid in fit_grids(dev)]
        for _, part in dev.groupby("setup", sort=False):
            predictions = prediction_grid(part)
            if predictions is not None:
                out.append(rich_table(predictions, width))
    if frame.attrs.get("superseded"):
        out.append(f"[dim]{frame.attrs['superseded']} repeated record(s) of the same config superseded by a later "
                   f"one (latest kept, never averaged)[/]")
    return out
