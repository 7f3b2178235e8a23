"""Step times and whether to trust them: how many steps to measure (by the statistics of results/stats.py), the
host's load while measuring, the stability rule, and policies timed paired (interleaved rounds in one process).

Nothing here reads a clock of its own: every duration comes from the caller's timer and every deadline from the
caller's clock, so the rules are tested with fake clocks. No torch here; psutil reads the host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from gcbench.fields import DEFAULT_MAX_STEPS, DEFAULT_MAX_TIME_S
from gcbench.results.schema import NoteKind, TimingNote
from gcbench.units import plural
from gcbench.results.stats import MIN_SAMPLES, Stats  # the statistics of samples (compare reads them too)

# --steps auto: measure until the median's 95% interval is within +-2% of it on CPU, +-1% on CUDA (pyperf and
# pytest-benchmark also calibrate by time, not by a fixed count; a GPU's steps repeat far better, and levers 3% apart
# must be told apart there), with a minimum and two budgets.
TARGET_HALF_WIDTH = {"cpu": 0.02, "cuda": 0.01}
# ... and not before the steps span this many seconds: the interval (results/stats.py) sees drift in spells shorter
# than the steps span, and a rerun meets another spell. On this project's 2-core VM a tiny model's steps drift in
# spells of seconds, invisible to the host's counters (no steal time, no load): 8 reruns of 1.5 s each claimed
# +-1-2% while another run's median fell inside a run's interval 25% of the time; spanning at least 5 s, 50%; 10 s,
# 80% and, on a machine drifting from 13 to 16 ms over the two minutes, 50% (83% is what a right interval gives;
# benchmarks/rerun_interval.py, docs/methodology.md). So by default (--max-time 10) auto measures 10 s of steps; a
# longer --max-time lets the interval's target end it after 10 s.
MIN_SPAN_S = 10.0
# From this many steps on, the interval is judged at every (n // CHECK_EVERY_FROM)-th step count, not every one.
CHECK_EVERY_FROM = 50
# The progress line's interval is recomputed every 10 steps, past 100 steps at most this often.
PROGRESS_EVERY_S = 0.5
MIN_STEPS = MIN_SAMPLES  # the fewest samples that can have an interval (6; correlated steps need more)
# Correlated steps in a calm spell look better known than they are: auto stops once the interval has been within its
# target at this many step counts in a row, not at the first (on simulated AR(1) steps correlated 0.8, the interval
# where auto stopped held the median 86% of the time stopping at the first, 91% at the third).
CONFIRMATIONS = 3
# The stability rule (docs/methodology.md, "When a step time is trusted"). torch.utils.benchmark warns at an IQR of
# 10% of the median; GPU kernels repeat far better than a CPU shared with the OS, so CUDA gets 5%.
REL_IQR_LIMIT = {"cuda": 0.05, "cpu": 0.10}
MIN_STEPS_TO_JUDGE = 5  # fewer samples say nothing about their spread
SPARE_CORE_SLACK = 0.25  # cores other processes may use beyond those the run leaves free (the OS, a sweep parent)
# The 1-minute load average before the steps includes the run's own threads (its warm-up): it may exceed the cores
# by this much before the host counts as loaded.
LOAD_SLACK = 0.5


# ---------------------------------------------------------------------------------------------------- how long

@dataclass(frozen=True)
class StepBudget:
    """How many steps to measure: a fixed count, or (auto) until the median's interval is within `target` of it
    (CONFIRMATIONS step counts in a row) once the steps span `min_span_s` (or the whole time limit, if shorter), at
    least MIN_STEPS, at most `step_limit` steps or `time_limit_s` of measuring (--max-steps, --max-time)."""

    fixed: int | None = None  # --steps N; None: auto
    step_limit: int = DEFAULT_MAX_STEPS
    time_limit_s: float = DEFAULT_MAX_TIME_S
    target: float = TARGET_HALF_WIDTH["cpu"]
    min_span_s: float = MIN_SPAN_S

    @property
    def most(self) -> int:
        return self.fixed if self.fixed is not None else self.step_limit

    def stop_reason(self, series: Sequence[Sequence[float]], elapsed_s: float) -> str | None:
        """Why to stop now ("fixed", "ci", "max-steps", "max-time"), or None to measure another step. `series`: one
        list of step times, or for paired rounds the per-round ratios of each policy (all must reach the target)."""
        n = min(len(s) for s in series)
        if self.fixed is not None:
            return "fixed" if n >= self.fixed else None
        # The interval is judged at every step count up to CHECK_EVERY_FROM, then at every n/CHECK_EVERY_FROM-th,
        # and not before the steps span min_span_s: its cost (O(n log n), 7 ms at 10,000 steps) is paid about 50
        # times per tenfold of steps once the span is reached.
        stride = max(1, n // CHECK_EVERY_FROM)
        if n >= MIN_STEPS + CONFIRMATIONS - 1 and n % stride == 0 and \
                elapsed_s >= min(self.min_span_s, self.time_limit_s) and \
                all(_within(Stats.of(s[:m]).ci_half_width, self.target)
                    for s in series for m in range(n, n - CONFIRMATIONS * stride, -stride)):
            return "ci"
        if n >= self.step_limit:
            return "max-steps"
        if n >= min(MIN_STEPS, self.step_limit) and elapsed_s >= self.time_limit_s:
            return "max-time"
        return None


def _within(half_width: float | None, target: float) -> bool:
    return half_width is not None and half_width <= target


def measure_until(budget: StepBudget, timed_step: Callable[[], float], clock: Callable[[], float],
                  progress: Callable[[str], None]) -> tuple[list[float], str]:
    """Step times (whatever `timed_step` returns, ms) until `budget` says stop, and why it stopped. `clock`:
    seconds, for the time budget. Stopping at the first step whose interval is narrow enough makes the 95% nominal
    (a sequential test covers a little less); the minimum of 6 steps and the interval's margin for correlated steps
    keep that small."""
    samples: list[float] = []
    t0 = shown = clock()
    ci = ""
    while (reason := budget.stop_reason([samples], (now := clock()) - t0)) is None:
        if len(samples) % 10 == 0 and (len(samples) <= 100 or now - shown >= PROGRESS_EVERY_S):
            ci, shown = _ci_text(samples), now  # the interval costs O(n log n): 7 ms at 10,000 steps
        progress(f"measuring step {len(samples) + 1}" + (f"/{budget.fixed}" if budget.fixed else ci))
        samples.append(timed_step())
    return samples, reason


def _ci_text(samples: Sequence[float]) -> str:
    half = Stats.of(samples).ci_half_width if samples else None
    return f" (median +-{half:.1%})" if half is not None else ""


def step_time_fields(step_ms: list[float], stop: str) -> dict[str, Any]:
    """The record's time fields from the raw samples (ms)."""
    stats = Stats.of(step_ms)
    return {"step_ms": step_ms, "step_ms_median": stats.median, "step_ms_iqr": stats.iqr,
            "step_ms_rel_iqr": stats.rel_iqr if math.isfinite(stats.rel_iqr) else None, "step_ms_ci": list(stats.ci) if stats.ci else None, "steps_stop": stop}


# ---------------------------------------------------------------------------------------------------- the host

def cores_available() -> int:
    """CPUs this process may run on: its affinity set (taskset, cgroup cpusets), or the logical CPUs."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def default_threads() -> int:
    """--threads auto on CPU: every available core but one, left to the OS, a sweep's parent and the machine's other
    work, so that an OpenMP thread is less often descheduled (which stalls every parallel region)."""
    return max(1, cores_available() - 1)


def _busy_s(times) -> float:
    # guest time is inside user already; steal is time a hypervisor gave to other machines: contention too
    return sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


class HostLoad:
    """How busy the host was around the measured steps: the 1-minute load average before and after, and the cores
    other processes kept busy meanwhile (host CPU time minus this process's, over the wall time)."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._process = psutil.Process()

    def __enter__(self) -> HostLoad:
        self.load_before = _load_1m()
        self._t0, self._host0, self._own0 = self._clock(), _busy_s(psutil.cpu_times()), self._own_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = self._clock() - self._t0
        others = (_busy_s(psutil.cpu_times()) - self._host0) - (self._own_s() - self._own0)
        self.other_cores = max(0.0, others / wall) if wall > 0 else None
        self.load_after = _load_1m()

    def _own_s(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def fields(self, threads: int) -> dict[str, Any]:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except AttributeError:
            affinity = None
        return {"load_1m_before": self.load_before, "load_1m_after": self.load_after,
                "cpus_logical": os.cpu_count(), "cpu_affinity": affinity, "torch_threads": threads,
                "other_cpu_cores": self.other_cores}


def _load_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available (Windows)
        return None


# ---------------------------------------------------------------------------------------------------- the rule

def timing_verdict(record: Mapping[str, Any], device_kind: str) -> tuple[bool, list[TimingNote]]:
    """The stability rule: (timing_stable, why not). Trusted when at least MIN_STEPS_TO_JUDGE steps were measured,
    their IQR is within REL_IQR_LIMIT of the median, other processes (or a hypervisor) kept no more cores busy than
    the run left free (plus SPARE_CORE_SLACK), and the 1-minute load average before the steps, which includes the
    run's own threads, was not more than LOAD_SLACK above the available cores."""
    notes = []
    n, limit = len(record["step_ms"]), REL_IQR_LIMIT[device_kind]
    if n < MIN_STEPS_TO_JUDGE:
        notes.append(TimingNote(NoteKind.FEW_STEPS,
                                f"only {n} measured step{'s' if n != 1 else ''}: too few to judge the spread"))
    elif record["step_ms_rel_iqr"] is None or record["step_ms_rel_iqr"] > limit:
        spread = record["step_ms_rel_iqr"]
        notes.append(TimingNote(NoteKind.SPREAD, f"step times spread {spread:.0%} of the median (IQR), above "
                                f"{limit:.0%}") if spread is not None
                     else TimingNote(NoteKind.ZERO_MS, "step times of 0 ms: no spread to judge"))
    cores = len(record["cpu_affinity"]) if record.get("cpu_affinity") else record.get("cpus_logical") or 1
    used = min(record["torch_threads"], cores) if device_kind == "cpu" else 1  # a CUDA run: the launching thread
    others = record.get("other_cpu_cores")
    if others is not None and others > cores - used + SPARE_CORE_SLACK:
        notes.append(TimingNote(NoteKind.BUSY_HOST, f"other processes kept {others:.1f} of {plural(cores, 'core')} busy while "
                                f"it ran on {used}"))
    if record.get("gpu_throttled"):
        window = record.get("gpu_window") or {}
        held = sum(window.get(k) or 0.0 for k in ("power_capped_ms", "thermal_capped_ms"))
        share = f" for {held / window['window_ms']:.0%} of the steps' time" if held and window.get("window_ms") else ""
        low, high = window.get("sm_clock_mhz_min"), window.get("sm_clock_mhz_max")
        clocks = f" (SM clock {low:.0f}-{high:.0f} MHz)" if low is not None and high is not None else ""
        notes.append(TimingNote(NoteKind.THROTTLED, f"the GPU held its clocks back (power or temperature){share}"
                                f"{clocks}: a rerun on a cooler or less loaded card may be faster"))
    load = record.get("load_1m_before")
    if load is not None and load > cores + LOAD_SLACK:
        notes.append(TimingNote(NoteKind.LOADED_HOST, f"1-minute load average {load:.1f} before it ran, above the "
                                f"{plural(cores, 'core')} available"))
    return not notes, notes


# ---------------------------------------------------------------------------------------------------- paired

def paired_rounds(steps: Mapping[str, Callable[[], Any]], baseline: str, budget: StepBudget,
                  clock: Callable[[], float], progress: Callable[[str], None],
                  run_round: Callable[[list[str]], Sequence[float]] | None = None
                  ) -> tuple[dict[str, list[float]], str]:
    """Time several policies interleaved: each round runs one step of every policy (`steps`: label -> a timed step,
    returning ms), the order rotated by one each round so that no policy always follows the same one; `run_round`
    (the labels of a round in order -> their step times) runs a round whole instead (an instrument's timed_round:
    on CUDA its steps back to back). Stops when every policy's per-round ratio to `baseline` has its interval within
    the budget's target, or at its limits (time_limit_s counts per policy: a round of k policies takes k steps).
    Returns the step times per label and why it stopped."""
    run_round = run_round or (lambda order: [steps[label]() for label in order])
    labels = list(steps)
    times: dict[str, list[float]] = {label: [] for label in labels}
    others = [label for label in labels if label != baseline]
    per_policy = StepBudget(budget.fixed, budget.step_limit, budget.time_limit_s * len(labels), budget.target,
                            budget.min_span_s)
    series: dict[str, list[float]] = {label: [] for label in others}  # ratios(times, label, baseline), kept up
    t0 = clock()
    while (reason := per_policy.stop_reason(list(series.values()), clock() - t0)) is None:
        r = len(times[baseline])
        progress(f"paired round {r + 1}" + (f"/{budget.fixed}" if budget.fixed else ""))
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label, ms in zip(order, run_round(order), strict=True):
            times[label].append(ms)
        for label in others:  # one ratio more per round, not every ratio again (rounds run up to --max-steps)
            series[label].append(times[label][-1] / times[baseline][-1])
    return times, reason


def ratios(times: Mapping[str, Sequence[float]], label: str, baseline: str) -> list[float]:
    """Per-round ratios of a policy's step time to the baseline's in the same round."""
    return [t / b for t, b in zip(times[label], times[baseline])]


def paired_fields(times: Mapping[str, Sequence[float]], label: str, baseline: str) -> dict[str, Any]:
    """A policy's paired-timing fields: its own step times in the rounds, and the median per-round ratio to the
    baseline with its 95% interval (the baseline's own ratio is 1 exactly)."""
    stats = Stats.of(ratios(times, label, baseline))
    return {"paired_step_ms": list(times[label]), "time_ratio": stats.median,
            "time_ratio_ci": list(stats.ci) if stats.ci else None, "time_ratio_vs": baseline}
