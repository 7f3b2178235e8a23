"""Step times that can be trusted: the median's interval, --steps auto, the stability rule, the host's load, --threads,
and policies timed paired. Every duration here comes from a fake clock: no test depends on the machine's speed."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from gcbench import timing
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.fields import DEFAULT_MAX_STEPS
from gcbench.instruments import CpuInstrument
from gcbench.paired import choose_baseline, run_paired
from gcbench.resolved import resolve
from gcbench.results.schema import NoteKind, TimingNote, note_kinds, timing_note_fields, timing_notes_of
from gcbench.results.store import read_records
from gcbench.spec import RunSpec
from tests.helpers import FakeClock
from gcbench.results.stats import Stats, median_interval
from gcbench.timing import (CHECK_EVERY_FROM, CONFIRMATIONS, MIN_SPAN_S, MIN_STEPS, StepBudget,
                            measure_until, paired_rounds, timing_verdict)

runner = CliRunner()



# ------------------------------------------------------------------------------------------------ the interval

def test_median_interval_of_uncorrelated_looking_samples_is_the_sign_test_ranks():
    assert median_interval([1, 2, 3, 4, 5]) is None  # min..max covers the median only 93.75% of the time
    assert median_interval([6, 1, 5, 2, 4, 3]) == (1, 6)  # 1 - 2 / 2**6 = 96.9%
    zigzag = [v for pair in zip(range(1, 11), range(11, 21)) for v in pair]  # 1, 11, 2, 12, ...: no run of slow steps
    assert median_interval(zigzag) == (6, 15)  # the textbook ranks for n = 20
    assert median_interval([7.0] * 6) == (7.0, 7.0)


def test_steps_that_drift_or_come_in_runs_get_a_wider_interval_or_none():
    # The same 20 values: in an order with no runs, and measured as a machine slowing down (every step slower than
    # the last: 20 steps of one trend know the median no better than a handful would).
    zigzag = [v for pair in zip(range(1, 11), range(11, 21)) for v in pair]
    assert median_interval(list(range(1, 21))) is None
    runs = [v for block in zip(range(1, 6), range(6, 11), range(11, 16), range(16, 21)) for v in block]
    runs = sorted(runs[:10]) + sorted(runs[10:])  # two runs: the first half fast, the second slow
    lo, hi = median_interval(zigzag)
    ci = median_interval(runs)
    assert ci is None or (ci[1] - ci[0]) > hi - lo


def _ar1_step_ms(rng: random.Random, n: int, rho: float) -> list[float]:
    """n step times (ms) of a series whose lag-1 autocorrelation is rho, started in its stationary state, skewed like
    step times (a slow step is slower than a fast one is fast); the true median is 100 ms. No clock is read."""
    x = rng.gauss(0.0, 1.0)
    xs = [x]
    for _ in range(n - 1):
        x = rho * x + rng.gauss(0.0, math.sqrt(1 - rho * rho))
        xs.append(x)
    return [100.0 * math.exp(0.1 * v) for v in xs]


@pytest.mark.parametrize("n", [10, 30, 100])
@pytest.mark.parametrize("rho", [0.0, 0.4, 0.8])
def test_the_median_interval_holds_its_level_on_correlated_steps(rho, n):
    # The busy CPU: consecutive steps correlated 0.2-0.8. The interval must hold the true median at 95% +-5
    # points, and (the practical test) another run's median about 83% of the time: two medians each within their
    # own 95% noise are within 1.96 / sqrt(2) standard errors of each other with probability 0.83. No interval
    # (None: too few or too correlated steps to bound the median) claims nothing and holds both; where n is large
    # enough it must be rare, so that the level is not reached by refusing to answer.
    rng = random.Random(f"{rho}-{n}")
    reps, holds, holds_other, none = 2000, 0, 0, 0
    for _ in range(reps):
        ci = median_interval(_ar1_step_ms(rng, n, rho))
        other = statistics.median(_ar1_step_ms(rng, n, rho))
        if ci is None:
            none += 1
            continue
        holds += ci[0] <= 100.0 <= ci[1]
        holds_other += ci[0] <= other <= ci[1]
    assert 0.90 <= (holds + none) / reps <= 1.0
    assert (holds_other + none) / reps >= 0.78
    if n >= 100:
        assert none / reps < 0.05


def test_stats_from_raw_samples():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0, 3.0])
    assert (s.median, s.min, s.max, s.n, s.ci) == (3.0, 1.0, 5.0, 6, (1.0, 5.0))
    assert s.rel_iqr == pytest.approx(s.iqr / 3.0)
    assert s.ci_half_width == pytest.approx(2 / 3)
    assert Stats.of([7.0]).ci is None and Stats.of([7.0]).ci_half_width is None


# ------------------------------------------------------------------------------------------------ --steps auto

def _measure(budget: StepBudget, durations) -> tuple[list[float], str, FakeClock]:
    clock = FakeClock()
    it = iter(durations)
    samples, stop = measure_until(budget, lambda: clock.spend(next(it)), clock, lambda _: None)
    return samples, stop, clock


def test_auto_runs_10_s_of_1_ms_steps_and_shows_their_interval_twice_a_second_not_every_10_steps(monkeypatch):
    """The default cap lets steps of 1 ms span the 10 s an interval needs; the progress line's interval (O(n log n)
    each) is recomputed every 10 steps up to 100, then at most every PROGRESS_EVERY_S: 10,000 steps pay ~30 of
    them, not 1,000."""
    shown = []
    real = timing._ci_text
    monkeypatch.setattr(timing, "_ci_text", lambda samples: shown.append(len(samples)) or real(samples))
    spread = [1.01 + (i % 7) * 0.01 for i in range(20_000)]
    samples, stop, _ = _measure(StepBudget(), spread)
    assert stop in ("ci", "max-time") and 9_000 < len(samples) < DEFAULT_MAX_STEPS and sum(samples) >= 10_000.0
    assert len(shown) <= 10 + 10 / timing.PROGRESS_EVERY_S + 1 and shown[-1] > 9_000


def test_fixed_steps_measure_exactly_n():
    samples, stop, _ = _measure(StepBudget(fixed=3), [10.0] * 100)
    assert (len(samples), stop) == (3, "fixed")


def test_auto_stops_once_the_median_is_known_within_2_percent():
    quiet = [100.0 + (i % 3) * 0.5 for i in range(1000)]  # spread 1%
    samples, stop, _ = _measure(StepBudget(min_span_s=0.0), quiet)
    assert stop == "ci" and len(samples) == MIN_STEPS + CONFIRMATIONS - 1  # as soon as it can know, confirmed
    assert all(_within_2_percent(samples[:n]) for n in range(MIN_STEPS, len(samples) + 1))


def test_auto_stops_no_sooner_than_its_steps_span_the_minimum_time():
    # Known within +-2% after 8 steps, but a rerun meets the machine's next spell: the steps must span MIN_SPAN_S
    # first (a shorter --max-time is the user's own, shorter span).
    quiet = [100.0 + (i % 3) * 0.5 for i in range(1000)]
    samples, stop, _ = _measure(StepBudget(time_limit_s=60.0), quiet)
    stride = max(1, len(samples) // CHECK_EVERY_FROM)
    assert stop == "ci" and MIN_SPAN_S <= sum(samples) / 1e3 < MIN_SPAN_S + stride * 0.101
    samples, stop, _ = _measure(StepBudget(time_limit_s=2.0), quiet)
    assert stop == "ci" and 2.0 <= sum(samples) / 1e3 < 2.101


def test_between_two_thousand_steps_the_interval_is_judged_at_a_stride():
    # Its O(n log n) cost between steps stays small: from 50 steps on, at every (n // 50)-th count, the newest
    # first (a failing check costs one interval).
    calls = []
    budget = StepBudget(min_span_s=0.0)
    real = Stats.of

    def counting(samples):
        calls.append(len(samples))
        return real(samples)

    noisy = [100.0 * (1 + (i * 7919 % 101) / 50) for i in range(500)]  # spread 3x: never within 2%
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing.Stats, "of", staticmethod(counting))
        for n in range(100, 501):
            budget.stop_reason([noisy[:n]], 1.0)
    assert calls == sorted(set(calls)) and 500 in calls and len(calls) < 401 / 4


def test_auto_does_not_stop_at_the_first_narrow_interval():
    # Narrow at 6 steps, then a slow step: correlated steps in a calm spell look better known than they are, so the
    # interval must stay within the target for CONFIRMATIONS step counts in a row.
    quiet = [100.0 + (i % 3) * 0.5 for i in range(100)]
    assert Stats.of(quiet[:6]).ci_half_width <= 0.02
    samples, stop, _ = _measure(StepBudget(min_span_s=0.0), quiet[:6] + [130.0] + quiet[6:])
    assert stop == "ci" and len(samples) == 12
    assert [_within_2_percent(samples[:n]) for n in range(6, 13)] == [True, False, False, False, True, True, True]


def _within_2_percent(samples) -> bool:
    half = Stats.of(samples).ci_half_width
    return half is not None and half <= 0.02


def test_auto_measures_longer_when_noisy_and_stops_at_its_budgets():
    rng = random.Random(1)
    noisy = [100.0 * rng.uniform(0.5, 2.0) for _ in range(1000)]
    samples, stop, _ = _measure(StepBudget(step_limit=40, time_limit_s=1e9), noisy)
    assert (len(samples), stop) == (40, "max-steps")
    samples, stop, clock = _measure(StepBudget(step_limit=1000, time_limit_s=3.0), noisy)
    assert stop == "max-time" and MIN_STEPS <= len(samples) < 1000
    assert sum(samples) / 1e3 == pytest.approx(clock.now - 1000.0)  # the time budget is the steps' time
    assert sum(samples[:-1]) / 1e3 < 3.0 <= sum(samples) / 1e3


def test_the_time_budget_never_cuts_below_the_minimum_steps():
    samples, stop, _ = _measure(StepBudget(time_limit_s=0.001), [50.0, 150.0] * 50)
    assert len(samples) == MIN_STEPS and stop == "max-time"


# ------------------------------------------------------------------------------------------------ the rule

def _record(step_ms, **over):
    stats = Stats.of(step_ms)
    return {"step_ms": step_ms, "step_ms_rel_iqr": stats.rel_iqr, "cpu_affinity": [0, 1], "cpus_logical": 2,
            "torch_threads": 1, "other_cpu_cores": 0.1, "load_1m_before": 0.5, **over}


def test_a_quiet_run_is_stable():
    assert timing_verdict(_record([100, 101, 99, 100, 102, 100]), "cpu") == (True, [])


def test_the_spread_limit_is_10_percent_on_cpu_and_5_on_cuda():
    seven = _record([93, 95, 100, 100, 102, 106, 107])  # IQR ~7% of the median
    assert 0.05 < seven["step_ms_rel_iqr"] < 0.10
    assert timing_verdict(seven, "cpu")[0]
    stable, notes = timing_verdict(seven, "cuda")
    assert not stable and notes[0].kind is NoteKind.SPREAD
    assert notes[0].text.startswith("step times spread ") and notes[0].text.endswith("of the median (IQR), above 5%")


def test_too_few_steps_cannot_be_judged():
    stable, notes = timing_verdict(_record([100.0, 100.0]), "cpu")
    assert not stable and notes == [TimingNote(NoteKind.FEW_STEPS, "only 2 measured steps: too few to judge the spread")]


def test_a_busy_machine_is_not_trusted_even_when_steps_agree():
    steady = [100, 101, 99, 100, 102, 100]
    stable, notes = timing_verdict(_record(steady, torch_threads=2, other_cpu_cores=0.9), "cpu")
    assert not stable and notes == [TimingNote(NoteKind.BUSY_HOST,
                                               "other processes kept 0.9 of 2 cores busy while it ran on 2")]
    # one thread on two cores leaves one free for others
    assert timing_verdict(_record(steady, torch_threads=1, other_cpu_cores=0.9), "cpu")[0]
    stable, notes = timing_verdict(_record(steady, load_1m_before=3.4), "cpu")
    assert not stable and notes[0].kind is NoteKind.LOADED_HOST
    assert "load average 3.4 before it ran, above the 2 cores" in notes[0].text


def test_host_load_counts_other_processes_cpu_time(monkeypatch):
    clock = FakeClock()
    host = iter([100.0, 103.0])  # busy seconds, all CPUs
    own = iter([10.0, 11.0])
    monkeypatch.setattr(timing.psutil, "cpu_times", lambda: SimpleNamespace(user=next(host), system=0.0))
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.5, 1.0, 1.0))

    class Process:
        def cpu_times(self):
            return SimpleNamespace(user=next(own), system=0.0)

    monkeypatch.setattr(timing.psutil, "Process", Process)
    with timing.HostLoad(clock) as load:
        clock.spend(2000.0)  # 2 s of wall time: 3 s of host CPU, 1 of them ours
    fields = load.fields(threads=1)
    assert fields["other_cpu_cores"] == pytest.approx(1.0)
    assert fields["load_1m_before"] == fields["load_1m_after"] == 1.5 and fields["torch_threads"] == 1


# ------------------------------------------------------------------------------------------------ --threads

def test_threads_default_to_all_cores_but_one_and_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "cores_available", lambda: 4)
    assert resolve(RunSpec("tiny-llama", 32, 1, device="cpu")).threads == 3
    monkeypatch.setattr(timing, "cores_available", lambda: 1)
    assert resolve(RunSpec("tiny-llama", 32, 1, device="cpu", threads="auto")).threads == 1
    before = torch.get_num_threads()
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", "--warmup", "1",
                                 "--steps", "2", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    [record] = read_records(out)
    assert record["threads"] == record["torch_threads"] == record["env"]["torch_threads"] == 1
    # two steps cannot be judged: the table marks the step time and says why
    assert re.search(r"step time \(median\)\s*│\s*~\d", result.output) and "not trusted" in result.output
    assert torch.get_num_threads() == before  # set for the run only


@pytest.mark.parametrize("args,message", [
    (["--threads", "0"], "--threads: must be an integer from 1 to 4,096"),
    (["--threads", "many"], "--threads: 'many' is neither an integer nor 'auto'"),
    (["--steps", "some"], "--steps: 'some' is neither an integer nor 'auto'"),
    (["--max-time", "0"], "--max-time: must be a number of seconds above 0"),
    (["--max-steps", "0"], "--max-steps: must be an integer from 1"),
])
def test_bad_timing_options_are_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", *args, "--out",
                                 str(out)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()


def test_steps_auto_is_the_default_and_keeps_every_sample(tmp_path, monkeypatch):
    # A fake clock for the instrument: every step "takes" 200 ms +- 1%, so auto stops once the steps span 10 s.
    clock = FakeClock()
    durations = iter([200.0, 202.0, 198.0] * 100)
    real_timed = CpuInstrument.timed

    def timed(self, step):
        real_timed(self, step)
        return clock.spend(next(durations))

    monkeypatch.setattr(CpuInstrument, "timed", timed)
    monkeypatch.setattr(CpuInstrument, "__init__", _with_clock(CpuInstrument.__init__, clock))
    spec = RunSpec("tiny-llama", 32, 1, device="cpu", warmup_steps=1)
    assert spec.measure_steps == "auto"
    from gcbench.runner import run

    record = run(spec)
    assert record["steps_stop"] == "ci" and record["step_ms"] == ([200.0, 202.0, 198.0] * 17)[:50]
    assert record["step_ms_ci"] == list(Stats.of(record["step_ms"]).ci) and record["max_steps"] == DEFAULT_MAX_STEPS
    lo, hi = record["step_ms_ci"]
    assert 198.0 <= lo <= 200.0 <= hi <= 202.0
    assert record["step_ms_median"] == 200.0 and record["step_ms_rel_iqr"] == pytest.approx(4.0 / 200, abs=1e-9)


def _with_clock(init, fake):
    def patched(self, device, memory_cap_bytes=None, *_):
        init(self, device, memory_cap_bytes, fake)
    return patched


# ------------------------------------------------------------------------------------------------ paired

def _drifting(clock: FakeClock, cost_ms: float, calls: list[str], label: str):
    """A step costing `cost_ms` on a machine that gets slower as time goes on (x1 -> x3 over the run)."""
    def step() -> float:
        calls.append(label)
        drift = 1 + (clock.now - 1000.0) / 10.0
        return clock.spend(cost_ms * drift)
    return step


def test_paired_rounds_rotate_the_order_and_cancel_the_drift():
    clock = FakeClock()
    calls: list[str] = []
    steps = {"none": _drifting(clock, 100.0, calls, "none"), "full": _drifting(clock, 130.0, calls, "full"),
             "sqrtn": _drifting(clock, 120.0, calls, "sqrtn")}
    times, stop = paired_rounds(steps, "none", StepBudget(fixed=12), clock, lambda _: None)
    assert stop == "fixed" and all(len(t) == 12 for t in times.values())
    assert calls[:9] == ["none", "full", "sqrtn", "full", "sqrtn", "none", "sqrtn", "none", "full"]
    full = timing.paired_fields(times, "full", "none")
    assert full["time_ratio"] == pytest.approx(1.30, rel=0.02) and full["time_ratio_vs"] == "none"
    lo, hi = full["time_ratio_ci"]
    assert lo <= full["time_ratio"] <= hi and hi / lo < 1.05
    assert timing.paired_fields(times, "none", "none")["time_ratio"] == 1.0
    # The same machine, the policies timed one after the other as separate runs would be: badly off.
    clock2, calls2 = FakeClock(), []
    none_ms = [_drifting(clock2, 100.0, calls2, "none")() for _ in range(12)]
    full_ms = [_drifting(clock2, 130.0, calls2, "full")() for _ in range(12)]
    assert statistics.median(full_ms) / statistics.median(none_ms) > 1.45


def test_paired_rounds_stop_when_every_ratio_is_known_within_2_percent():
    clock = FakeClock()
    steps = {"none": lambda: clock.spend(100.0), "full": lambda: clock.spend(125.0)}
    times, stop = paired_rounds(steps, "none", StepBudget(min_span_s=0.0), clock, lambda _: None)
    assert stop == "ci" and len(times["full"]) == MIN_STEPS + CONFIRMATIONS - 1


def test_the_baseline_is_none_else_the_cheapest_policy_that_ran():
    records = [{"policy": "full", "policy_options": {}, "flops": 130, "step_ms_median": 9.0},
               {"policy": "every-k", "policy_options": {"k": 2}, "flops": 115, "step_ms_median": 10.0},
               {"policy": "sqrtn", "policy_options": {}, "flops": 115, "step_ms_median": 8.0}]
    assert choose_baseline(records) == "sqrtn"  # fewest FLOPs, then fastest
    assert choose_baseline([*records, {"policy": "none", "policy_options": {}, "flops": 100,
                                       "step_ms_median": 20.0}]) == "none"


def test_run_paired_times_every_policy_on_one_model():
    specs = [RunSpec("tiny-llama", 32, 2, policy=p, device="cpu", warmup_steps=1, measure_steps=3)
             for p in ("none", "full", "every-k:k=2")]
    result = run_paired(specs, "none")
    assert set(result) == {"none", "full", "every-k:k=2"}
    assert result["none"]["time_ratio"] == 1.0 and result["none"]["time_ratio_vs"] == "none"
    assert all(r["paired_rounds"] == 3 and r["paired_stop"] == "fixed" and len(r["paired_step_ms"]) == 3
               for r in result.values())
    with pytest.raises(ValueError):
        run_paired(specs[:1], "none")


def test_a_policy_that_changes_more_than_the_block_list_is_applied_for_each_of_its_steps(monkeypatch):
    # `attn` reroutes the attention modules' config rather than wrapping blocks: each of its paired steps must run
    # with it applied, and every other policy's without it.
    from gcbench.policies.attn import RECOMPUTE_CORE_PREFIX, AttentionCore, attention_modules

    seen = []
    real_timed = CpuInstrument.timed

    def timed(self, step):
        blocks = step.model.model.layers
        seen.append(any(m.config._attn_implementation.startswith(RECOMPUTE_CORE_PREFIX)
                        for b in blocks for m in attention_modules(b)))
        return real_timed(self, step)

    monkeypatch.setattr(CpuInstrument, "timed", timed)
    specs = [resolve(RunSpec("tiny-llama", 32, 2, policy=p, device="cpu", warmup_steps=1, measure_steps=2))
             for p in ("none", "attn")]
    assert isinstance(specs[1].policy, AttentionCore)
    run_paired(specs, "none")
    assert seen == [False, True, True, False]  # rounds: none, attn; then attn, none


# ------------------------------------------------------------------------------------------------ in a sweep

CAP = "8MiB"  # tiny-llama seq 64 batch 2 (fp32, adamw): none peaks at 8.80 MiB, every-k:k=2 and full under 8 MiB


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_a_sweep_times_its_policies_paired(tmp_path):
    import gcbench

    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(model="tiny-llama", seq=64, batch=2, policy=["none", "full"], device="cpu", warmup=1,
                            steps=2, isolation="none", out=out, progress=False)
    assert [r["time_ratio_vs"] for r in records] == ["none", "none"]
    assert records[0]["time_ratio"] == 1.0 and records[1]["paired_rounds"] == 2
    assert read_records(out) == records  # appended once the pairing ended

    out2 = tmp_path / "unpaired.jsonl"
    records = gcbench.sweep(model="tiny-llama", seq=64, batch=2, policy=["none", "full"], device="cpu", warmup=1,
                            steps=2, isolation="none", out=out2, progress=False, paired=False)
    assert all("time_ratio" not in r for r in records)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_when_none_runs_out_of_memory_the_cheapest_policy_that_fits_is_the_baseline(tmp_path):
    import gcbench

    records = gcbench.sweep(model="tiny-llama", seq=64, batch=2, policy=["none", "full", "every-k:k=2"],
                            device="cpu", warmup=1, steps=2, isolation="none", memory_cap=CAP,
                            out=tmp_path / "r.jsonl", progress=False)
    by = {r["policy"]: r for r in records}
    assert by["none"]["status"] == "oom" and "time_ratio" not in by["none"]
    assert by["full"]["time_ratio_vs"] == by["every-k"]["time_ratio_vs"] == "every-k:k=2"
    assert by["every-k"]["time_ratio"] == 1.0


def test_paired_can_be_turned_off_on_the_command_line_and_in_toml(tmp_path):
    from gcbench.grid import SweepSpec

    toml = tmp_path / "g.toml"
    toml.write_text('model = "tiny-llama"\nseq = 32\nbatch = 1\npaired = false\n')
    assert SweepSpec.load(toml).paired is False
    assert SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1}).paired is True
    with pytest.raises(GcbenchError, match="expected on or off"):
        SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "paired": "maybe"})
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy",
                                 "none,full", "--device", "cpu", "--no-paired", "--dry-run", "--out",
                                 str(tmp_path / "r.jsonl")])
    assert result.exit_code == 0 and "not paired" in result.output.replace("\n", " "), result.output


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_ctrl_c_during_the_pairing_writes_the_finished_configs_unpaired(tmp_path, monkeypatch):
    import gcbench
    from gcbench.launch.inline import InProcessRunner

    def interrupted(self, specs, baseline, on_phase):
        raise KeyboardInterrupt

    monkeypatch.setattr(InProcessRunner, "paired", interrupted)
    out = tmp_path / "r.jsonl"
    with pytest.raises(KeyboardInterrupt):
        gcbench.sweep(model="tiny-llama", seq=32, batch=[1, 2], policy=["none", "full"], device="cpu", warmup=1,
                      steps=2, isolation="none", out=out, progress=False)
    stored = read_records(out)
    assert [(r["batch_size"], r["policy"]) for r in stored] == [(1, "none"), (1, "full")]
    assert all(r["status"] == "ok" and "time_ratio" not in r for r in stored)
    assert all("paired timing" in r["paired_error"] for r in stored)  # they say it is still to come
    # Running it again resumes: batch 1's configs are not run again but get their paired timing; batch 2 runs and
    # is paired.
    monkeypatch.undo()
    records = gcbench.sweep(model="tiny-llama", seq=32, batch=[1, 2], policy=["none", "full"], device="cpu",
                            warmup=1, steps=2, isolation="none", out=out, progress=False)
    assert [r.get("time_ratio_vs") for r in records] == ["none"] * 4
    assert [(r["record_id"], r["step_ms"]) for r in records[:2]] == [(r["record_id"], r["step_ms"]) for r in stored]


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_a_resumed_policy_is_paired_with_the_baseline_that_ran_before(tmp_path, monkeypatch):
    import gcbench
    from gcbench.launch.inline import InProcessRunner

    real = InProcessRunner.__call__

    def ctrl_c_at_full(self, spec, on_phase):
        if spec.policy.name == "full":
            raise KeyboardInterrupt
        return real(self, spec, on_phase)

    monkeypatch.setattr(InProcessRunner, "__call__", ctrl_c_at_full)
    out = tmp_path / "r.jsonl"
    grid = dict(model="tiny-llama", seq=32, batch=1, policy=["none", "full"], device="cpu", warmup=1, steps=2,
                isolation="none", out=out, progress=False)
    with pytest.raises(KeyboardInterrupt):
        gcbench.sweep(**grid)
    [none] = read_records(out)
    monkeypatch.undo()
    records = gcbench.sweep(**grid)
    # The record in the file keeps its measurement and gets the paired timing it was waiting for.
    assert {k: v for k, v in records[0].items() if k in none and not k.startswith(("paired", "time_ratio"))} == \
        {k: v for k, v in none.items() if not k.startswith(("paired", "time_ratio"))}
    assert [r["time_ratio_vs"] for r in records] == ["none", "none"] and records[1]["paired_rounds"] == 2
    assert read_records(out) == records


@pytest.mark.slow  # a fork server and three children
def test_a_process_sweep_pairs_in_a_child_of_its_own(tmp_path):
    import gcbench

    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(model="tiny-llama", seq=32, batch=1, policy=["none", "full"], device="cpu", warmup=1,
                            steps=3, out=out, progress=False)
    assert [r["time_ratio_vs"] for r in records] == ["none", "none"]
    assert records[0]["time_ratio"] == 1.0 and records[1]["paired_rounds"] == 3
    assert read_records(out) == records


def test_a_record_keeps_its_notes_kinds_and_older_records_are_read_by_their_texts():
    notes = [TimingNote(NoteKind.SPREAD, "step times spread 31% of the median (IQR), above 10%"),
             TimingNote(NoteKind.SIDE_BY_SIDE, "one of 2 CPU jobs side by side (--jobs): not comparable")]
    stored = json.loads(json.dumps(timing_note_fields(notes)))
    assert stored["timing_note_kinds"] == ["spread", "side-by-side"] and timing_notes_of(stored) == notes
    older = {"timing_notes": [n.text for n in notes]}  # written before timing_note_kinds existed
    assert timing_notes_of(older) == notes
    assert note_kinds(older) == ["steps spread past the limit", "CPU jobs side by side"]
    assert note_kinds({"timing_notes": ["a note of no known kind"]}) == ["a note of no known kind"]
