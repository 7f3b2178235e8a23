"""The largest size each policy is predicted to fit, and its predicted step time: the start of `gcbench fit`'s
search, and all of `gcbench estimate --fit` (any GPU, no GPU needed).

The same search as the real trials (search.py), with a prediction in place of a run: the analytic model where it
knows the policy and family (instant), else the fake-tensor simulation (seconds for a 7B model). The step time is
the time model's on the named GPU (estimators/step_time.py): the size found simulated and its step played on the
card; a prediction, labelled as such everywhere it is shown.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.estimators import analytic, estimate, step_flops
from gcbench.estimators.estimates import Estimate, Progress
from gcbench.estimators.sharing import sharing_cores, side_by_side
from gcbench.fits.search import Search, Trial, extrapolate
from gcbench.resolved import ResolvedRun, resolve
from gcbench.fields import default_precision, run_field
from gcbench.models import build_model
from gcbench.optimizers import optimizer_kind
from gcbench.policies import Plan, parse_policy
from gcbench.spec import RunSpec

_REPLAYING = threading.Lock()


@dataclass(frozen=True)
class PredictedFit:
    policy: str
    value: int | None  # the largest size predicted to fit; None: not even the smallest
    estimate: Estimate | None  # at `value`
    next_peak: int | None  # the predicted peak of the next size (past the budget); None at the range's top
    method: str
    predictions: int  # how many sizes were predicted
    flops: int | None = None  # of one step at `value`, recompute included
    # where the caching allocator was replayed on the card (`replay`): its max_memory_reserved at `value`, and the
    # largest size the allocated peak alone would have given
    reserved: int | None = None
    allocated_only: int | None = None



def spec_at(fields: Mapping[str, Any], policy: str, vary: str, value: int) -> ResolvedRun:
    """The config of one tried size, resolved (bad input fails here, before anything runs)."""
    return resolve(RunSpec(**{**fields, "policy": policy, vary: value}))


def predict_fit(fields: Mapping[str, Any], policy: str, vary: str, search: Search, target: str,
                flops: bool = False, tried: Callable[[int], None] | None = None,
                method: str | None = None, prior: int | None = None, replay: bool = False) -> PredictedFit:
    """The largest size of `search`'s range whose predicted peak on `target` is within `search.budget` (the search
    object is used up). `flops`: also count the step's FLOPs at that size. `tried`: told of each size predicted.
    `method`: analytic | simulate; None: the analytic model where it knows the policy and family, else simulate.
    `prior`: the size tried first (None: the range's middle). `replay` (a CUDA target): then the largest size up
    to that one on which PyTorch's caching allocator, replayed on a card that leaves it `search.budget` bytes,
    does not run out (`replayed_maximum`): what decides whether a step runs."""
    # the target says what is predicted; its default precision is what a run there would take
    fields = {**fields, "device": "cpu", "memory_cap_bytes": None,
              "precision": fields.get("precision") or default_precision(target)}
    if method is None:
        method = "analytic" if analytic.unavailable(spec_at(fields, policy, vary, search.lo)) is None else "simulate"
    found: dict[int, Estimate] = {}

    # a simulation counts the FLOPs on its tracked step for a tenth more time: cheaper than a pass for them after
    count = flops and method == "simulate"

    def attempt(value: int) -> Trial:
        e = found[value] = estimate(spec_at(fields, policy, vary, value), method, target, flops=count)
        if tried is not None:
            tried(value)
        return Trial(value, e.peak_bytes <= search.budget, e.peak_bytes, e.param_bytes + e.grad_bytes
                     + e.optimizer_bytes)

    search.run(attempt, lambda s: extrapolate(s, prior))
    best, next_up = search.maximum, search.next_up
    allocated_only, reserved = best, None
    # a paged optimizer's state is outside the allocator (simulate.replay_allocator refuses it)
    # a plan chooses its mix against the allocated peak: replaying it would need the plan to budget reserved memory
    replayed_here = replay and target == "cuda" and best is not None and not policy.startswith("plan") and \
        optimizer_kind(fields.get("optimizer", "adamw")).paged is None
    if replayed_here:
        best, reserved, replayed = replayed_maximum(fields, policy, vary, search, best, tried)
        found.update(replayed)
        # the next size runs out in the allocator, not by its allocated peak (which is within the budget)
        next_up = None if best != allocated_only else next_up
    counted = None
    if flops and best is not None:
        at = found[best]
        counted = at.flops if at.flops is not None else step_flops(spec_at(fields, policy, vary, best), target)
    return PredictedFit(policy, best, found.get(best) if best is not None else None,
                        found[next_up].peak_bytes if next_up in found else None, method, len(found), counted,
                        reserved, allocated_only if replayed_here else None)


def replayed_maximum(fields: Mapping[str, Any], policy: str, vary: str, done: Search, best: int,
                     tried: Callable[[int], None] | None = None) -> tuple[int | None, int | None, dict[int, Estimate]]:
    """(the largest size up to `best` on which the caching allocator replayed on the card does not run out, its
    max_memory_reserved, the simulations made): the same search, from `best` down, each trial a replay
    (simulate.replay_allocator with the card's `done.budget` bytes). Reserved memory exceeds the allocated peak by
    a few percent (the allocator's rounding and unused segments), so it starts at `best` and usually ends near."""
    from gcbench.estimators import plan
    from gcbench.estimators.caching_allocator import OutOfMemory
    from gcbench.estimators.simulate import replay_allocator

    search, made, reserved = Search(done.lo, best, done.budget, done.multiple), {}, {}

    def replayed(value: int, capacity: int | None):
        with _REPLAYING:  # in this process, one at a time: the simulation patches torch's functions while it runs
            return replay_allocator(plan.with_mix(spec_at(fields, policy, vary, value), "cuda"), capacity)

    def attempt(value: int) -> Trial:
        # first without a limit: its reserved peak guides the search (a secant through two of them); past the
        # budget, again on the card, where the allocator gives its cached segments back before it runs out
        made[value], allocator = replayed(value, None)
        reserved[value] = allocator.peak_reserved
        fits = allocator.peak_reserved <= done.budget
        if not fits:
            try:
                reserved[value] = replayed(value, done.budget)[1].peak_reserved
                fits = True
            except OutOfMemory:
                pass
        if tried is not None:
            tried(value)
        e = made[value]
        return Trial(value, fits, allocator.peak_reserved, e.param_bytes + e.grad_bytes + e.optimizer_bytes)

    search.run(attempt, lambda s: extrapolate(s, best))
    return search.maximum, reserved.get(search.maximum), made


def predict_each(fields: Mapping[str, Any], policies: list[str], vary: str, lo: int, hi: int, budget: int,
                 target: str, progress: Progress | None = None, method: str | None = None,
                 replay: bool = False) -> list[PredictedFit]:
    """predict_fit of each policy over lo..hi within `budget`, FLOPs counted, in the policies' order; side by side
    where the machine has the cores (estimators/sharing.py: the policies' searches in threads, their simulations
    in worker processes). `progress`: told of each size tried and each policy done; `method`, `replay`:
    predict_fit's."""
    done: list[str] = []
    lock = threading.Lock()

    def tell(what: str) -> None:
        if progress is not None:
            with lock:
                progress(len(done), len(policies), what)

    def one(policy: str) -> PredictedFit:
        found = predict_fit(fields, policy, vary, Search(lo, hi, budget), target, flops=True,
                            tried=lambda value: tell(f"{policy}: {run_field(vary).flag} {value}"), method=method,
                            replay=replay)
        with lock:
            done.append(policy)
        tell(f"{policy}: done")
        return found

    # The model's transformers code imported here, once, before the workers are forked: the analytic model needs it
    # here anyway, and each worker would import it again (a 7B fit's first simulation started 1.4 s later).
    first = spec_at({**fields, "device": "cpu"}, policies[0], vary, lo)
    build_model(first.config, "meta", first.param_dtype)
    # a plan's choice simulates its kinds of block at once: room for them beside the other policies
    plans = [p for p in map(parse_policy, policies) if isinstance(p, Plan)]
    with sharing_cores(len(policies) + sum(len(p.kinds) - 1 for p in plans)):
        tell("")  # the workers are forked: a progress bar may start its thread now
        return side_by_side(one, policies)


def try_predict(fields: Mapping[str, Any], policy: str, vary: str, search: Search, target: str) -> int | None:
    """The predicted largest size, as the real search's first guess; None where nothing can predict it."""
    try:
        return predict_fit(fields, policy, vary, search, target).value
    except GcbenchError:
        return None
