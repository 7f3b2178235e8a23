"""The tables `gcbench fit` and `gcbench estimate --fit` print: per policy the largest size that fits the budget,
its throughput and peak, and how it was found. Plain values in, rich Tables out: nothing here runs a search."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gcbench.results.schema import SIZE_WORDS, mix_text, peak_bytes, policy_label
from gcbench.units import fmt_bytes


def _table(title: str, caption: list[str], columns: list[str]) -> Table:
    # as wide as its title where the terminal allows (rich clamps to it): a narrow table wrapped "· seq" / "4096"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="\n".join(caption), caption_justify="left", min_width=Text.from_markup(title).cell_len)
    for col in columns:
        table.add_column(col, justify="left" if col in ("policy", "note") else "right",
                         no_wrap=col != "note")
    return table


def fit_table(fits: Sequence[Any], vary: str, budget: int, title: str) -> Table:
    """`gcbench fit`: one row per policy (fits: fit.PolicyFit). tokens/s is the run's own; `paired` the winners
    timed interleaved in one process, when they were."""
    word = SIZE_WORDS[vary]
    paired = any(f.best is not None and f.best.get("paired_tokens_per_s") for f in fits)
    columns = ["policy", f"max {word}", "tokens/s", *(["paired"] if paired else []), "peak", "trials", "note"]
    notes: dict[str, int] = {}
    rows = []
    for f in fits:
        best = f.best
        if f.error is not None:
            note = f.error
        elif best is None:
            note = f"{word} {f.search.lo} does not fit"
        elif f.search.next_up is None:
            note = f"{word} {f.search.hi} (the range's top) fits"
        else:
            nxt = f.next_record or {}
            note = f"{word} {f.search.next_up}: {nxt.get('status', 'oom')}"
        if best is not None and best.get("plan_mix"):
            note += f"; mix {mix_text(best['plan_mix'])}"
        mark = f"({notes.setdefault(note, len(notes) + 1)})"
        shaky = "~" if best is not None and best.get("timing_stable") is False else ""
        rows.append([f.policy if not f.policy.startswith("plan:") else "plan", str(f.search.maximum) if best else "-",
                     f"{shaky}{best['tokens_per_s']:,.0f}" if best else "-",
                     *([f"{best['paired_tokens_per_s']:,.0f}" if best and best.get("paired_tokens_per_s") else "-"]
                       if paired else []),
                     fmt_bytes(peak_bytes(best)) if best else "-",
                     f"{len(f.records)}/{f.search.bound}", mark])
    caption = [f"budget {fmt_bytes(budget)} per trial; trials: run / the search's bound (ceil(log2 sizes) + 2)"
               + (f"; each max ran and the next {word} ran out of memory, both in the results file"
                  if any(f.best is not None for f in fits) else "")]
    if paired:
        caption.append("paired: tokens/s of the winners timed interleaved in one process (drift-free ranking)")
    if any(f.best is not None and f.best.get("timing_stable") is False for f in fits):
        caption.append("~tokens/s = the run's own timing not trusted (its record's timing_notes say why)")
    plan = next((f.policy for f in fits if f.policy.startswith("plan:")), None)
    if plan:
        caption.append(f"plan = {plan}")
    caption += [f"({n}) {escape(text)}" for text, n in notes.items()]
    table = _table(title, caption, columns)
    for row in rows:
        table.add_row(*row)
    return table


def predicted_fit_table(rows: Sequence[dict[str, Any]], vary: str, title: str, caption: list[str]) -> Table:
    """`gcbench estimate --fit`: one row per policy (rows: policy, value, peak, next_peak, step_s, tokens_per_s,
    method, predictions)."""
    word = SIZE_WORDS[vary]
    # replayed on the card (a CUDA target): what decides is the caching allocator, the next size runs out there
    replayed = any(r.get("allocated_only") is not None for r in rows)
    if replayed:
        changed = [f"{r['policy']}: {r['allocated_only']}" for r in rows if r.get("allocated_only") != r["value"]]
        caption = [*caption, f"reserved = max_memory_reserved, PyTorch's caching allocator replayed on the card, "
                   f"its cuBLAS workspaces included: "
                   f"{word} + 1 runs out there" + (f" (by the allocated peak alone: {', '.join(changed)})"
                                                   if changed else "") + f"; its segments make that not monotone "
                   f"in the {word}: a smaller one can run out too (docs/methodology.md)"]
    # nothing fits: its next peak is the smallest size's, not a "+ 1"'s
    caption = [*caption[:1], *(f"{r['policy']}: the smallest {word} does not fit ({fmt_bytes(r['next_peak'])})"
                               for r in rows if r["value"] is None and r.get("next_peak")), *caption[1:]]
    table = _table(title, caption, ["policy", f"max {word}", "peak", "reserved" if replayed else f"{word} + 1",
                                    "step s", "tokens/s", "by"])
    for r in rows:
        fits = r["value"] is not None
        beside = (r.get("reserved") if replayed else r["next_peak"]) if fits else None
        table.add_row(r["policy"] if not r["policy"].startswith("plan:") else "plan",
                      f"{r['value']}{' (top)' if r.get('range_top') else ''}" if fits else "-",
                      fmt_bytes(r["peak"]) if fits else "-",
                      fmt_bytes(beside) if beside else "-",
                      f"{r['step_s']:.2f}" if r.get("step_s") else "-",
                      f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-", r["method"])
    return table


def recommendation_lines(rec: Any, vary: str, fits: Sequence[Any] = ()) -> list[str]:
    """The recommended policy and size, and the command that measures it again; without one (`rec` None), why:
    nothing fit, or a search stopped on a trial that neither ran nor ran out of memory (fits: fit.PolicyFit)."""
    if rec is None:
        if any(f.error is not None for f in fits):
            return [f"no recommendation: {sum(f.error is not None for f in fits)} of {len(fits)} searches stopped on "
                    "a trial that neither ran nor ran out of memory (the notes say which), and no other fits"]
        return [f"no policy fits the budget at the range's smallest {SIZE_WORDS[vary]}"]
    record = rec.record
    how = "paired" if rec.paired else "each run's own timing"
    label = policy_label(record)
    key = "paired_tokens_per_s" if rec.paired else "tokens_per_s"
    def named(rows: Sequence[Any]) -> str:
        return "; ".join(f"{policy_label(r)} at seq {r['seq_len']} x batch {r['batch_size']} ({r[key]:,.0f} tokens/s)"
                         for r in rows)

    unsure = rec.unsure  # of the tied, those with nothing to tell them apart by
    tied = [r for r in rec.tied if not any(r is u for u in unsure)]
    return [f"recommended: {label} at seq {record['seq_len']} x batch {record['batch_size']}: "
            f"{rec.tokens_per_s:,.0f} tokens/s ({how}), peak {fmt_bytes(peak_bytes(record))}",
            *([f"  not told apart from {named(tied)}: their timings do not show it clearly faster (paired rounds, "
               "else each run's own interval), so a rerun may order them the other way"] if tied else []),
            *([f"  unsure against {named(unsure)}: no 95% interval to tell them apart by (too few or too "
               "correlated steps)"]
              if unsure else []),
            f"  {rec.command}"]
