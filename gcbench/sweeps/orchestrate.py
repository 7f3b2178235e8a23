"""Running a grid: resume from the output file, skip configs larger than one that ran out of memory, each record
appended as its config ends, the policies of one configuration timed paired after each has run (their records
rewritten in place with it), sweeps sharing an output file running each configuration once (claims.py), Ctrl-C and
SIGTERM stop the running child and keep what is measured."""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.grid import SweepSpec
from gcbench.errors import DeadlineReached, GcbenchError, WontFit, raise_interrupt
from gcbench.instruments import free_without_context
from gcbench.paired import choose_baseline, pairable
from gcbench.results.schema import (AWAITING_PAIRING, NOT_YET_PAIRED, STATUSES, Status, config_key, config_label,
                                    policy_label)
from gcbench.results.rewrite import compact_records, replace_record
from gcbench.results.store import (append_record, drop_truncated_last_line, ensure_writable, read_records,
                                   records_after)
from gcbench.runner import check_fits, model_size
from gcbench.resolved import ResolvedRun, resolve_record
from gcbench.spec import RunSpec
from gcbench.launch import PairingFailed, failure_record, launcher
from gcbench.launch.slots import make_slots, run_side_by_side, side_by_side_fields, threads_within_slots
from gcbench.sweeps.claims import Claims
from gcbench.sweeps.frontier import OomFrontier
from gcbench.sweeps.progress import SweepProgress


# What --retry-failed runs again, with the oom records that were not run for want of free memory at the time and
# cluster jobs killed for host memory; an oom (measured, or predicted past the cap) is a result and stays (--rerun
# runs it).
RETRIED = (Status.ERROR, Status.TIMEOUT)


@dataclass(frozen=True)
class PlannedConfig:
    spec: ResolvedRun
    done: dict[str, Any] | None  # its record already in the output file (resume), or None: to run


class Sweep:
    """Runs a grid: resume from the output file, skip after OOMs, the policies of one configuration (same model, seq,
    batch, options) timed paired once each has run (unless `paired` is off), and their records appended together.

    Everything is validated when the Sweep is made (every config resolved, the output file's schema), before anything
    runs or is written. Ctrl-C and SIGTERM stop the running child and raise KeyboardInterrupt after it: the
    records written so far stay, and running the same sweep again resumes.
    """

    def __init__(self, grid: SweepSpec, *, rerun: bool = False, retry_failed: bool = False,
                 skip_after_oom: bool = True, console: Console | None = None,
                 stop_before: Callable[[list[ResolvedRun]], bool] | None = None):
        self.grid = grid
        # Asked before each config ([spec]) and each paired timing (its specs): True stops the sweep there with
        # DeadlineReached, after writing what finished (gcbench validate --deadline).
        self.stop_before = stop_before
        self.rerun = rerun  # run every config again, even those with a record in the output file
        self.retry_failed = retry_failed  # run again errors, timeouts and ooms not run for want of free memory
        self.skip_after_oom = skip_after_oom
        self.console = console  # progress and warnings go here (stderr); None: quiet, warnings via `warnings`
        self.sweep_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        # A Slurm job's node checks its devices itself: here only their form.
        self.specs = grid.expand(devices_here=grid.executor != "slurm")
        # Where configs run: one slot (here), or side by side on GPUs (--devices) or disjoint cores (--jobs).
        self.slots = make_slots([spec.device for spec in self.specs], grid.devices, grid.jobs)
        if len(self.slots) > 1 and grid.isolation != "process":
            raise GcbenchError("--isolation none runs every config in this process: it cannot run configs side by "
                               "side (--devices and --jobs need --isolation process)")
        if len(self.slots) > 1 and any(spec.nproc > 1 for spec in self.specs):
            raise GcbenchError("a sharded run (--nproc above 1) starts its own processes on several GPUs or cores: "
                               "run it without --devices or --jobs")
        given = any(t not in (None, "auto") for t in grid.values.get("threads", ()))
        self.specs = threads_within_slots(self.specs, self.slots, given=given)
        self._existing, notes = _existing_records(grid.out)
        for note in notes:
            self._warn(note)
        # Records other sweeps on the same file write while this one runs: lines not there now, as they come.
        self._seen_lock, self._done_since, self._seen = threading.Lock(), {}, set()
        records_after(grid.out, self._seen)
        # A config run again (--rerun, --retry-failed, --no-skip) keeps its record's id: the new record is a newer
        # version of it and takes its line, so that the file holds each config once (a fit's trials are their own).
        self._earlier = {config_key(r): r for r in self._existing
                         if isinstance(r.get("record_id"), str) and not r.get("fit_id")}
        self._rerun_ids = {r["record_id"] for r in self._earlier.values()}
        # The configs to run that cannot fit at all, known before the first child starts (warned about by run()).
        # On a cluster the job's child checks against its node's memory; this machine's says nothing about it.
        to_run = [p.spec for p in self.plan() if p.done is None]
        self.unfit = {} if grid.executor else self._unfit(to_run)
        if to_run and len(self.unfit) == len(to_run) and not any(e.by_cap for e in self.unfit.values()):
            # Not one config this machine could hold: records of configs never run would read as results.
            first = next(iter(self.unfit.values()))
            raise GcbenchError(str(first) if len(to_run) == 1 else f"none of the {len(to_run)} configs fits: {first}")

    def plan(self) -> list[PlannedConfig]:
        """Each config with its resumable record from the output file (newest wins), or None if it must run."""
        done = {} if self.rerun else {config_key(r): r for r in self._existing if self._counts_as_done(r)}
        return [PlannedConfig(spec, done.get(config_key(spec.as_record()))) for spec in self.specs]

    def _counts_as_done(self, record: dict[str, Any]) -> bool:
        status = record.get("status")
        if status == Status.SKIPPED:
            return self.skip_after_oom  # --no-skip runs what an earlier sweep skipped
        if status in RETRIED or record.get("oom_limit") in ("free", "host"):
            return not self.retry_failed  # a predicted oom for want of free memory depends on what else ran
        return status in STATUSES

    def run(self) -> list[dict[str, Any]]:
        """Run what the plan says must run; return the grid's records in grid order (resumed ones included)."""
        out = self.grid.out
        ensure_writable(out)
        self._warn_torn(drop_truncated_last_line(out))
        compact_records(out)  # versions of one record a killed writer left: one line each from now on
        plan = self.plan()
        if self.unfit:
            first = next(iter(self.unfit.values()))
            self._warn(f"{len(self.unfit)} of {sum(p.done is None for p in plan)} configs to run cannot fit: each is "
                       f"recorded as oom without running; the first: {first}")
        if self.grid.executor is not None:
            return self._run_as_jobs(plan)
        if len(self.slots) > 1 and any(s.cpus for s in self.slots):
            self._warn(f"{len(self.slots)} CPU jobs side by side: their memory is exact, their step times are not "
                       "comparable with a sequential sweep's (shared caches and memory bandwidth; each record says so)")
        cancel = threading.Event()  # Ctrl-C with several slots: every slot stops its child
        models = sorted({p.spec.model for p in plan if p.done is None})
        runners = [launcher(self.grid.isolation, self.grid.timeout_s, models=models, slot=slot, cancel=cancel)
                   for slot in self.slots]
        frontier = OomFrontier()
        envs: dict[tuple[str, int], dict] = {}
        groups = [list(g) for _, g in itertools.groupby(plan, key=lambda p: _policy_free_key(p.spec))]
        records: list[list[dict[str, Any]]] = [[] for _ in groups]
        to_run = sum(p.done is None for p in plan)
        claims, claimed_elsewhere = Claims(out), []
        claims.clean()
        with _sigterm_raises_interrupt(), SweepProgress(self.console, to_run, len(plan) - to_run,
                                                        [s.name for s in self.slots]) as view:
            def worker(slot: int, wait: bool = False) -> Callable[[int], None]:
                def run_group(i: int) -> None:
                    claim = None
                    if any(p.done is None or _awaits_pairing(p.done) for p in groups[i]):  # another sweep may run it
                        first = groups[i][0].spec.as_record()
                        what = (f"{first['model']} seq {first['seq_len']} batch {first['batch_size']}, which another "
                                f"sweep writing to {out} is running")
                        if wait:
                            view.waiting(what)
                        claim = claims.take(_policy_free_key(groups[i][0].spec), wait, cancel.is_set, what)
                        if claim is None and wait:
                            raise KeyboardInterrupt  # cancelled: as a runner stops when Ctrl-C reached the sweep
                        if claim is None:
                            claimed_elsewhere.append(i)  # after the rest, waiting for that sweep
                            return
                    try:
                        records[i] = self._run_group(self._done_elsewhere(groups[i], view), runners[slot], slot,
                                                     frontier, envs, view)
                    finally:
                        if claim is not None:
                            claim.release()
                return run_group

            run_side_by_side(range(len(groups)), [worker(i) for i in range(len(self.slots))], cancel, view.idle)
            if claimed_elsewhere:
                run_side_by_side(sorted(claimed_elsewhere), [worker(i, wait=True) for i in range(len(self.slots))],
                                 cancel, view.idle)
        return [r for group in records for r in group]

    def _done_elsewhere(self, group: list[PlannedConfig], view: SweepProgress) -> list[PlannedConfig]:
        """`group` with the configs that another sweep on the same output file finished since this one started
        taken as done (their records, whatever their status), not run again."""
        if all(p.done is not None for p in group):
            return group
        with self._seen_lock:
            new = records_after(self.grid.out, self._seen)
            self._done_since.update((config_key(r), r) for r in new if r.get("status") in STATUSES)
        fresh = [p if p.done is not None else
                 PlannedConfig(p.spec, self._done_since.get(config_key(p.spec.as_record()))) for p in group]
        view.shrink(sum(p.done is None for p in group) - sum(p.done is None for p in fresh))
        return fresh

    def _run_as_jobs(self, plan: list[PlannedConfig]) -> list[dict[str, Any]]:
        """Each configuration as a job through submitit (launch/slurm.py); its records appended as the job finishes."""
        from gcbench.launch.slurm import ClusterRun

        groups = [[p.spec.as_record() for p in g if p.done is None]
                  for _, g in itertools.groupby(plan, key=lambda p: _policy_free_key(p.spec))]
        groups = [g for g in groups if g]
        collected: dict[str, dict[str, Any]] = {}

        def write(record: dict[str, Any]) -> None:
            record["record_id"] = self._earlier_id(config_key(record), record) or record.get("record_id")
            self._append(record)
            collected[config_key(record)] = record

        with _sigterm_raises_interrupt(), SweepProgress(self.console, sum(map(len, groups)),
                                                        sum(p.done is not None for p in plan)) as view:
            if groups:
                ClusterRun(self.grid, run_as_job, write, view.finished, view.waiting).run(groups, self.sweep_id)
        return [p.done or collected[config_key(p.spec.as_record())] for p in plan]

    def _run_group(self, group: list[PlannedConfig], runner, slot: int, frontier: OomFrontier,
                   envs: dict[tuple[str, int], dict], view: SweepProgress) -> list[dict[str, Any]]:
        """The configs of one model/seq/batch (its policies) in `slot`, each record appended as soon as its config
        ends, then their paired timing, written over each record's line as its newer version (the same record_id).
        Whatever stops it first (Ctrl-C, an error, kill -9), the records written stay, unpaired, and say so."""
        pending: list[tuple[ResolvedRun, dict[str, Any], dict[str, Any]]] = []  # spec, record, the record as written
        earlier: list[tuple[ResolvedRun, dict[str, Any]]] = []  # in the file already (a resumed sweep)
        records = []
        pairs = self.grid.paired and len(group) > 1
        paired = False
        try:
            for config in group:
                record = config.done
                if record is not None and self.grid.paired and _awaits_pairing(record):
                    # a sweep killed before its paired timing: this one does it, and writes the newer version
                    written, record = record, {k: v for k, v in record.items() if k != "paired_error"}
                    pending.append((config.spec, record, written))
                elif record is not None:
                    earlier.append((config.spec, record))
                else:
                    record = self._run_one(config.spec, runner, slot, frontier, view, self.unfit.get(config.spec))
                    where = (config.spec.device, slot)  # cuda:0 is another GPU in each --devices slot
                    if record.get("env") is None:
                        record["env"] = envs.get(where) or _host_env(config.spec)
                    envs[where] = record["env"]
                    written = {**record, "paired_error": NOT_YET_PAIRED} if pairs and pairable(config.spec) else \
                        dict(record)
                    self._append(written)  # on disk before it is shown: a kill from now on cannot lose it
                    view.finished(record)
                    pending.append((config.spec, record, written))
                frontier.add(record)
                records.append(record)
            if self.grid.paired:
                self._pair([(spec, r) for spec, r, _ in pending], earlier, runner, slot, view)
            paired = True
        finally:
            for _, record, written in pending:
                if not paired and "paired_error" not in record and "paired_error" in written:
                    record["paired_error"] = written["paired_error"]  # stopped before its pairing: still true
                if record != written:
                    self._warn_torn(replace_record(self.grid.out, record))
        return records

    def _append(self, record: dict[str, Any]) -> None:  # over its earlier record's line when the config ran again
        if record.get("record_id") in self._rerun_ids:
            self._warn_torn(replace_record(self.grid.out, record))
        else:
            self._warn_torn(append_record(self.grid.out, record))  # another writer killed mid-line meanwhile

    def _pair(self, pending: list[tuple[ResolvedRun, dict[str, Any]]],
              earlier: list[tuple[ResolvedRun, dict[str, Any]]],
              runner, slot: int, view: SweepProgress) -> None:
        """Time the group's policies that ran interleaved in one process (paired.run_paired) and add each one's
        time_ratio to the records about to be written; with fewer than two such policies there is nothing to pair.
        Policies that ran in an earlier, interrupted sweep take part (so that `none` stays the baseline), but their
        records in the file stay as they are, unless they still await this pairing (in `pending`)."""
        if not any(r["status"] == Status.OK for _, r in pending):
            return
        ran = [(spec, r) for spec, r in earlier + pending if r["status"] == Status.OK]
        if len(ran) < 2:
            return
        writing = {id(r) for _, r in pending}
        for spec, r in ran:
            if not pairable(spec) and id(r) in writing:
                r["paired_error"] = "not paired: a compiling policy or a sharded run is timed in its own run only"
        ran = [(spec, r) for spec, r in ran if pairable(spec)]
        if len(ran) < 2:
            return
        baseline = choose_baseline([r for _, r in ran])
        try:
            self._check_deadline([spec for spec, _ in ran])
        except DeadlineReached:
            for _, r in ran:
                if id(r) in writing:
                    r["paired_error"] = "not paired: the sweep stopped at its deadline before the paired timing"
            raise
        view.pairing([spec for spec, _ in ran], slot)
        result = runner.paired([spec for spec, _ in ran], baseline, view.phase_of(slot))
        for spec, r in ran:
            if id(r) not in writing:
                continue
            if isinstance(result, PairingFailed):
                r["paired_error"] = f"paired timing failed: {result.why}"
            else:
                r.update(result[policy_label(r)])

    def _check_deadline(self, specs: list[ResolvedRun]) -> None:
        if self.stop_before is not None and self.stop_before(specs):
            raise DeadlineReached(f"stopped before {config_label(specs[0].as_record())}"
                                  + (" (paired timing)" if len(specs) > 1 else ""))

    def _unfit(self, specs: list[ResolvedRun]) -> dict[ResolvedRun, WontFit]:
        """The configs that cannot fit at all (their model state alone is too large for the memory cap or the free
        memory), known when the sweep is made, before the first child starts: they are recorded as `oom` without
        running. The rest is checked by the child before it allocates (runner.check_fits with the predicted peak)."""
        free: dict[str, int | None] = {}
        unfit = {}
        for spec in specs:
            if spec.device not in free:
                free[spec.device] = self._free_memory(spec.device)
            try:
                check_fits(spec, model_size(spec), free[spec.device])
            except WontFit as e:
                unfit[spec] = e
        return unfit

    def _free_memory(self, device: str) -> int | None:
        """What a config on `device` may find free: across --devices, the GPU with the most (the child checks its
        own GPU again before it allocates)."""
        gpus = [slot.name for slot in self.slots if slot.cuda_visible is not None]
        if not gpus:
            return free_without_context(device)
        free = [free_without_context(gpu) for gpu in gpus]
        return None if None in free else max(free)

    def _run_one(self, spec: ResolvedRun, runner, slot: int, frontier: OomFrontier, view: SweepProgress,
                 unfit: WontFit | None) -> dict[str, Any]:
        reason = frontier.skip_reason(spec) if self.skip_after_oom else None
        if unfit is not None:
            record = failure_record(spec, Status.OOM, f"not run: {unfit}", oom_predicted=True, oom_limit=unfit.limit)
            wall_ms = None
        elif reason is not None:
            record, wall_ms = failure_record(spec, Status.SKIPPED, reason), None
        else:
            self._check_deadline([spec])
            view.started(spec, slot)
            t0 = time.perf_counter()
            record = runner(spec, view.phase_of(slot))
            wall_ms = (time.perf_counter() - t0) * 1e3
        env = record.pop("env", None)
        if len(self.slots) > 1:
            record.update(side_by_side_fields(record, self.slots[slot], len(self.slots)))
        # config_wall_ms: the whole config as the sweep saw it (child start, build, all steps), in ms.
        rid = self._earlier_id(config_key(spec.as_record()), record) or record.get("record_id") or uuid.uuid4().hex
        return {**record, "sweep_id": self.sweep_id, "record_id": rid,
                "isolation": self.grid.isolation, "config_wall_ms": wall_ms, "env": env}

    def _earlier_id(self, key: str, record: dict[str, Any]) -> str | None:
        """The id of the config's earlier record, whose line its record run again takes; None (both kept) where no
        measurement (skipped, an oom not run, an error) would replace an ok one."""
        earlier = self._earlier.get(key)
        if earlier is None or (earlier.get("status") == Status.OK and record.get("status") != Status.OK):
            return None
        return earlier["record_id"]

    def _warn_torn(self, dropped: str | None) -> None:
        if dropped is not None:
            self._warn(f"{self.grid.out}: removed a truncated last line left by an interrupted run "
                       f"({dropped[:60]!r}...)")

    def _warn(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"gcbench: warning: {message}", markup=False, highlight=False)
        else:
            warnings.warn(message, stacklevel=3)


def run_as_job(task: dict[str, Any]) -> list[dict[str, Any]]:
    """What a cluster job runs (launch/slurm.py): one configuration's policies as a sweep runs them (a child each, then
    paired), into the job's own file, from which a requeued job resumes; returns their records to the driver."""
    specs = [resolve_record(r) for r in task["specs"]]  # resolved again, on the node that runs them
    values = {f.name: (getattr(specs[0], f.name),) for f in dataclasses.fields(RunSpec) if f.name != "policy"}
    values["policy"] = tuple(spec.policy for spec in specs)
    grid = SweepSpec(values, out=Path(task["out"]), timeout_s=task["timeout_s"], paired=task["paired"])
    return Sweep(grid).run()


def _awaits_pairing(record: dict[str, Any]) -> bool:  # written by a sweep stopped before its paired timing
    return record.get("paired_error") in AWAITING_PAIRING and isinstance(record.get("record_id"), str)


def _policy_free_key(spec: ResolvedRun) -> str:
    """What the configs of one paired group share: everything but the policy."""
    return config_key(spec.as_record(), ignore=("policy", "policy_options"))


def _existing_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records already in the output file (GcbenchError for another schema_version) and warnings about it."""
    try:
        if not path.exists():
            return [], []
    except OSError as e:  # a name too long: exists() raises rather than answer False
        raise GcbenchError(f"cannot use {str(path)[:200]!r} for results: {e.strerror or e}") from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path, checked=True)
    return records, [str(w.message) for w in caught]


def _host_env(spec: ResolvedRun) -> dict:
    # For records no child produced (skipped, or a child that died before reporting): the sweep process must not
    # create a CUDA context of its own (it would hold device memory during every config), so no GPU fields here.
    from gcbench.env import capture_env

    return capture_env("cpu", spec.threads)


@contextmanager
def _sigterm_raises_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler ending the job, `kill`) takes the Ctrl-C path: stop the child, keep the records."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
