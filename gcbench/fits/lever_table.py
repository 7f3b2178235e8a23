"""The tables of a plan across levers (`gcbench fit --levers`, `gcbench estimate --fit --levers`): per group (full
fine-tune, adapters) the top candidates by predicted tokens/s and a short caption (why the others are not ranked:
each reason once, whole: the terminal wraps it); a group with nothing ranked is one line. And the lines that hold
the winner's real run against its prediction. Plain values in, rich renderables and text out."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gcbench.fields import Role, setup_words
from gcbench.fits.levers import (ADAPTERS, DEFAULT_TOP, FULL, LEVERS, TIED, LeverPlan, Row, lever_default,
                                 tier_heads)
from gcbench.results.schema import Status, peak_bytes
from gcbench.text import markup, plain
from gcbench.units import fmt_bytes, fmt_change, plural

REASONS_SHOWN = 4  # "not ranked" reasons under a table, each on its own line; the rest together on one
# the install hint of an optimizer's or an adapter's check_installed
_NOT_INSTALLED = re.compile(r", which (?:is|are) not installed: (pip install \S+)")


def lever_tables(plan: LeverPlan, ranked: Sequence[Row], caption: list[str], timed_on: str | None,
                 order: str | None = None, top: int = DEFAULT_TOP) -> list[RenderableType]:
    """Per group with a candidate (or one left out as not runnable here: plan.unrunnable): its table and caption, or
    one line when none of its candidates is ranked. `timed_on`: where the time model's rates for the card come from
    (step_time's basis); None: no time model for the target (the speed is then FLOPs per token, relative to the
    group's best). `order`: what the card's records say of a predicted order (band_words.order_note)."""
    fields = plan.fields
    shown: list[RenderableType] = []
    for group in (FULL, ADAPTERS):
        rows, fitting, heads = _group(ranked, group)
        missing = _by_reason([r for r in plan.unrunnable if r.group == group])
        name = group.split(" (")[0]
        if not fitting:
            if rows or missing:
                reasons = _by_reason(rows)
                why = [_whole(reason) + (f" ({len(rs)})" if len(reasons) > 1 else "")
                       for reason, rs in reasons[:REASONS_SHOWN]]
                why += [plural(len(reasons) - REASONS_SHOWN, "more reason")] if len(reasons) > REASONS_SHOWN else []
                head = f"none of {plural(len(rows), 'candidate')} ranked" if rows else "not searched"
                shown.append(Text(plain(f"{name}: {head}: " + "; ".join(why + [text for text, _ in missing]))))
            continue
        speed = "tokens/s" if timed_on else "x best"
        table = Table(title=markup(f"{fields['model']} · seq {fields['seq_len']}{_fixed_words(plan)} · plan across "
                                   f"levers · {group}"),
                      box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("#", "levers", "batch", "peak", speed, "by"):
            table.add_column(col, justify="left" if col == "levers" else "right", no_wrap=col != "levers",
                             overflow="fold")
        best = min((r.flops_per_token for r in fitting if r.flops_per_token), default=None)
        for i, (r, head) in enumerate(zip(fitting[:top], heads), 1):
            value = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else \
                f"{best / r.flops_per_token:.3f}" if best and r.flops_per_token else "-"
            table.add_row(str(i) if head == i else f"={head}", markup(r.words()), f"{r.micro_batch} x {r.accum}",
                          fmt_bytes(r.peak), value, r.method)
        lines = [*caption, f"PREDICTED beforehand; {len(fitting)} of {plural(len(rows), 'candidate')} ranked (fit); "
                 f"batch {fitting[0].micro_batch} x {fitting[0].accum} = micro-batch x accumulation",
                 ("tokens/s = micro-batch x accumulation x seq / the step time predicted on the card "
                  f"(docs/methodology.md, \"Predicting step time\"); rates: {timed_on}" if timed_on
                  else "x best = the fewest FLOPs per token / the row's (no time model: no GPU named; sac's and "
                       "qlora's extra work is not in FLOPs)")
                 + ("; =N: not told apart from row N (" + (f"each within {TIED:.0%} of the next faster" if timed_on
                                                             else "the same FLOPs per token")
                    + ": among them fewer levers, then a larger micro-batch, then a smaller peak first)" if any(
                        h != i for i, h in enumerate(heads[:top], 1)) else "")]
        lines += [order] if order and timed_on and len(fitting) > 1 else []
        if paged := max((r.paged for r in fitting[:top]), default=0):  # docs/levers.md, "Paged optimizers"
            lines.append(f"a paged optimizer's peak leaves room for its paged state ({fmt_bytes(paged)}) within the "
                         "budget: past it the state pages over PCIe every step, a time not predicted")
        lines += _reasons(rows)
        lines += [f"not ranked: {text}" for text, _ in missing]  # whole: the line says what to install
        if plan.refused and group == FULL:
            lines.append(f"not candidates ({len(plan.refused)}): a run refuses them, e.g. {_whole(plan.refused[0])}")
        shown.append(Group(table, Text(plain("\n".join(lines), lines=True))))
    return shown


def _by_reason(rows: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    by_reason: dict[str, list[Row]] = {}
    for r in rows:
        if not r.fits:
            by_reason.setdefault(_NOT_INSTALLED.sub(r" (\1)", r.reason or "does not fit"), []).append(r)
    return list(by_reason.items())


def _reasons(rows: Sequence[Row]) -> list[str]:
    """The reasons of the rows not ranked, each once and whole, with how many and one example."""
    reasons = _by_reason(rows)
    lines = [f"not ranked ({len(rs)}): {_whole(reason)} (e.g. {rs[0].words()})"
             for reason, rs in reasons[:REASONS_SHOWN]]
    if rest := reasons[REASONS_SHOWN:]:
        head = (f"not ranked: {plural(sum(len(rs) for _, rs in rest), 'more candidate')}, "
                f"{plural(len(rest), 'other reason')}: ")
        lines.append(head + "; ".join(_whole(reason) for reason, _ in rest))
    return lines


def _whole(text: str) -> str:
    """`text` on one line (its runs of white space one space): the terminal wraps it, nothing is cut (issue 48)."""
    return " ".join(str(text).split())


def verification_lines(row: Row, record: Mapping[str, Any], out: Any) -> list[str]:
    """The winner's real run against its prediction, plain text; a run that did not end ok is one line saying so
    (its error's first line), then the records file."""
    head = f"winner run for real ({row.words()}, batch {row.micro_batch} x {row.accum})"
    if record.get("status") != Status.OK:
        error = (str(record.get("error") or "").strip().splitlines() or [""])[0]
        return [plain(f"{head} FAILED: {record.get('status')}" + (f": {error}" if error else "")),
                f"record in {plain(out)}"]
    measured = peak_bytes(record)
    error = f" ({fmt_change((row.peak - measured) / measured)} predicted vs measured)" if measured and row.peak else ""
    return [plain(f"{head}: ok"),
            f"peak: measured {fmt_bytes(measured)}, predicted {fmt_bytes(row.peak)}{error}",
            f"tokens/s: measured {record.get('tokens_per_s') or 0:,.0f}"
            + (f", predicted {row.tokens_per_s:,.0f}" if row.tokens_per_s else ""),
            f"record in {plain(out)}"]


def lever_rows(plan: LeverPlan, ranked: Sequence[Row], gpu: str | None, timed_on: str | None) -> list[dict[str, Any]]:
    """`estimate --fit --levers --format json`: a row per candidate, ranked ones first as the tables order them,
    each read alone: its setup, levers, rank and tier (`=N` in the table: the rank of the first row it is not told
    apart from; None where not ranked, with `not_ranked` saying why), and what was predicted (bytes, ms)."""
    rows = []
    for group in (FULL, ADAPTERS):
        shown, fitting, heads = _group(ranked, group)
        for i, (r, head) in enumerate(zip(fitting + [r for r in shown if not r.fits],
                                          heads + [None] * (len(shown) - len(fitting))), 1):
            rows.append({"model": plan.fields["model"], "seq_len": plan.fields["seq_len"], "group": group,
                         "rank": i if r.fits else None, "tier": head, "config": r.words(),
                         "levers": r.levers, **{k: v for k, v in r.spec_fields.items() if k != "device"},
                         "target": plan.target, "batch_size": r.micro_batch, "grad_accum": r.accum,
                         "peak_bytes": r.peak, "optimizer_paged_bytes": r.paged or None,
                         "predicted_step_ms": r.step_ms, "predicted_tokens_per_s": r.tokens_per_s,
                         "flops_per_token": r.flops_per_token, "method": r.method or None, "not_ranked": r.reason,
                         "budget_bytes": plan.budget, "gpu": gpu, "time_basis": timed_on})
    return rows


def _group(ranked: Sequence[Row], group: str) -> tuple[list[Row], list[Row], list[int]]:
    """A group's rows as ranked, those of them that fit, and each fitting row's tier head (the table's =N)."""
    rows = [r for r in ranked if r.group == group]
    fitting = [r for r in rows if r.fits]
    return rows, fitting, tier_heads(fitting)


def _fixed_words(plan: LeverPlan) -> str:
    """` · qlora`: the levers the command fixed away from their defaults (--adapter qlora with --levers auto), which
    no row names."""
    fixed = {k: v for k, v in plan.fields.items()
             if k in LEVERS and k not in plan.searched and v != lever_default(k, plan.target)}
    words = setup_words({"grad_accum": 1, **fixed}, roles=(Role.LEVER,)) if fixed else ""
    return f" · {words}" if words else ""
