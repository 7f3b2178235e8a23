"""The largest size each policy is predicted to fit, and its predicted step time: the start of `gcbench fit`'s
search, and all of `gcbench estimate --fit` (any GPU, no GPU needed).

The same search as the real trials (search.py), with a prediction in place of a run: the analytic model where it
knows the policy and family (instant), else the fake-tensor simulation (seconds for a 7B model). The step time is
predicted from the step's FLOPs (the simulation's count, recompute included) at the GPU's dense bf16 peak times an
efficiency the user states: a prediction, labelled as such everywhere it is shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.estimators import analytic, estimate
from gcbench.estimators.estimates import Estimate
from gcbench.fits.search import Search, Trial, extrapolate
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec

DEFAULT_EFFICIENCY = 0.4  # of the dense peak, recompute included (hardware FLOPs utilisation): an assumption


@dataclass(frozen=True)
class PredictedFit:
    policy: str
    value: int | None  # the largest size predicted to fit; None: not even the smallest
    estimate: Estimate | None  # at `value`
    next_peak: int | None  # the predicted peak of the next size (past the budget); None at the range's top
    method: str
    predictions: int  # how many sizes were predicted
    flops: int | None = None  # of one step at `value`, recompute included

    def step_seconds(self, peak_flops: float | None, efficiency: float) -> float | None:
        if not self.flops or not peak_flops:
            return None
        return self.flops / (peak_flops * efficiency)


def spec_at(fields: Mapping[str, Any], policy: str, vary: str, value: int) -> ResolvedRun:
    """The config of one tried size, resolved (bad input fails here, before anything runs)."""
    return resolve(RunSpec(**{**fields, "policy": policy, vary: value}))


def predict_fit(fields: Mapping[str, Any], policy: str, vary: str, search: Search, target: str,
                flops: bool = False) -> PredictedFit:
    """The largest size of `search`'s range whose predicted peak on `target` is within `search.budget` (the search
    object is used up). `flops`: also count the step's FLOPs at that size (one simulation)."""
    # the target says what is predicted; its default precision is what a run there would take
    fields = {**fields, "device": "cpu", "memory_cap_bytes": None,
              "precision": fields.get("precision") or ("bf16" if target == "cuda" else "fp32")}
    method = "analytic" if analytic.unavailable(spec_at(fields, policy, vary, search.lo)) is None else "simulate"
    found: dict[int, Estimate] = {}

    def attempt(value: int) -> Trial:
        e = found[value] = estimate(spec_at(fields, policy, vary, value), method, target)
        return Trial(value, e.peak_bytes <= search.budget, e.peak_bytes, e.param_bytes + e.grad_bytes
                     + e.optimizer_bytes)

    search.run(attempt, lambda s: extrapolate(s))
    best = search.maximum
    step_flops = None
    if flops and best is not None:
        at = found[best]
        step_flops = at.flops if at.flops is not None else \
            estimate(spec_at(fields, policy, vary, best), "simulate", target, flops=True).flops
    return PredictedFit(policy, best, found.get(best) if best is not None else None,
                        found[search.next_up].peak_bytes if search.next_up is not None else None,
                        method, len(found), step_flops)


def try_predict(fields: Mapping[str, Any], policy: str, vary: str, search: Search, target: str) -> int | None:
    """The predicted largest size, as the real search's first guess; None where nothing can predict it."""
    try:
        return predict_fit(fields, policy, vary, search, target).value
    except GcbenchError:
        return None
