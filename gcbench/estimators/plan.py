"""Choose the `plan` policy's mix for one run shape: per block none / attn / sac / full (/ offload), so that the
predicted peak fits the plan's memory at the least recompute FLOPs.

The costs come from the simulation (simulate.py), once per kind of block with every block of that kind: the
forward/backward peak and the FLOPs with recompute. The blocks of one model are alike, so a kind's cost per block
is its difference to `none` divided by the number of blocks, and a mix costs the sum over its blocks: a linear
model in the number of blocks of each kind. The mix is then an exact small integer program, solved by enumeration
(every count of the saving kinds; the cheapest kind that still saves fills the rest in closed form). The chosen
mix is simulated itself; where the linear model was optimistic, the budget is tightened by the difference and the
choice made again. PyTorch's own anchor for the same question is torch.distributed._tools.sac_ilp (AutoSAC), which
solves a MILP over op-level choices per module with pulp; docs/policies.md compares the two.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gcbench.errors import GcbenchError
from gcbench.estimators.estimates import Estimate
from gcbench.policies import Plan
from gcbench.policies.plan import UNIFORM
from gcbench.resolved import ResolvedRun

TIGHTEN_ROUNDS = 3


@dataclass(frozen=True)
class KindCost:
    """One kind of block: what it saves per block against `none` (bytes) and what it recomputes (FLOPs)."""

    kind: str
    saves: float
    recompute: float


@dataclass(frozen=True)
class PlanChoice:
    counts: dict[str, int]  # kind -> blocks
    predicted_peak: int  # the chosen mix's simulated peak (bytes)
    recompute_flops: int  # its FLOPs with recompute minus none's
    fits: bool  # the simulated peak is within the plan's memory


def with_mix(spec: ResolvedRun, target: str) -> ResolvedRun:
    """`spec` with its plan's mix chosen for `target` (cuda | cpu); any other policy, or a chosen plan, as it is."""
    if not isinstance(spec.policy, Plan) or spec.policy.chosen:
        return spec
    return spec.replace(policy=spec.policy.with_mix(choose(spec, target).counts))


def choose(spec: ResolvedRun, target: str) -> PlanChoice:
    """The mix of least recompute whose simulated peak fits the plan's memory; when none fits, the mix of least
    peak (a run under a cap then records the oom)."""
    return _choose(_choosing(spec), target)


def begin_choice(spec: ResolvedRun, target: str) -> None:
    """Begin the simulations `choose` starts with, one per kind of block, to run side by side with others
    (estimators/sharing.py); choose then finds them kept."""
    from gcbench.estimators.simulate import begin

    spec = _choosing(spec)
    for kind in spec.policy.kinds:
        begin(spec.replace(policy=UNIFORM[kind]), target, flops=True)


def _choosing(spec: ResolvedRun) -> ResolvedRun:
    # what the choice depends on: the shape, the levers, the plan; not how long a run measures, nor its cap. A
    # sharded run's mix is chosen on the unsharded step at the rank's batch (its whole model state: a cautious
    # choice), as it always was: a rank cannot simulate FSDP2 over a fake world (fake_ranks.py), and the mix a
    # rank runs must be the one `estimate` predicted
    return spec.replace(device="cpu", memory_cap_bytes=None, warmup_steps=1, measure_steps=1, max_steps=1,
                        max_time_s=1.0, seed=0, shard="none", nproc=1)


@functools.lru_cache(maxsize=64)
def _choose(spec: ResolvedRun, target: str) -> PlanChoice:
    from gcbench.estimators.simulate import simulate, simulate_each

    plan: Plan = spec.policy  # type: ignore[assignment]
    from gcbench.blocks import total_blocks  # every stack's blocks

    n = total_blocks(spec.model_config()[0])
    runs: dict[str, Estimate] = {}
    # the kinds side by side where cores are shared (estimators/sharing.py)
    uniform = simulate_each([spec.replace(policy=UNIFORM[kind]) for kind in plan.kinds], target, flops=True)
    for kind, found in zip(plan.kinds, uniform):
        if isinstance(found, GcbenchError):
            if kind == "none":
                raise found
            continue  # a kind this model cannot run (attn without a transformers attention module): not offered
        runs[kind] = found
    base = runs["none"]
    costs = [KindCost(kind, (_fwd_bwd(base) - _fwd_bwd(e)) / n, max((e.flops or 0) - (base.flops or 0), 0) / n)
             for kind, e in runs.items()]
    floor = base.optimizer_peak_bytes or 0  # the optimizer step's peak: no mix lowers it
    budget, tried = plan.memory_bytes, []
    most_saving = {max(costs, key=lambda c: c.saves).kind: n}
    for _ in range(TIGHTEN_ROUNDS):
        counts = solve(costs, n, _fwd_bwd(base) - budget) or most_saving  # None: the linear model says none fits
        found = simulate(spec.replace(policy=plan.with_mix(counts)), target, flops=True)
        tried.append(PlanChoice(counts, found.peak_bytes, max((found.flops or 0) - (base.flops or 0), 0),
                                max(found.peak_bytes, floor) <= plan.memory_bytes))
        if tried[-1].fits or counts == most_saving:
            break
        budget -= found.peak_bytes - plan.memory_bytes  # the linear model was optimistic by this much
    fitting = [c for c in tried if c.fits]
    return fitting[0] if fitting else min(tried, key=lambda c: c.predicted_peak)


def _fwd_bwd(e: Estimate) -> int:
    return max(e.forward_peak_bytes, e.backward_peak_bytes)


def solve(costs: list[KindCost], n: int, need: float) -> dict[str, int] | None:
    """The counts per kind (summing to n) that save at least `need` bytes at the least recompute, on a tie the fewer
    blocks changed from `none`; None when no mix saves that much.

    Every count of the kinds but the cheapest saving one is enumerated; that one takes the least count that still
    covers `need`, and `none` the rest: exact, as recompute and savings are linear in the counts."""
    useful = sorted((c for c in costs if c.kind != "none" and c.saves > 0), key=lambda c: (c.recompute, -c.saves))
    if need <= 0:
        return {"none": n}
    if not useful:
        return None
    cheapest, others = useful[0], useful[1:]
    best: tuple[tuple[float, int], dict[str, int]] | None = None
    for counts in _compositions(len(others), n):
        saved = sum(k * c.saves for k, c in zip(counts, others))
        rest = n - sum(counts)
        k = max(0, math.ceil((need - saved) / cheapest.saves - 1e-9))
        if k > rest:
            continue
        recompute = k * cheapest.recompute + sum(k_ * c.recompute for k_, c in zip(counts, others))
        key = (recompute, k + sum(counts))
        if best is None or key < best[0]:
            best = (key, {cheapest.kind: k, **{c.kind: k_ for k_, c in zip(counts, others)}, "none": rest - k})
    return None if best is None else {kind: k for kind, k in best[1].items() if k}


def _compositions(parts: int, total: int):
    """Every tuple of `parts` counts >= 0 whose sum is at most `total`."""
    if parts == 0:
        yield ()
        return
    for first in range(total + 1):
        for rest in _compositions(parts - 1, total - first):
            yield (first, *rest)

