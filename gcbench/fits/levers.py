"""`gcbench fit --levers auto` (and `gcbench estimate --fit --gpu NAME --levers auto`): a plan across the memory
levers, not only the policy. See docs/levers.md, "A plan across levers".

The space is the product of the candidate values in CANDIDATES (space.py: one table), less the levers the user
fixed, less what reasoning rules out (`candidates`): an adapter trains under 1% of the parameters, so with an
adapter the optimizer and its step are not searched (their state is that small); the CUDA-only values (qlora, the
paged optimizers) only for a CUDA target; a paged optimizer's state must stay on the card beside the peak (past it
the driver pages it over PCIe every step, a time the model does not predict). Each candidate gets the largest
micro-batch predicted to fit (the search of `estimate --fit`, predict.py), and with a global batch (--batch) the
accumulation that reaches it.

Ranked by predicted tokens/s on the card (a CUDA target with a card gcbench has rates for): each candidate that
fits simulated at its micro-batch and accumulation, and its step played on the card by the time model
(estimators/step_time.py): matmuls and attention at the rates the card reaches, the optimizer's, bitsandbytes'
and every other kernel's bytes, recompute, the host issuing it all. Two candidates within TIED of each other are
not told apart (the table says so). Without a card (a CPU target, --gpu-memory alone) they are ranked by FLOPs per
token instead: the step's FLOPs with recompute are linear in the batch, so that is set by the policy, the adapter
and the loss (COST_LEVERS); no tokens/s is shown.
The search within a class (a policy and an adapter) goes level by level (the loss first, then how many memory
levers: the optimizer, its step, compile, precision, LoRA's 4-bit base) and stops at the first level where one
fits; the later levels are not predicted (listed as such): they add memory levers to one that fits, which keep
its FLOPs and, but for a fused optimizer, add time. Ties in speed go to the fewer changes from the defaults, then
the larger micro-batch, then the smaller peak. Full fine-tuning and adapters are ranked apart: an adapter trains a
different thing (the base is frozen).

Cheap first: a screen predicts the model state (parameters, gradients, optimizer state) once per distinct set of
memory levers and adapter; where that alone is over the budget, no policy can help and the candidate is not
searched.
The analytic model predicts where it knows the config (instant), the simulation elsewhere; a simulation is kept per
process (estimators/sharing.py) and the classes run side by side where there are cores.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gcbench.adapters import parse_adapter
from gcbench.errors import GcbenchError
from gcbench.estimators import analytic, estimate, step_flops
from gcbench.estimators.estimates import Progress
from gcbench.fields import RUN_FIELDS, Role, run_field, setup_words
from gcbench.fits.fit import DEFAULT_BATCH_RANGE
from gcbench.fits.predict import predict_fit, spec_at
from gcbench.fits.ranking import (  # noqa: F401 - the plan's ranking, and the groups it ranks apart
    ADAPTERS, FULL, TIED, ranked, tied, tier_heads, time_row)
from gcbench.fits.search import Search
from gcbench.fits.space import (  # noqa: F401 - what --levers may name (lever_command reads them here)
    CANDIDATES, LEVERS, lever_default, lever_space)
from gcbench.units import fmt_bytes

# The levers that change a step's FLOPs (recompute, the loss's chunks, no weight gradients of a frozen base), and
# those of them a class is made of. QLoRA counts as LoRA (its 4-bit base is dequantised: no matmul FLOPs of its own).
COST_LEVERS = tuple(f.name for f in RUN_FIELDS if f.plan_role in ("class", "flops"))
CLASS_LEVERS = tuple(f.name for f in RUN_FIELDS if f.plan_role == "class")
# Run fields the analytic model does not read (yet) and does not refuse: a candidate that sets one is simulated,
# never predicted by formulas that would leave it out. Remove a name here once analytic.py models it (it refuses
# adapters itself: analytic.unavailable).
ANALYTIC_BLIND = ("compile",)
DEFAULT_TOP = 5
NOT_NEEDED = "not predicted: one with fewer memory levers fits (name the levers to rank them all)"


def _adapter_kind(value: Any) -> str:
    return str(value).split(":")[0]


def _as_lora(value: Any) -> str:
    """QLoRA's adapter as LoRA's (the same options; skip= only keeps layers out of the 4-bit base): its class."""
    return str(parse_adapter(str(value)).as_lora()) if _adapter_kind(value) == "qlora" else str(value)


@dataclass
class Row:
    """One candidate of the plan and what was predicted for it."""

    levers: dict[str, Any]  # the searched fields' values
    spec_fields: dict[str, Any]  # every RunSpec field of the candidate but the micro-batch
    target: str = "cuda"
    micro_batch: int | None = None
    accum: int = 1
    peak: int | None = None  # max_memory_allocated at micro_batch
    # a paged optimizer's state in CUDA managed memory, which must stay on the card beside the peak: past it the
    # driver pages it over PCIe every step, a time the model does not predict (docs/levers.md, "Paged optimizers")
    paged: int = 0
    flops_per_token: float | None = None
    tokens_per_s: float | None = None  # predicted on the card (the time model); None without one
    step_ms: float | None = None
    method: str = ""
    reason: str | None = None  # why it is not ranked: not predicted, or does not fit

    @property
    def group(self) -> str:
        return FULL if self.spec_fields.get("adapter", "none") == "none" else ADAPTERS

    def _of(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_as_lora(self.spec_fields.get(k, lever_default(k, self.target))) for k in names)

    @property
    def cost_class(self) -> tuple[str, ...]:
        """The levers that set its FLOPs per token: candidates equal in them are equally fast."""
        return self._of(COST_LEVERS)

    @property
    def search_class(self) -> tuple[str, ...]:
        return self._of(CLASS_LEVERS)

    @property
    def level(self) -> tuple[int, int]:
        """(levers it adds to its class that cost FLOPs, memory levers it adds: QLoRA's 4-bit base is one)."""
        memory = sum(1 for k, v in self.levers.items() if k not in COST_LEVERS and v != lever_default(k, self.target))
        return (sum(1 for k in COST_LEVERS if k not in CLASS_LEVERS and k in self.levers
                    and self.levers[k] != lever_default(k, self.target)),
                memory + (_adapter_kind(self.spec_fields.get("adapter")) == "qlora"))

    @property
    def changes(self) -> int:
        """How many levers differ from their defaults (LoRA's 4-bit base counted as one more)."""
        return sum(1 for k in CLASS_LEVERS if k in self.levers and self.levers[k] != lever_default(k, self.target)) \
            + sum(self.level)

    @property
    def fits(self) -> bool:
        return self.reason is None and self.micro_batch is not None

    def words(self) -> str:
        """The policy, then the levers that differ from the defaults, as setup names say them."""
        changed = {k: v for k, v in self.levers.items() if k != "policy" and v != lever_default(k, self.target)}
        words = [str(self.spec_fields["policy"])] if "policy" in self.levers else []
        words += [w for w in (setup_words({**changed, "grad_accum": self.accum}, roles=(Role.LEVER,)),) if w]
        return " · ".join(words) or "defaults"


@dataclass
class LeverPlan:
    """A plan's input: the fields every candidate shares, the levers searched and their candidate values."""

    fields: dict[str, Any]  # RunSpec fields fixed for every candidate (model, seq_len, fixed levers, ...)
    searched: dict[str, tuple[Any, ...]]  # lever -> candidate values (grad_accum: () = derived)
    budget: int  # bytes a predicted peak stays within (headroom taken off)
    target: str  # cuda | cpu: what is predicted
    global_batch: int | None = None  # micro-batch x accumulation to reach; None: the largest micro-batch
    rows: list[Row] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # combinations the run refuses, and why
    unrunnable: list[Row] = field(default_factory=list)  # left out: this machine cannot run them (reason: why)

    @property
    def hi(self) -> int:
        return self.global_batch or DEFAULT_BATCH_RANGE[1]

    @property
    def per_row(self) -> int:
        """The most predictions one candidate's search makes (with a global batch, one more: micro x accum)."""
        return Search(1, self.hi, self.budget).bound + (1 if self.global_batch else 0)


def candidates(plan: LeverPlan, refused: list[str] | None = None) -> list[Row]:
    """Every candidate of the plan, in the table's order; with an adapter the optimizer and its step are not
    searched (their state is the adapters'). A combination the run itself refuses (compile with sac, ...) is no
    candidate: `refused` gets why."""
    searched = {k: v for k, v in plan.searched.items() if k != "grad_accum"}
    rows, seen = [], set()
    for values in itertools.product(*searched.values()):
        levers = dict(zip(searched, values))
        if levers.get("adapter", plan.fields.get("adapter", "none")) != "none":
            # the optimizer and its step change the adapters' state: under 1% of the model's at the default rank
            for name in ("optimizer", "optim_in_backward"):
                if name in levers:
                    levers[name] = plan.fields.get(name, lever_default(name, plan.target))
        key = tuple(sorted((k, str(v)) for k, v in levers.items()))
        if key in seen:
            continue
        seen.add(key)
        row = Row(levers, {**plan.fields, **levers}, plan.target)
        try:
            spec_at(candidate_fields(plan, row), row.spec_fields["policy"], "batch_size", 1)
        except GcbenchError as e:
            if refused is not None:
                refused.append(f"{row.words()}: {e}")
            continue
        rows.append(row)
    return rows


def analytic_knows(spec_fields: Mapping[str, Any]) -> bool:
    """Whether the analytic model predicts this config: it knows the policy and family, and no lever it does not
    read (ANALYTIC_BLIND) is set."""
    if any(spec_fields.get(k, run_field(k).default) != run_field(k).default for k in ANALYTIC_BLIND):
        return False
    return analytic.unavailable(spec_at({**spec_fields, "device": "cpu"}, spec_fields["policy"], "batch_size", 1)) \
        is None


def predict_plan(plan: LeverPlan, card: Any = None, progress: Progress | None = None, top: int = DEFAULT_TOP
                 ) -> list[Row]:
    """Predict the candidates of `plan` (plan.rows; `candidates` when empty) and rank them (`ranked`): the screen,
    then each class's levels side by side, then each fitting candidate's step time on `card` (a gpus.Gpu; its
    FLOPs per token where there is no time model for the target or the card). `progress`: told of each
    prediction; its total, the most the plan can make, falls as classes end early. A group with fewer than `top`
    that fit gets its runners-up predicted too (`_runners_up`)."""
    from gcbench.estimators.card_rates import rates_for
    from gcbench.estimators.sharing import sharing_cores, side_by_side
    from gcbench.models import build_model

    plan.rows = plan.rows or candidates(plan, plan.refused)
    states: dict[tuple, list[Row]] = {}  # the model state is the memory levers' and the adapter's
    for row in plan.rows:
        key = tuple(str(v) for k, v in sorted(row.levers.items()) if k not in COST_LEVERS or k == "adapter")
        states.setdefault(key, []).append(row)
    classes: dict[tuple, list[Row]] = {}
    for row in plan.rows:
        classes.setdefault(row.search_class, []).append(row)
    count = [0, len(states) + plan.per_row * len(plan.rows)]  # done, the most there can be
    lock = threading.Lock()

    def tell(what: str, made: int = 1, dropped: int = 0) -> None:
        with lock:
            count[0] += made
            count[1] -= dropped
            if progress is not None:
                progress(count[0], count[1], what)

    first = spec_at({**plan.fields, "device": "cpu"}, "none", "batch_size", 1)
    build_model(first.config, "meta", first.param_dtype)  # the model's code imported once, before forking
    with sharing_cores(max(len(classes), 2)):
        tell("", 0)
        side_by_side(lambda rows: _screen(plan, rows, tell), list(states.values()))
        side_by_side(lambda rows: _search_class(plan, rows, tell), list(classes.values()))
        runners_up = _runners_up(plan.rows, top)
        tell("", 0, -plan.per_row * len(runners_up))
        side_by_side(lambda row: _search(plan, row, tell), runners_up)
        rates = rates_for(card) if plan.target == "cuda" else None
        if rates is not None and not isinstance(rates, str):
            fitting = [r for r in plan.rows if r.fits]
            tell("", 0, -len(fitting))  # one more simulation each, at its size
            side_by_side(lambda row: (time_row(row, {**candidate_fields(plan, row), "grad_accum": row.accum},
                                               plan.target, rates), tell(f"{row.words()}: time")), fitting)
        else:
            costs: dict[tuple, list[Row]] = {}
            for row in (r for r in plan.rows if r.fits):
                costs.setdefault(row.cost_class, []).append(row)
            side_by_side(lambda rows: _count(plan, rows), list(costs.values()))
    return ranked(plan.rows)


def candidate_fields(plan: LeverPlan, row: Row) -> dict[str, Any]:
    """The candidate's fields as predicted: on the CPU (the target says what), no cap, the target's precision."""
    return {**row.spec_fields, "device": "cpu", "memory_cap_bytes": None,
            "precision": row.spec_fields.get("precision") or lever_default("precision", plan.target)}


def _screen(plan: LeverPlan, rows: list[Row], tell) -> None:
    """The model state of candidates that share it, predicted once (policy full, micro-batch 1); over the budget,
    none of them is searched."""
    fields = candidate_fields(plan, rows[0])
    method = "analytic" if analytic_knows({**fields, "policy": "full"}) else "simulate"
    paged = 0
    try:
        found = estimate(spec_at(fields, "full", "batch_size", 1), method, plan.target)
    except GcbenchError as e:
        reason = f"not predicted: {e}"
    else:
        paged = found.optimizer_paged_bytes or 0  # the same at any policy and size: each row's search keeps room
        state = found.param_bytes + found.grad_bytes + found.optimizer_bytes + paged
        included = f" ({fmt_bytes(paged)} of it paged optimizer state)" if paged else ""
        reason = f"model state {fmt_bytes(state)}{included} > budget" if state > plan.budget else None
    for r in rows:
        r.reason, r.paged = reason, paged
    tell("model state", 1, plan.per_row * len(rows) if reason else 0)


def _search_class(plan: LeverPlan, rows: list[Row], tell) -> None:
    """A class's candidates level by level (Row.level), stopping after the first level where one fits: the later
    ones would rank below it."""
    for level in sorted({r.level for r in rows}):
        for row in (r for r in rows if r.level == level):
            _search(plan, row, tell)
        if any(r.fits for r in rows):
            later = [r for r in rows if r.level > level and r.reason is None]
            for r in later:
                r.reason = NOT_NEEDED
            tell("", 0, plan.per_row * len(later))
            return


def _runners_up(rows: list[Row], top: int) -> list[Row]:
    """Per group with fewer than `top` candidates that fit: the next levels of its classes that fit, as many as
    it lacks, the fewest levers first (they rank below their class's best, but show what the levers buy)."""
    found: list[Row] = []
    for group in (FULL, ADAPTERS):
        fitting = {r.search_class for r in rows if r.group == group and r.fits}
        lacking = top - sum(1 for r in rows if r.group == group and r.fits)
        waiting = [r for r in rows if r.group == group and r.reason == NOT_NEEDED and r.search_class in fitting]
        for row in sorted(waiting, key=lambda r: r.level)[:max(lacking, 0)]:
            row.reason = None
            found.append(row)
    return found


def _search(plan: LeverPlan, row: Row, tell) -> None:
    """The largest micro-batch of one candidate predicted to fit; with a global batch, the largest divisor of it
    that fits and the accumulation that reaches it."""
    if row.reason is not None:
        return
    fields = candidate_fields(plan, row)
    row.method = "analytic" if analytic_knows(fields) else "simulate"
    made = [0]

    def tried(value: int) -> None:
        made[0] += 1
        tell(f"{row.words()}: batch {value}")

    try:
        # from batch 1: one prediction says that nothing fits, and a fitting one's peak guides the next
        found = predict_fit(fields, fields["policy"], "batch_size", Search(1, plan.hi, plan.budget - row.paged),
                            plan.target, tried=tried, method=row.method, prior=1)
        row.micro_batch, row.peak = found.value, found.estimate.peak_bytes if found.estimate else None
        if row.micro_batch is None:
            row.reason = "batch 1 does not fit" + _paged_words(row.paged, " beside")
        elif plan.global_batch:
            made[0] += 1
            _accumulate(plan, row, fields)
    except GcbenchError as e:
        row.reason, row.micro_batch = f"not predicted: {e}", None
    tell("", 0, plan.per_row - made[0])


def _accumulate(plan: LeverPlan, row: Row, fields: dict[str, Any]) -> None:
    """The largest divisor of the global batch at or below the largest micro-batch, and the accumulation that
    reaches the global batch; predicted again as it will run (the token ids of every micro-batch are held)."""
    g = plan.global_batch
    for m in (m for m in range(row.micro_batch, 0, -1) if g % m == 0):
        found = estimate(spec_at({**fields, "grad_accum": g // m}, fields["policy"], "batch_size", m), row.method,
                         plan.target)
        if found.peak_bytes <= plan.budget - row.paged:
            row.micro_batch, row.accum, row.peak = m, g // m, found.peak_bytes
            return
    row.reason = f"no micro-batch x accumulation makes batch {g} fit" + _paged_words(row.paged, " beside")
    row.micro_batch = None


def _paged_words(paged: int, how: str) -> str:
    """` beside its paged optimizer state (13.59 GiB)`, where there is one."""
    return f"{how} its paged optimizer state ({fmt_bytes(paged)})" if paged else ""


def _count(plan: LeverPlan, rows: list[Row]) -> None:
    """The FLOPs per token of a class: one forward and backward at batch 1, its memory levers at their defaults
    (the optimizer's step is not counted; compile fuses no matmul away)."""
    row = rows[0]
    fields = {**candidate_fields(plan, row), "grad_accum": 1,
              "adapter": _as_lora(row.spec_fields.get("adapter", "none"))}
    fields.update({k: lever_default(k, plan.target) for k in ("optimizer", "optim_in_backward", "compile")})
    try:
        flops = step_flops(spec_at(fields, fields["policy"], "batch_size", 1), plan.target)
    except GcbenchError as e:
        for r in rows:
            r.reason = f"FLOPs not counted: {e}"
        return
    for r in rows:
        r.flops_per_token = flops / fields["seq_len"]
