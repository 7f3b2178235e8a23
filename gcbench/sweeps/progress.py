"""What a running sweep shows on stderr: a rich progress bar with counts and ETA, and one line per finished
config."""

from __future__ import annotations

import textwrap
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Column
from rich.text import Text

from gcbench.results.schema import STATUSES, Status, config_label, peak_bytes
from gcbench.resolved import ResolvedRun
from gcbench.text import markup, plain
from gcbench.units import fmt_bytes


BAR_WIDTH = 20  # columns: the bar's line then fits 80 with its count, times and statuses


def bar_with_lines(console: Console | None, live: bool, *more: ProgressColumn) -> tuple[Progress, Progress,
                                                                                         Live | None]:
    """A bar's line with what must stay whole (its count, elapsed time, ETA), then `more` (about 60 columns in
    all; where `more` is longer, such as a sweep's five statuses, it wraps under itself at a word), and
    under it lines of what runs (a task each), cut short with an ellipsis where the terminal is narrower; shown
    together by the Live (None where not `live`: a pipe, a log file)."""
    whole = Column(no_wrap=True)  # each column copies it (Progress.make_tasks_table): `more` wraps first
    bar = Progress(SpinnerColumn(), BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(table_column=whole),
                   TimeElapsedColumn(table_column=whole), TextColumn("eta", table_column=whole),
                   TimeRemainingColumn(table_column=whole), *more, console=console, transient=True,
                   disable=not live)
    lines = Progress(TextColumn("  {task.description}", markup=False,
                                table_column=Column(no_wrap=True, overflow="ellipsis")),
                     console=console, transient=True, disable=not live)
    return bar, lines, Live(Group(bar, lines), console=console, transient=True) if live else None


class SweepProgress:
    """What a running sweep shows on stderr: a bar over the configs to run with ETA, the config and phase running
    now and counts per status; one line per finished config is printed above the bar. Quiet with no console."""

    def __init__(self, console: Console | None, total: int, resumed: int, slots: Sequence[str] = ()):
        self.console, self.total, self.resumed = console, total, resumed
        self.counts: Counter[str] = Counter()
        self._labels: dict[int, str] = {}  # slot -> the config it runs now
        self._lock = threading.Lock()
        live = console is not None and console.is_terminal  # the bar only on a terminal; a pipe gets the lines
        # the counts wrap at a word under themselves where all five statuses outgrow the line (a column of
        # their own: with none, rich squeezed the count and ETA to make room)
        counts = TextColumn("{task.fields[counts]}", table_column=Column())
        self._bar, self._lines, self._live = bar_with_lines(console, live, counts)
        # Configs side by side (--devices, --jobs): a line per GPU or core set with what it runs.
        self._slot_names = list(slots) if len(slots) > 1 else []

    def __enter__(self) -> SweepProgress:
        if self.console is not None and self.resumed:
            self.console.print(f"resuming: {self.resumed} config(s) already in the results file, "
                               f"{self.total} to run (--rerun runs all)")
        if self._live is not None:
            self._live.__enter__()
        self._task = self._bar.add_task("", total=self.total, counts=self._counts_text())
        self._slot_tasks = [self._lines.add_task(f"{name} · waiting") for name in self._slot_names] \
            or [self._lines.add_task("starting")]
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def _counts_text(self) -> str:
        """Configs per status: ok always, the others once one has it."""
        return " · ".join(f"{s} {self.counts[s]}" for s in STATUSES if s == Status.OK or self.counts[s])

    def _show(self, slot: int, text: str) -> None:
        text = plain(text)  # model names and paths from configs (the columns take no markup)
        where = f"{self._slot_names[slot]} · " if self._slot_names else ""
        self._lines.update(self._slot_tasks[slot if self._slot_names else 0], description=where + text)

    def started(self, spec: ResolvedRun, slot: int = 0) -> None:
        self._labels[slot] = config_label(spec.as_record())
        self._show(slot, f"{self._labels[slot]} · starting")

    def pairing(self, specs: list[ResolvedRun], slot: int = 0) -> None:
        first = specs[0].as_record()
        self._labels[slot] = (f"{first['model']} seq {first['seq_len']} batch {first['batch_size']} · timing "
                              f"{len(specs)} policies paired")
        self._show(slot, f"{self._labels[slot]} · starting")

    def waiting(self, text: str) -> None:
        """What a sweep waits for (jobs on a cluster), in place of a running config."""
        self._show(0, text)

    def idle(self, slot: int) -> None:
        if self._slot_names:
            self._show(slot, "done")

    def phase_of(self, slot: int) -> Callable[[str], None]:
        """The on_phase callback of a runner working in `slot`."""
        return lambda text: self.phase(text, slot)

    def shrink(self, by: int) -> None:
        """`by` fewer configs to run than the total said (a fit's search ended before its bound)."""
        self.total -= by
        self._bar.update(self._task, total=self.total)

    def phase(self, text: str, slot: int = 0) -> None:
        self._show(slot, f"{self._labels.get(slot, '')} · {text}")

    def finished(self, record: dict[str, Any]) -> None:
        with self._lock:  # slots side by side finish at once
            self.counts[record["status"]] += 1
            counts = self._counts_text()
        self._bar.update(self._task, advance=1, counts=counts)
        if self.console is not None:
            self.console.print(_finished_line(record, self._slot_names, self.console.width), highlight=False)


_STATUS_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "timeout": "red", "error": "bold red"}


def _finished_line(record: dict[str, Any], slots: Sequence[str] = (), width: int | None = None) -> str:
    """A finished config's line (rich markup). Where its measurements (or its error) do not fit after the label
    within `width`, they go on lines of their own, indented: a wrap never parts a number from its unit."""
    status = record["status"]
    where = f"{record['device_slot']}: " if slots and record.get("device_slot") else ""
    line = f"[{_STATUS_STYLE[status]}]{status:>7}[/] {markup(where)}{markup(config_label(record))}"
    if status == Status.OK:
        measured = f"{record['step_ms_median']:.1f} ms/step, peak {fmt_bytes(peak_bytes(record))}"
        fits = width is None or Text.from_markup(line).cell_len + 2 + len(measured) <= width
        line += ("  " if fits else "\n" + " " * 8) + measured
    elif record.get("error"):
        error = textwrap.shorten(str(record["error"]), 120, placeholder=" ...")
        if width is None or Text.from_markup(line).cell_len + 2 + len(error) <= width:
            line += f"  [dim]{markup(error)}[/]"
        else:  # under the label, every line of it indented
            line += "".join(f"\n        [dim]{markup(part)}[/]" for part in textwrap.wrap(error, max(width - 8, 20)))
    return line

