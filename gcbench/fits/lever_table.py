"""The tables of a plan across levers (`gcbench fit --levers`, `gcbench estimate --fit --levers`): per group (full
fine-tune, adapters) the top candidates by predicted tokens/s, and why the others are not ranked; and the lines
that hold the winner's real run against its prediction. Plain values in, rich Tables and text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.table import Table

from gcbench.fits.levers import ADAPTERS, DEFAULT_TOP, FULL, LeverPlan, Row
from gcbench.results.schema import Status, peak_bytes
from gcbench.text import markup, plain
from gcbench.units import fmt_bytes

REASONS_SHOWN = 6  # lines of "not ranked" reasons under a table; the rest counted


def lever_tables(plan: LeverPlan, ranked: Sequence[Row], caption: list[str], no_peak: str | None,
                 efficiency: float, top: int = DEFAULT_TOP) -> list[Table]:
    """A table per group with a candidate in it. `no_peak`: the target whose peak FLOP/s is unknown (the speed is
    then relative to the group's best: the same ranking)."""
    fields = plan.fields
    tables = []
    for group in (FULL, ADAPTERS):
        rows = [r for r in ranked if r.group == group]
        if not rows:
            continue
        fitting = [r for r in rows if r.fits]
        speed = "x best" if no_peak else "tokens/s"
        table = Table(title=markup(f"{fields['model']} · seq {fields['seq_len']} · plan across levers · {group}"),
                      box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, caption_justify="left")
        for col in ("#", "levers", "batch", "peak", speed, "by"):
            table.add_column(col, justify="left" if col == "levers" else "right", no_wrap=col != "levers",
                             overflow="fold")
        best = fitting[0].flops_per_token if fitting else None
        for i, r in enumerate(fitting[:top], 1):
            shown = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else \
                f"{best / r.flops_per_token:.3f}" if best and r.flops_per_token else "-"
            table.add_row(str(i), markup(r.words()), f"{r.micro_batch} x {r.accum}", fmt_bytes(r.peak), shown,
                          r.method)
        lines = list(caption)
        lines.append(f"{len(fitting)} of {len(rows)} candidates fit; PREDICTED, nothing ran: peak by the method in "
                     "`by`; " + (f"tokens/s = peak FLOP/s x {efficiency:g} / FLOPs per token (recompute included)"
                                 if not no_peak else f"x best: the best's FLOPs per token / the row's (no peak FLOP/s "
                                 f"for {no_peak})"))
        if group == ADAPTERS:
            lines.append("adapters train a different thing (the base frozen): ranked apart from full fine-tuning")
        lines += _reasons(rows)
        if plan.refused and group == FULL:
            lines.append(f"not candidates ({len(plan.refused)}): combinations a run refuses, e.g. "
                         f"{markup(plan.refused[0])}")
        table.caption = "\n".join(lines)
        tables.append(table)
    return tables


def _reasons(rows: Sequence[Row]) -> list[str]:
    """The reasons of the rows not ranked, each once, with how many and one example."""
    by_reason: dict[str, list[Row]] = {}
    for r in rows:
        if not r.fits:
            by_reason.setdefault(r.reason or "does not fit", []).append(r)
    lines = [f"not ranked ({len(rs)}): {markup(reason)} (e.g. {markup(rs[0].words())})"
             for reason, rs in list(by_reason.items())[:REASONS_SHOWN]]
    if len(by_reason) > REASONS_SHOWN:
        lines.append(f"not ranked: {sum(len(rs) for rs in list(by_reason.values())[REASONS_SHOWN:])} more, "
                     f"for {len(by_reason) - REASONS_SHOWN} other reasons")
    return lines


def verification_lines(row: Row, record: Mapping[str, Any], out: Any) -> list[str]:
    """The winner's real run against its prediction, plain text."""
    head = f"winner run for real ({row.words()}, batch {row.micro_batch} x {row.accum})"
    if record.get("status") != Status.OK:
        return [plain(f"{head}: {record.get('status')}: {record.get('error')}"), f"record in {plain(out)}"]
    measured = peak_bytes(record)
    error = f" ({(row.peak - measured) / measured:+.1%} predicted vs measured)" if measured and row.peak else ""
    return [plain(f"{head}: ok"),
            f"peak: measured {fmt_bytes(measured)}, predicted {fmt_bytes(row.peak)}{error}",
            f"tokens/s: measured {record.get('tokens_per_s') or 0:,.0f}"
            + (f", predicted {row.tokens_per_s:,.0f}" if row.tokens_per_s else ""),
            f"record in {plain(out)}"]
