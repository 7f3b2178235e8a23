"""`gcbench fit`: per policy, the largest batch (or sequence) that runs in a memory budget, found by real trials,
then the winners timed paired and the fastest recommended.

Each trial is one config run like a sweep's (a fresh child process, a timeout; an OOM is a result) and appended to
the results file as a normal record with the search it belonged to (`fit_id`, `fit_vary`, `fit_budget_bytes`,
`fit_trial`). The search (search.py) starts from the predicted maximum (predict.py) and ends exact: the maximum ran
and the next size ran out of memory. The budget is a memory cap on every trial (--memory, less --headroom), or on a
GPU without --memory its free memory as a trial sees it: read by a probe process once its CUDA context exists.

Resumable: a fit reads back the trials of the same search already in its results file (same setup, policy and
budget) and never runs one again; it goes on under their fit_id. On a GPU the winners are not timed paired in one
process: each runs at its memory edge, where an earlier run in the same process would fragment the allocator for
the next; they are ranked by their own runs.
"""

from __future__ import annotations

import math
import secrets
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.errors import DeadlineReached, GcbenchError, WontFit
from gcbench.fits.predict import spec_at, try_predict
from gcbench.fits.search import Search, Trial, extrapolate
from gcbench.instruments import free_after_context
from gcbench.paired import choose_baseline, pairable
from gcbench.policies import Plan, parse_policy
from gcbench.policies.plan import canonical_size
from gcbench.results.schema import SHAPE_FIELDS, Status, config_key, config_label, peak_bytes, policy_label
from gcbench.results.rewrite import open_for_writing
from gcbench.results.stats import standing
from gcbench.results.store import append_record, read_records
from gcbench.runner import check_fits, model_size
from gcbench.fields import RUN_FIELDS, DeviceKind, Role, run_field
from gcbench.resolved import ResolvedRun
from gcbench.launch import PairingFailed, launcher
from gcbench.sweeps.progress import SweepProgress

VARY = {run_field(name).flag: name for name in SHAPE_FIELDS}  # --vary batch | seq -> the field it searches
DEFAULT_POLICIES = ("none", "full", "sqrtn", "sac", "plan")
DEFAULT_OUT = Path("results/fit.jsonl")
DEFAULT_BATCH_RANGE = (1, 4096)
DEFAULT_SEQ_LO = 16
# A free-memory budget read again (a resumed fit, another machine of the same kind) differs by a few MiB: trials
# recorded under a budget this close are the same search.
SAME_BUDGET = 0.01
NOT_PAIRED_ON_GPU = ("not paired: on a GPU each winner runs at its memory edge, where an earlier run in the same "
                     "process fragments the allocator for the next; ranked by its own run")


@dataclass(frozen=True)
class FitSpec:
    fields: Mapping[str, Any]  # RunSpec fields shared by every trial (not the policy, not the varied one)
    policies: tuple[str, ...]
    vary: str  # a RunSpec field: batch_size | seq_len
    lo: int
    hi: int
    multiple: int = 1
    memory: int | None = None  # --memory: the budget; None: the GPU's free memory
    headroom: float = 0.0  # fraction of the budget kept free
    out: Path = DEFAULT_OUT
    timeout_s: float = 600.0
    isolation: str = "process"
    paired: bool = True


@dataclass
class PolicyFit:
    """One policy's search and what it found."""

    policy: str  # as typed on the command line, canonical
    search: Search
    predicted: int | None  # the prediction the search started from
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # a trial that neither ran nor ran out of memory stopped the search

    @property
    def best(self) -> dict[str, Any] | None:
        """The record of the largest size that ran (None: nothing fit, or the search stopped)."""
        if self.error is not None or self.search.maximum is None:
            return None
        return next(r for r in self.records if r[self.search_field] == self.search.maximum and r["status"] == Status.OK)

    @property
    def next_record(self) -> dict[str, Any] | None:
        if self.error is not None or self.search.next_up is None:
            return None
        return next(r for r in self.records if r[self.search_field] == self.search.next_up)

    search_field: str = "batch_size"


@dataclass(frozen=True)
class Recommendation:
    record: dict[str, Any]
    tokens_per_s: float
    paired: bool  # ranked by paired timing (all winners timed interleaved) rather than separate runs
    command: str
    # the other winners whose speed cannot be told apart from this one's (results.stats.told_apart): a rerun
    # may order them the other way
    tied: list[dict[str, Any]] = field(default_factory=list)
    unsure: list[dict[str, Any]] = field(default_factory=list)  # of the tied, those with nothing to tell by


class Fit:
    """Runs the searches of a FitSpec. Everything is validated when made (every policy at the range's ends, the
    budget against the model state), before anything runs or is written."""

    def __init__(self, spec: FitSpec, console: Console | None = None,
                 stop_before: Callable[[ResolvedRun], bool] | None = None):
        self.spec = spec
        self.console = console
        # Asked before each trial: True stops the fit there with DeadlineReached, its trials written.
        self.stop_before = stop_before
        self.fit_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        first = spec_at(spec.fields, "none", spec.vary, spec.lo)
        self.device = first.device
        self.budget = self._budget(first)
        self.cap = math.floor(self.budget * (1 - spec.headroom))
        # A cap on every trial where the budget is not the device itself: on CPU always (the tracker enforces it)
        self.trial_cap = self.cap if spec.memory is not None or spec.headroom > 0 else None
        self.policies = [canonical_policy(p, self.cap) for p in spec.policies]
        for policy in self.policies:  # bad input fails now: both ends of the range, every policy
            for value in (spec.lo, spec.hi):
                self._trial_spec(policy, value)
        try:  # the model state against the cap, or without one against the device's free memory
            check_fits(self._trial_spec("none", spec.lo), model_size(first), None if self.trial_cap else self.budget,
                       cap_name=self.cap_name)
        except WontFit as e:
            raise GcbenchError(f"the budget is below what the model needs before any activation: {e}") from None
        open_for_writing(spec.out)
        self.earlier = self._earlier_trials()
        if self.earlier:  # a resumed fit goes on under the id its trials have
            self.fit_id = self.earlier[-1]["fit_id"]

    def _earlier_trials(self) -> list[dict[str, Any]]:
        """The trials of this same search already in the results file (ok or oom), oldest first."""
        if not self.spec.out.exists():
            return []
        keys = {self._key(self._trial_spec(p, self.spec.lo).as_record()) for p in self.policies}

        def same(record: dict[str, Any]) -> bool:
            budget = record.get("fit_budget_bytes")
            return (record.get("fit_vary") == self.spec.vary and record.get("status") in (Status.OK, Status.OOM)
                    and budget is not None and abs(budget - self.cap) <= SAME_BUDGET * self.cap
                    and self._key(record) in keys)

        return [r for r in read_records(self.spec.out) if r.get("fit_id") and same(r)]

    def _key(self, record: dict[str, Any]) -> str:
        """A trial's search: its config less the size searched and the run's thread count."""
        return config_key(record, ignore=(self.spec.vary, "threads"))

    def _trial_spec(self, policy: str, value: int) -> ResolvedRun:
        """The config of one trial: the shared fields, the policy, the size, the fit's cap."""
        return spec_at({**self.spec.fields, "memory_cap_bytes": self.trial_cap}, policy, self.spec.vary, value)

    @property
    def cap_name(self) -> str:
        """The trials' memory cap (each runs under --memory-cap) named by the options the user gave."""
        budget = "--memory" if self.spec.memory is not None else "the free memory"
        return f"{budget} less --headroom {self.spec.headroom * 100:g}%" if self.spec.headroom else budget

    def _budget(self, first: ResolvedRun) -> int:
        if self.spec.memory is not None:
            return self.spec.memory
        if first.device_kind is not DeviceKind.CUDA:
            raise GcbenchError("on CPU give --memory: the budget the live-tensor tracker holds each trial to "
                               "(e.g. --memory 12MiB)")
        free = free_after_context(first.device)
        if free is None:
            raise GcbenchError(f"cannot read the free memory of {first.device}: give --memory")
        return free

    def run(self) -> tuple[list[PolicyFit], Recommendation | None]:
        spec = self.spec
        runner = launcher(spec.isolation, spec.timeout_s, models=[spec.fields["model"]])
        fits = [PolicyFit(p, Search(spec.lo, spec.hi, self.cap, spec.multiple), None, search_field=spec.vary)
                for p in self.policies]
        target = DeviceKind.of(self.device)
        written = {id(r) for r in self.earlier}  # records already in the file (earlier trials, appended ones)
        pending: list[dict[str, Any]] = []  # the winners, appended once the paired timing is in them
        with SweepProgress(self.console, sum(f.search.bound for f in fits), 0) as view:
            try:
                for fit in fits:
                    view.phase(f"{fit.policy}: predicting the largest {spec.vary.split('_')[0]}")
                    fit.predicted = try_predict(spec.fields, fit.policy, spec.vary,
                                                Search(spec.lo, spec.hi, self.cap, spec.multiple), target)
                    self._search(fit, runner, view)
                    best = fit.best
                    for record in fit.records:
                        if record is best and id(record) not in written:
                            pending.append(record)
                        elif id(record) not in written:
                            append_record(spec.out, record)
                            written.add(id(record))
                    view.shrink(fit.search.bound - len(fit.records))
                if spec.paired and target is DeviceKind.CUDA:
                    for record in pending:
                        record["paired_error"] = NOT_PAIRED_ON_GPU
                elif spec.paired:
                    self._pair([f for f in fits if f.best is not None], runner, view, pending)
            finally:  # stopped (deadline, Ctrl-C, an error): every trial that finished is kept
                for record in [*pending, *(r for f in fits for r in f.records)]:
                    if id(record) not in written:
                        append_record(spec.out, record)
                        written.add(id(record))
        return fits, recommend([f.best for f in fits if f.best is not None], self._command)

    def _search(self, fit: PolicyFit, runner, view: SweepProgress) -> None:
        search = fit.search
        for record in self.earlier:  # a resumed fit: its trials so far, never run again
            if policy_label(record) == fit.policy and not search.done:
                self._add(fit, record)
        while not search.done and fit.error is None:
            value = search.next_value(*extrapolate(search, fit.predicted))
            trial_spec = self._trial_spec(fit.policy, value)
            if self.stop_before is not None and self.stop_before(trial_spec):
                raise DeadlineReached(f"stopped before {config_label(trial_spec.as_record())}")
            view.started(trial_spec)
            record = runner(trial_spec, view.phase)
            if record.get("oom_limit") == "cap":  # not run: past the cap, which the user gave as the budget
                record["error"] = record["error"].replace("--memory-cap allows", f"{self.cap_name} allows")
            record = {**record, "fit_id": self.fit_id, "fit_vary": self.spec.vary, "fit_budget_bytes": self.cap,
                      "fit_trial": len(search.trials) + 1}
            view.finished(record)
            self._add(fit, record)

    def _add(self, fit: PolicyFit, record: dict[str, Any]) -> None:
        """A trial's record into its search: fits (ok), does not (oom), or stops the search (anything else)."""
        fit.records.append(record)
        value, search = record[self.spec.vary], fit.search
        if record["status"] == Status.OK:
            state = sum(record.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            # On CUDA the allocator's reserve is what runs out (whole segments), so it guides the next guess.
            peak = record.get("peak_reserved_bytes") or peak_bytes(record)
            search.add(Trial(value, True, peak, state or None))
        elif record["status"] == Status.OOM:
            search.add(Trial(value, False))
        else:
            fit.error = f"{config_label(record)}: {record['status']}: {record.get('error')}"

    def _pair(self, fits: list[PolicyFit], runner, view: SweepProgress, pending: list[dict[str, Any]]) -> None:
        """Time the winners interleaved in one process; each about to be written gets its paired tokens/s (a
        winner of a resumed fit, in the file already, takes part but stays as it is)."""
        winners = [(self._trial_spec(f.policy, f.search.maximum), f.best) for f in fits]
        winners = [(s, r) for s, r in winners if pairable(s)]
        if len(winners) < 2:
            return
        view.pairing([s for s, _ in winners])
        result = runner.paired([s for s, _ in winners], choose_baseline([r for _, r in winners]), view.phase)
        pairing = secrets.token_hex(4)  # the records timed in these rounds (not a resumed fit's earlier winner)
        for spec, record in winners:
            if not any(record is p for p in pending):
                continue
            if isinstance(result, PairingFailed):
                record["paired_error"] = f"paired timing failed: {result.why}"
                continue
            # Its own step times only: a time ratio compares one seq and batch, and the winners differ in size.
            record["paired_step_ms"] = result[policy_label(record)]["paired_step_ms"]
            record["fit_paired_id"] = pairing
            tokens = spec.batch_size * spec.seq_len * spec.grad_accum
            record["paired_tokens_per_s"] = tokens / (statistics.median(record["paired_step_ms"]) / 1e3)

    def _command(self, record: Mapping[str, Any]) -> str:
        """The `gcbench run` command that measures `record`'s config again."""
        given = {**self.spec.fields, "seq_len": record["seq_len"], "batch_size": record["batch_size"],
                 "policy": policy_label(record)}
        if self.trial_cap:
            given["memory_cap_bytes"] = canonical_size(f"{self.trial_cap}B")
        words = ["gcbench", "run"]
        for run_option in RUN_FIELDS:  # how long to measure and on how many threads: the run's own defaults
            value = given.get(run_option.name)
            if value is None or run_option.role is Role.LENGTH or run_option.name == "threads":
                continue
            words += [f"--{run_option.flag}", run_option.kind.show(value)]
        return " ".join(words)


def recommend(best: list[dict[str, Any]], command) -> Recommendation | None:
    """The fastest of the policies' largest configs (results.schema.fastest), with the command that runs it and the
    others it cannot be told apart from."""
    if (found := standing(best)) is None:
        return None
    return Recommendation(found.top, found.tokens_per_s, found.paired, command(found.top), found.tied,
                          found.unsure)


def canonical_policy(policy: str, cap: int | None) -> str:
    """A policy as typed, canonical; `plan` without its memory gets the fit's budget."""
    parsed = parse_policy(policy)
    if isinstance(parsed, Plan) and not parsed.memory and cap is not None:
        parsed = parse_policy(f"plan:memory={cap}B,allow_offload={parsed.allow_offload}")
    return str(parsed)
