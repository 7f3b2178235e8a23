"""Tables for the terminal (rich): the report's grids (`gcbench report`), which leave out their least useful
columns on a narrow terminal. One run's table (`gcbench run`) is run_table.py: it needs no pandas; predictions'
(`gcbench estimate`) are estimate_table.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gcbench.report.cells import Grid, fit_grids, largest_fit_grid, prediction_grid, results_grid
from gcbench.results.frame import FAILED, given
from gcbench.report.run_table import cpu_name
from gcbench.text import fits, markup, option_lines, plain
from gcbench.units import plural

if TYPE_CHECKING:
    import pandas as pd


def rich_table(grid: Grid, width: int | None = None) -> Table | Group:
    """The grid as a rich Table. Given a terminal `width`, the grid's optional columns are left out (least useful
    first) until the table fits without breaking numbers apart or cropping a header; where its essential columns
    alone are still too wide, it is split into tables of a few columns each, every one repeating the columns that
    name a row (`grid.keys`), once its spare columns are left out too. report.md and report.html keep every column
    in one table."""
    shown = list(range(len(grid.headers)))
    while True:
        table = _rich_table(grid, shown)
        if fits(table, width):
            return table
        hideable = [i for i in grid.optional if i in shown]
        if not hideable:
            break
        shown.remove(hideable[0])
    # The essential columns alone are still too wide: drop the vertical rules (as the sweep summary does), then
    # the spare columns...
    for i in [None, *grid.spare]:
        if i is not None:
            shown.remove(i)
        table = _rich_table(grid, shown, compact=True)
        if fits(table, width):
            return table
    # ...and then split them: every value stays whole and every header readable, on any terminal width. A column
    # with no value in any row would be a part of "-" alone: it is named in the caption instead.
    empty = [i for i in shown[grid.keys:] if all(plain(row[i]).strip() in ("", "-") for row in grid.rows)]
    keys, rest = shown[:grid.keys], [i for i in shown[grid.keys:] if i not in empty]
    parts: list[list[int]] = [[]]
    for i in rest:
        if parts[-1] and not fits(_rich_table(grid, keys + parts[-1] + [i], compact=True), width):
            parts.append([])
        parts[-1].append(i)
    tables: list[Table | Text] = []
    for n, part in enumerate(parts, 1):
        title = f"{grid.title or 'table'} ({n} of {len(parts)})" if len(parts) > 1 else grid.title
        tables.append(_rich_table(grid, keys + part, compact=True, title=title, caption=""))
    # The caption under the last part, as wide as the terminal (not as narrow as that part).
    blank = f" No value in any row: {', '.join(grid.headers[i] for i in empty)}." if empty else ""
    tables.append(Text(plain(_caption(grid, shown) + blank, lines=True)))
    return Group(*tables)


def _caption(grid: Grid, shown: list[int]) -> str:
    """The grid's caption, and which of its columns a narrow terminal left out."""
    left_out = [grid.headers[i] for i in range(len(grid.headers)) if i not in shown]
    return grid.caption + (f"{' ' if grid.caption else ''}Left out at this terminal width: {', '.join(left_out)} "
                           "(a wider terminal or `report --out` shows them)." if left_out else "")


def _rich_table(grid: Grid, shown: list[int], compact: bool = False, title: str | None = None,
                caption: str | None = None) -> Table:
    """The grid's `shown` columns as a rich Table. Every string in it may come from a results file: titles,
    captions and headers are rich markup (escaped), cells are Text (no markup); all go through text.plain."""
    light = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if compact else {}
    title = grid.title if title is None else title
    caption = _caption(grid, shown) if caption is None else caption
    table = Table(title=markup(title) or None, caption=markup(caption) or None, header_style="bold",
                  caption_justify="left", **light)
    for i in shown:
        numeric = i in grid.numeric
        # Numbers never wrap; their headers break after the first word instead ("peak\nx none").
        header = grid.headers[i].replace(" ", "\n", 1) if numeric else grid.headers[i]
        # Short labels (policies, statuses) stay on one line; long ones (setups, notes) and headers may wrap.
        widest = max((len(plain(row[i])) for row in grid.rows), default=0)
        longest_word = max(map(len, header.split()), default=0)
        table.add_column(markup(header, lines=True), justify="right" if numeric else "left", no_wrap=numeric,
                         overflow="fold", min_width=None if numeric or widest > 16 else max(widest, longest_word))
    for i, row in enumerate(grid.rows):
        cells = [Text(option_lines(plain(row[j]), 16) if j not in grid.numeric else plain(row[j]),
                      style="bold red" if row[j].rstrip("*") in FAILED.values() else "") for j in shown]
        table.add_row(*cells, end_section=i in grid.section_ends and i != len(grid.rows) - 1)
    return table


def terminal_tables(frame: pd.DataFrame, width: int | None = None) -> list[Table | Group | str]:
    """What `gcbench report` prints: per device a heading line, a results table per setup, the largest fits.
    `width`: the terminal's, so that narrow terminals get the essential columns only."""
    out: list[Table | Group | str] = []
    for dev_label, dev in frame.groupby("device_label", sort=False):
        models = " / ".join(cpu_name(m) for m in dict.fromkeys(dev["env.cpu_model"]) if given(m))
        out.append(f"[bold]{markup(dev_label)}[/]{f' ({models})' if models else ''} — {plural(len(dev), 'config')}; "
                   f"peak memory = {markup(dev['peak_label'].iloc[0])}")
        said: set[str] = set()  # each results table's key said once per device, under the first that needs it
        for _, part in dev.groupby("setup", sort=False):
            grid = results_grid(part)
            new = [n for n in grid.notes if n not in said]
            said.update(new)
            if len(new) < len(grid.notes):
                grid = replace(grid, caption=" ".join([*new, "Other keys as under the tables above."]))
            out.append(rich_table(grid, width))
        if (largest := largest_fit_grid(dev)) is not None:
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
