"""Running the GPU validation plan: tier by tier, step by step, resuming where an earlier call stopped, stopping
cleanly before the work that would pass `--deadline`, and packing what it has for the trip home (`--archive`).

Every step resumes by itself: a sweep skips the configs in its file, a fit reads its trials back, a script whose
output ends with `exit 0` is not run again. The deadline is checked before each config, each paired timing, each
fit trial and each script, against the plan's cost of that piece (cost.py): what would not finish in time does not
start.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.errors import DeadlineReached, GcbenchError
from gcbench.estimators.stored import PREDICTIONS_ENV, stored_prediction
from gcbench.gpus import gpu
from gcbench.results.schema import STATUSES, Status, config_key, policy_label
from gcbench.results.store import read_records
from gcbench.resolved import ResolvedRun
from gcbench.validate import beforehand, cost
from gcbench.validate.plan import COMMAND_LIMIT_S, PLAN_LIMIT_S, Step, StepKind, Tier, steps_of

clock: Callable[[], float] = time.monotonic  # the deadline's clock (tests give a fake one)
EXIT_OK = "exit 0"
CALIBRATION = "calibration.ndjson"  # tier 1's calibration (validate/plan.py): it measures a config's start too
DEVICE = "cuda"  # every step of the plan runs on the GPU (the smoke plan: the fake one)


@dataclass
class StepPlan:
    """A step as planned now: its configs (resolved), what of it is done, and the device seconds left."""

    tier: Tier
    step: Step
    specs: list[ResolvedRun] = field(default_factory=list)  # sweep: its configs; fit: one expected trial each
    done: int = 0  # configs (trials) recorded already; a script: 1 when it finished
    total: int = 0
    seconds: float = 0.0  # device seconds of what is left

    @property
    def finished(self) -> bool:
        return self.total > 0 and self.done >= self.total


def _after_server_start(past: Callable[[float], bool]) -> Callable[[float], bool]:
    """`past`, asked first with the sweep's start added: a sweep's (a fit's) first config waits for the fork server
    its children come from (cost.SWEEP_START_S, as the plan prices a step)."""
    start = iter([cost.SWEEP_START_S])
    return lambda seconds: past(next(start, 0.0) + seconds)


class Validation:
    """The plan for one GPU (its records in `folder`), run or priced. `planning`: the configs are resolved for
    another machine (a dry run on a CPU machine), nothing is run."""

    def __init__(self, plan: list[Tier], folder: Path, *, predicted: Path, card: str | None = None,
                 tiers_wanted: set[int] | None = None, planning: bool = False, python: str = "python3",
                 console: Console | None = None):
        self.plan = [t for t in plan if tiers_wanted is None or t.number in tiers_wanted]
        self.folder = folder
        self.predicted = predicted
        self.card = card or cost.DEFAULT_CARD
        self.peak = cost.card_peak(card)
        self.pricing = cost.Pricing(self.peak, self._params_of, self._predicted_step_s)
        self.memory = gpu(card or cost.DEFAULT_CARD).usable_bytes
        self.planning = planning
        self.python = python
        self.console = console or Console(stderr=True)
        self._specs: dict[str, list[ResolvedRun]] = {}  # per step, its configs (or trials) once resolved
        self.steps: list[StepPlan] = []
        # (model, layers, seq, policy) -> (batch, step seconds) of a fit's estimate --fit row for this card
        self._fit_steps: dict[tuple, tuple[int, float]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Price every step again from what its files hold now (after a run; tier 1's calibration measures a
        config's start on the card); configs are resolved once."""
        self._read_starts()
        self.steps = [self._price(tier, step) for tier, step in steps_of(self.plan)]

    # ------------------------------------------------------------------------------------------------- pricing

    def _read_starts(self) -> None:
        self.pricing = dataclasses.replace(self.pricing, starts=cost.measured_starts(self.folder / CALIBRATION))

    @staticmethod
    def _params_of(spec: ResolvedRun) -> int:
        from gcbench.runner import model_size  # cached per model config

        return model_size(spec).n_params

    def _price(self, tier: Tier, step: Step) -> StepPlan:
        out = step.out(self.folder)
        planned = StepPlan(tier, step)
        if step.kind is StepKind.SWEEP:
            grid = self.sweep_grid(step)
            if step.name not in self._specs:
                self._specs[step.name] = grid.expand(devices_here=not self.planning)
            planned.specs = self._specs[step.name]
            done = _done_keys(out)
            is_done = lambda s: _resume_key(s.as_record()) in done  # noqa: E731
            planned.total, planned.done = len(planned.specs), sum(map(is_done, planned.specs))
            priced = cost.sweep_cost(planned.specs, grid.paired, self.pricing, is_done, self._expected_oom)
            planned.seconds = priced.seconds
        elif step.kind is StepKind.FIT:
            if step.name not in self._specs:
                self._specs[step.name] = self.fit_trials(step)
            trials = self._specs[step.name]
            recorded = _fit_trials_recorded(out, step)
            left = []
            for spec in trials:
                label = policy_label(spec.as_record())
                left += [spec] * max(0, cost.FIT_TRIALS_PER_POLICY - recorded.get(label, 0))
            planned.specs = trials
            planned.total = len(trials) * cost.FIT_TRIALS_PER_POLICY
            planned.done = planned.total - len(left)
            planned.seconds = cost.fit_cost(left, self.pricing).seconds
        else:
            planned.total, planned.done = 1, int(_finished(out))
            planned.seconds = 0.0 if planned.done else self._script_seconds(step)
        return planned

    def _predicted_step_s(self, spec: ResolvedRun) -> float | None:
        """The time model's step on this card, predicted beforehand: a sweep config's stored prediction, or a fit's
        `estimate --fit` step at its largest batch, scaled to the trial's batch; None where none was made."""
        stored = beforehand.stored_step_s(spec, self.predicted, self.card)
        if stored is not None:
            return stored
        fit = self._fit_steps.get((spec.model, spec.layers, spec.seq_len, policy_label(spec.as_record())))
        return fit[1] * spec.batch_size / fit[0] if fit else None

    def _expected_oom(self, spec: ResolvedRun) -> bool:
        """Whether the prediction made beforehand puts the config's peak past the card's memory (it is then
        recorded as oom when its child starts, or runs out at once)."""
        stored = stored_prediction(spec.as_record(), "cuda", self.predicted / "predictions.jsonl")
        peak = (stored or {}).get("predicted_peak_bytes")
        return peak is not None and self.memory is not None and peak > self.memory

    def _script_seconds(self, step: Step) -> float:
        if step.name == "gpu-tests":
            return cost.script_cost(step.name, gpu_tests=_count_gpu_tests(self.python)).seconds
        if step.name == "overhead":  # both sides build the model; 2 x rounds steps after a warm-up each
            words = dict(zip(step.argv[2::2], step.argv[3::2]))
            spec = self._resolve({"model": words["--model"], "seq_len": int(words["--seq"]),
                                  "batch_size": int(words["--batch"]), "policy": words["--policy"]})
            step_s = self.pricing.step_seconds(spec)
            from gcbench.blocks import total_blocks  # every stack's blocks

            blocks = total_blocks(spec.model_config()[0])
            rounds = int(words["--rounds"])
            return cost.script_cost(step.name, overhead_steps=2 * (rounds + 3) * step_s
                                    + 2 * cost.BUILD_S_PER_BLOCK * blocks).seconds
        return cost.script_cost(step.name, quick="--quick" in step.argv).seconds

    def _resolve(self, fields: dict[str, Any]) -> ResolvedRun:
        from gcbench.resolved import resolve
        from gcbench.spec import RunSpec

        return resolve(RunSpec(**fields, device=DEVICE), devices_here=not self.planning)

    def sweep_grid(self, step: Step):
        from gcbench.grid import SweepSpec

        options = {"device": DEVICE, **step.options, "out": str(step.out(self.folder))}
        return SweepSpec.load(None, options, where=f"validation step {step.name}")

    def fit_trials(self, step: Step) -> list[ResolvedRun]:
        """One spec per policy at the size its trials are expected near: the prediction made beforehand for this
        card where there is one, else the range's top."""
        o = step.options
        lo, hi = (int(x) for x in str(o["range"]).split(".."))
        expected = beforehand.predicted_fit_sizes(self.predicted, step, self.card)
        self._fit_steps.update(beforehand.fit_steps(self.predicted, step, self.card))
        return [self._resolve({"model": o["model"], "layers": o.get("layers"), "seq_len": int(o["seq"]),
                               "batch_size": min(hi, max(lo, expected.get(p, hi))), "policy": p,
                               "warmup_steps": int(o["warmup"]), "measure_steps": int(o["steps"])})
                for p in str(o["policy"]).split(",")]

    # -------------------------------------------------------------------------------------------------- totals

    def tier_seconds(self) -> dict[int, float]:
        totals: dict[int, float] = {}
        for planned in self.steps:
            totals[planned.tier.number] = totals.get(planned.tier.number, 0.0) + planned.seconds
        return totals

    def commands(self) -> int:
        return sum(cost.commands_for(s, COMMAND_LIMIT_S) for s in self.tier_seconds().values())

    def total_line(self) -> str:
        total = round(sum(self.tier_seconds().values()))
        return f"total: {total} s of device time in {self.commands()} commands"

    def describe(self) -> list[str]:
        """The plan, tier by tier: each step's configs, what is done, its device seconds; the total line last."""
        lines = []
        by_tier = self.tier_seconds()
        for tier in self.plan:
            seconds = by_tier.get(tier.number, 0.0)
            lines.append(f"tier {tier.number}: {tier.title} — {seconds:.0f} s"
                         + (f" ({cost.commands_for(seconds, COMMAND_LIMIT_S)} commands)"
                            if seconds > COMMAND_LIMIT_S else ""))
            for planned in (p for p in self.steps if p.tier is tier):
                if planned.step.kind is StepKind.SCRIPT:
                    state = "a script, done" if planned.finished else "a script"
                else:
                    unit = "trials" if planned.step.kind is StepKind.FIT else "configs"
                    state = f"{planned.total} {unit}, " + ("done" if planned.finished else f"{planned.done} done")
                lines.append(f"  {planned.step.name}: {state}, {planned.seconds:.0f} s")
                lines += _command_lines(planned.step.cli())
        specs = [spec for planned in self.steps for spec in planned.specs]
        timed = sum(self._predicted_step_s(spec) is not None for spec in specs)
        lines += [*cost.assumptions(self.card, timed, len(specs), self.pricing.starts),
                  f"limits: {COMMAND_LIMIT_S} s per command, {PLAN_LIMIT_S} s in all"]
        lines.append(self.total_line())
        return lines

    # --------------------------------------------------------------------------------------------------- running

    def run(self, deadline_s: float | None = None) -> Outcome:
        """Every step not finished, in plan order, until done or the deadline; an Outcome says which."""
        start = clock()
        stop_at = None if deadline_s is None else start + deadline_s
        self.folder.mkdir(parents=True, exist_ok=True)
        predictions = self.predicted / "predictions.jsonl"
        if predictions.exists():
            os.environ[PREDICTIONS_ENV] = str(predictions.resolve())  # children (fork servers, ranks) inherit it
        else:
            self.console.print(f"gcbench: warning: no predictions made beforehand in {predictions}: each config is "
                               "predicted here, on the GPU machine's CPU (gcbench validate --predict makes them)",
                               markup=False, highlight=False)
        outcome = Outcome()

        def past(seconds: float) -> bool:
            return stop_at is not None and clock() + seconds > stop_at

        for planned in self.steps:
            if planned.finished:
                continue
            step = planned.step
            self.console.print(f"== tier {planned.tier.number} · {step.name}: {step.why}", markup=False,
                               highlight=False)
            try:
                if step.kind is StepKind.SWEEP:
                    outcome.failed += self._sweep(step, past)
                elif step.kind is StepKind.FIT:
                    outcome.failed += self._fit(step, past)
                else:
                    if past(planned.seconds):
                        raise DeadlineReached(f"stopped before {step.name}")
                    outcome.failed += self._script(step)
                    self._read_starts()  # after the calibration: the start it measured prices what follows
            except DeadlineReached as e:
                outcome.stopped = f"{step.name}: {e}"
                break
        outcome.seconds = clock() - start
        return outcome

    def _sweep(self, step: Step, past: Callable[[float], bool]) -> list[str]:
        from gcbench.sweeps import Sweep

        grid = self.sweep_grid(step)
        past = _after_server_start(past)

        def stop_before(specs: list[ResolvedRun]) -> bool:
            if len(specs) == 1:
                return past(cost.config_seconds(specs[0], self.pricing))
            return past(cost.paired_seconds(specs, self.pricing))

        job = Sweep(grid, console=self.console, stop_before=stop_before)
        records = job.run()
        errors = sum(r.get("status") == Status.ERROR for r in records)
        return [f"{step.name}: {errors} config(s) with status error (see their \"error\" field in {grid.out})"] \
            if errors else []

    def _fit(self, step: Step, past: Callable[[float], bool]) -> list[str]:
        from gcbench.fits.command import fit_job
        from gcbench.grid import parse_options
        from gcbench.report.fit_tables import fit_table, recommendation_lines

        o = dict(step.options)
        fit_range, memory = o.pop("range"), o.pop("memory", None)
        isolation = o.pop("isolation", "process")
        values, _ = parse_options({"device": DEVICE, **o})
        out = step.out(self.folder)
        job, fields = fit_job(values, "batch", fit_range, 1, memory, "0%", out, 600.0, isolation, True,
                              self.console)
        past = _after_server_start(past)
        job.stop_before = lambda spec: past(cost.config_seconds(spec, self.pricing))
        fits, rec = job.run()
        text = io.StringIO()
        view = Console(file=text, width=100, color_system=None)
        view.print(fit_table(fits, "batch_size", job.cap, f"{fields['model']} · largest batch per policy · "
                                                          f"seq {fields['seq_len']}"))
        for line in recommendation_lines(rec, "batch_size", fits):
            view.print(line, markup=False, highlight=False, soft_wrap=True)
        self.folder.joinpath(f"fit-{step.name}.txt").write_text(text.getvalue())
        self.console.print(text.getvalue(), markup=False, highlight=False)
        errors = [f.error for f in fits if f.error]
        return [f"fit {step.name}: {e}" for e in errors]

    def _script(self, step: Step) -> list[str]:
        out = step.out(self.folder)
        partial = out.with_name(out.name + ".part")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(partial, "w") as f:
            status = subprocess.run(step.command(self.python, self.folder), stdout=f, stderr=subprocess.STDOUT,
                                    env=env).returncode
        if status < 0 or status >= 128:  # stopped by a signal (Ctrl-C): not a result
            partial.unlink(missing_ok=True)
            raise KeyboardInterrupt
        with open(partial, "a") as f:
            f.write(f"exit {status}\n")
        partial.replace(out)
        tail = out.read_text().splitlines()[-12:]
        self.console.print("\n".join(tail), markup=False, highlight=False)
        return [] if status == 0 else [f"{step.name}: exit {status} (see {out})"]


@dataclass
class Outcome:
    failed: list[str] = field(default_factory=list)
    stopped: str | None = None  # why the run stopped before the end (the deadline), or None
    seconds: float = 0.0


def archive(folder: Path, into: Path, summary: str) -> Path:
    """The results folder as one .tar.gz in `into`, beside summary.txt: what comes home from the GPU machine. The
    archive holds the folder by its path from the repository root (results/gpu/<gpu>/...)."""
    into.mkdir(parents=True, exist_ok=True)
    path = into / f"gcbench-gpu-{folder.name}.tar.gz"
    partial = path.with_name(path.name + ".part")
    with tarfile.open(partial, "w:gz") as tar:
        for file in sorted(folder.rglob("*")):
            # no hidden file (a rewrite's temporary a killed writer left) and no half-written one: what an import
            # takes (validate/unpack.py)
            if file.is_file() and not file.name.endswith(".part") and \
                    not any(part.startswith(".") for part in file.relative_to(folder).parts):
                tar.add(file, arcname=file.as_posix())
    partial.replace(path)
    (into / "summary.txt").write_text(summary)
    return path


def _command_lines(pieces: list[str], width: int = 78) -> list[str]:
    """A command line in lines of at most `width` columns (unless one piece is longer), indented, continued with
    a backslash as a shell reads it."""
    lines, line = [], "   "
    for piece in pieces:
        if len(line) + 1 + len(piece) > width - 2 and line.strip():
            lines.append(line + " \\")
            line = "     "
        line += " " + piece
    return [*lines, line]


def _resume_key(record: dict[str, Any]) -> str:
    # The thread count follows the machine's cores: the same config on another machine of the kind is done.
    return config_key(record, ignore=("threads",))


def _done_keys(out: Path) -> set[str]:
    if not out.exists():
        return set()
    return {_resume_key(r) for r in read_records(out) if r.get("status") in STATUSES}


def _finished(out: Path) -> bool:
    try:
        lines = out.read_text().splitlines()
    except OSError:
        return False
    return bool(lines) and lines[-1].strip() == EXIT_OK


def _fit_trials_recorded(out: Path, step: Step) -> dict[str, int]:
    """Trials per policy label of this step's fit already in the fit file (its model, layers and seq)."""
    if not out.exists():
        return {}
    o = step.options
    counts: dict[str, int] = {}
    for r in read_records(out):
        if r.get("fit_id") and r.get("model") == o["model"] and r.get("layers") == o.get("layers") \
                and r.get("seq_len") == int(o["seq"]):
            counts[policy_label(r)] = counts.get(policy_label(r), 0) + 1
    return counts


def _count_gpu_tests(python: str) -> int:
    """How many tests are marked gpu (collected, not run); 50 when pytest cannot say."""
    try:
        done = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                               "tests"], capture_output=True, text=True, timeout=120)
        last = [line for line in done.stdout.splitlines() if "collected" in line][-1]
        return int(last.split("/")[0].split()[0])
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return 50


def check_budget(validation: Validation) -> None:
    """The plan within its limits: tier 1 in one command, the whole at most PLAN_LIMIT_S (GcbenchError if not)."""
    by_tier = validation.tier_seconds()
    if by_tier.get(1, 0.0) > COMMAND_LIMIT_S:
        raise GcbenchError(f"tier 1 needs {by_tier[1]:.0f} s: more than one command ({COMMAND_LIMIT_S} s)")
    if sum(by_tier.values()) > PLAN_LIMIT_S:
        raise GcbenchError(f"the plan needs {sum(by_tier.values()):.0f} s: more than {PLAN_LIMIT_S} s")
