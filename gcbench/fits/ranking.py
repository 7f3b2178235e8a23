"""How a plan across levers ranks its candidates that fit (levers.py): by predicted tokens/s on a card, where two
within TIED of each other are not told apart; without a card, by FLOPs per token."""

from __future__ import annotations

import math
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.fits.predict import spec_at

# levers.Row, which ranking only reads: named loosely so that the data flows one way (levers imports ranking)
Row = Any

TIED = 0.03  # predicted tokens/s this close (relative) are not told apart: the time model's rates are not that sure
# Full fine-tuning and adapters are ranked apart: an adapter trains a different thing (the base is frozen).
FULL, ADAPTERS = "full fine-tune", "adapters (frozen base: a different job)"


def time_row(row: Row, fields: dict[str, Any], target: str, rates: Any) -> None:
    """A fitting candidate's step time on the card (`rates`): simulated at its micro-batch with `fields` (its
    candidate fields and accumulation; a simulation the search made is kept), the step played on the card
    (estimators/step_time.py)."""
    try:
        found = estimate(spec_at(fields, fields["policy"], "batch_size", row.micro_batch), "simulate", target)
    except GcbenchError as e:
        row.reason = f"time not predicted: {e}"
        return
    if found.work is None:
        row.reason = "time not predicted: the step was not simulated op by op"
        return
    row.step_ms = found.work.time(rates).step_ms
    row.tokens_per_s = row.micro_batch * row.accum * fields["seq_len"] / (row.step_ms / 1e3)


def ranked(rows: list[Row]) -> list[Row]:
    """The rows that fit, full fine-tuning first, each group by predicted speed (tokens/s on the card, most first;
    without a card FLOPs per token, fewest first), where rows are not told apart (`tiers`) the fewer changes, the
    larger micro-batch, the smaller peak first; then the others as they came."""
    tiers = _tiers(rows)
    order = [r for tier in tiers for r in sorted(tier, key=lambda r: (r.changes, -(r.micro_batch or 0), r.peak or 0))]
    return order + [r for r in rows if not r.fits]


def tier_heads(rows: list[Row]) -> list[int]:
    """For each of `rows` (ranked, fitting), the 1-based position of the first row of its tier (`tiers`), which
    the table shows as =N: a tier is one whatever the tie-breaks put first."""
    tier_of = {id(r): n for n, tier in enumerate(_tiers(rows)) for r in tier}
    first: dict[int, int] = {}
    return [first.setdefault(tier_of[id(r)], i) for i, r in enumerate(rows, 1)]


def _tiers(rows: list[Row]) -> list[list[Row]]:
    """The rows that fit in runs not told apart, fastest first (full fine-tuning's, then the adapters'): sorted by
    speed, each run of rows each within TIED of the next faster one is one tier (a slower row that the tie-breaks
    put first does not part it)."""
    def speed(r: Row) -> float:
        if r.tokens_per_s:
            return -r.tokens_per_s
        return float(f"{r.flops_per_token:.9g}") if r.flops_per_token else math.inf

    tiers: list[list[Row]] = []
    for r in sorted((r for r in rows if r.fits), key=lambda r: (r.group != FULL, speed(r))):
        if tiers and tiers[-1][-1].group == r.group and tied(tiers[-1][-1], r):
            tiers[-1].append(r)
        else:
            tiers.append([r])
    return tiers


def tied(a: Row, b: Row) -> bool:
    """Whether two candidates' predicted speeds are too close to tell apart (TIED; FLOPs per token: equal)."""
    if a.tokens_per_s and b.tokens_per_s:
        return abs(a.tokens_per_s / b.tokens_per_s - 1) <= TIED
    return a.flops_per_token is not None and b.flops_per_token is not None and \
        float(f"{a.flops_per_token:.9g}") == float(f"{b.flops_per_token:.9g}")
