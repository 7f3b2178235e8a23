"""What a running sweep shows on stderr: a rich progress bar with counts and ETA, and one line per finished
config."""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from gcbench.results.schema import STATUSES, config_label, peak_bytes
from gcbench.spec import RunSpec
from gcbench.units import fmt_bytes


class SweepProgress:
    """What a running sweep shows on stderr: a bar over the configs to run with ETA, the config and phase running
    now and counts per status; one line per finished config is printed above the bar. Quiet with no console."""

    def __init__(self, console: Console | None, total: int, resumed: int):
        self.console, self.total, self.resumed = console, total, resumed
        self.counts: Counter[str] = Counter()
        self._label = ""
        self._bar = Progress(
            SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[counts]}"),
            # The bar only on a terminal; a pipe or log file gets the finished lines alone.
            console=console, transient=True, disable=console is None or not console.is_terminal)

    def __enter__(self) -> SweepProgress:
        if self.console is not None and self.resumed:
            self.console.print(f"resuming: {self.resumed} config(s) already in the results file, "
                               f"{self.total} to run (--rerun runs all)")
        self._bar.__enter__()
        self._task = self._bar.add_task("starting", total=self.total, counts=self._counts_text())
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def _counts_text(self) -> str:
        return " · ".join(f"{s} {self.counts[s]}" for s in STATUSES)

    def started(self, spec: RunSpec) -> None:
        self._label = config_label(spec.as_record())
        self._bar.update(self._task, description=f"{self._label} · starting")

    def pairing(self, specs: list[RunSpec]) -> None:
        first = specs[0].as_record()
        self._label = (f"{first['model']} seq {first['seq_len']} batch {first['batch_size']} · timing "
                       f"{len(specs)} policies paired")
        self._bar.update(self._task, description=f"{self._label} · starting")

    def shrink(self, by: int) -> None:
        """`by` fewer configs to run than the total said (a fit's search ended before its bound)."""
        self.total -= by
        self._bar.update(self._task, total=self.total)

    def phase(self, text: str) -> None:
        self._bar.update(self._task, description=f"{self._label} · {text}")

    def finished(self, record: dict[str, Any]) -> None:
        self.counts[record["status"]] += 1
        self._bar.update(self._task, advance=1, counts=self._counts_text())
        if self.console is not None:
            self._bar.console.print(_finished_line(record), highlight=False)


_STATUS_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "timeout": "red", "error": "bold red"}


def _finished_line(record: dict[str, Any]) -> str:
    status = record["status"]
    line = f"[{_STATUS_STYLE[status]}]{status:>7}[/] {config_label(record)}"
    if status == "ok":
        line += f"  {record['step_ms_median']:.1f} ms/step, peak {fmt_bytes(peak_bytes(record))}"
    elif record.get("error"):
        line += f"  [dim]{escape(textwrap.shorten(str(record['error']), 120, placeholder=' ...'))}[/]"
    return line

