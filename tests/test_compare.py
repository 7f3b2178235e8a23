"""`gcbench compare` on sweeps as a busy CPU measures them: correlated steps, a machine whose load shifts between two
sweeps, CPU jobs side by side. Records are made here from a seeded model of such a machine (no clock is read), the
way a sweep writes them (timing.step_time_fields, the stability rule, paired_fields), so that no test depends on
how busy the machine running it is."""

from __future__ import annotations

import math
import random

import pytest

from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.compare import compare_results
from gcbench.launch.slots import Slot, side_by_side_fields
from gcbench.resolved import resolve
from gcbench.results.frame import results_frame
from gcbench.results.schema import NoteKind, TimingNote, new_record, timing_note_fields
from gcbench.results.store import append_record
from gcbench.spec import RunSpec
from tests.helpers import FakeClock
from gcbench.timing import StepBudget, measure_until, paired_fields, step_time_fields, timing_verdict

runner = CliRunner()

POLICIES = {"none": 1.0, "full": 1.6, "every-k:k=2": 1.3, "sqrtn": 1.45}  # step time relative to none
SHAPES = [(32, 1), (32, 2), (64, 1), (64, 2)]  # seq x batch: the smoke sweep's 16 configs
SPECS = {(seq, batch, policy): resolve(RunSpec("tiny-llama", seq, batch, policy=policy, device="cpu",
                                               threads=1)).as_record()
         for seq, batch in SHAPES for policy in POLICIES}



def _correlated(rng: random.Random, n: int, rho: float, sd: float) -> list[float]:
    """n factors around 1 (log-sd `sd`) whose lag-1 autocorrelation is rho: a busy machine's slow spells."""
    x, out = rng.gauss(0.0, 1.0), []
    for _ in range(n):
        out.append(math.exp(sd * x))
        x = rho * x + rng.gauss(0.0, math.sqrt(1 - rho * rho))
    return out


def sweep(seed: int, load: float = 1.0, slower: dict[str, float] | None = None, jobs: int = 1,
          steps: int | None = None, busy: bool = False, rho: float = 0.6) -> list[dict]:
    """A sweep's 16 records: each config in its own process (a process factor: what differs between two runs of a
    config, about +-2%; steps correlated `rho`, about +-5%, measured as --steps auto does (`steps`: a fixed count),
    on a fake clock), then each seq x batch's policies timed paired (rounds
    share the machine's state: their ratios hold still). `load` scales every time (a busier machine), `slower`
    one policy's (a real regression); `busy`: the load came from other processes, which the host's CPU times show
    (the stability rule then does not trust the timing); `jobs` > 1: CPU jobs side by side, as --jobs marks them."""
    rng = random.Random(seed)
    records = []
    for seq, batch in SHAPES:
        group, cost = [], {p: 10.0 * seq / 32 * batch * c * load * (slower or {}).get(p, 1.0)
                           for p, c in POLICIES.items()}
        for policy in POLICIES:
            process = math.exp(rng.gauss(0.0, 0.02))
            series = iter(_correlated(rng, 1000, rho, 0.05))
            clock = FakeClock()
            step_ms, stop = measure_until(StepBudget(fixed=steps), lambda: clock.spend(cost[policy] * process
                                                                                         * next(series)),
                                          clock, lambda _: None)
            r = new_record(SPECS[seq, batch, policy], **step_time_fields(step_ms, stop),
                           peak_tracked_bytes=1000 * seq * batch * (2 if policy == "none" else 1),
                           cpu_affinity=[0, 1], cpus_logical=2, torch_threads=1, other_cpu_cores=1.5 if busy else 0.1,
                           load_1m_before=0.5)
            r["tokens_per_s"] = seq * batch / (r["step_ms_median"] / 1e3)
            stable, notes = timing_verdict(r, "cpu")
            r.update(timing_stable=stable, **timing_note_fields(notes))
            if jobs > 1:
                r.update(side_by_side_fields(r, Slot(f"cpus {len(records) % jobs}", cpus=(len(records) % jobs,)),
                                             jobs))
            group.append(r)
        rounds = _correlated(rng, 30, 0.6, 0.05)
        times = {p: [cost[p] * f * math.exp(rng.gauss(0.0, 0.01)) for f in rounds] for p in POLICIES}
        for r, policy in zip(group, POLICIES):
            r.update(paired_fields(times, policy, "none"), paired_rounds=len(rounds), paired_stop="max-steps")
        records += group
    return records


def write(path, records):
    for r in records:
        append_record(path, r)
    return path


def frames(tmp_path, old, new):
    return (results_frame(gcbench.load(write(tmp_path / "old.jsonl", old))),
            results_frame(gcbench.load(write(tmp_path / "new.jsonl", new))))


def invoke(tmp_path, old, new, *options):
    a, b = write(tmp_path / "a.jsonl", old), write(tmp_path / "b.jsonl", new)
    return runner.invoke(app, ["compare", str(a), str(b), *options])


# ---------------------------------------------------------------------------------------------- the same commit

def test_two_sweeps_of_the_same_commit_under_a_load_shift_report_no_regression(tmp_path):
    # The second sweep ran while other processes kept the machine busy: every policy's time up by about 10%, most
    # past the 10% threshold. The stability rule saw the load: by time, nothing is compared (each listed, with why);
    # by ratio, all 12 ratios to none (timed paired) are, and held still.
    old, new = sweep(1), sweep(2, load=1.10, busy=True)
    result = invoke(tmp_path, old, new, "--fail", "peak:5%,time:10%")
    assert result.exit_code == 0, result.output
    assert "no regression past --fail" in result.stdout and "step times not compared (never a regression): 16" \
        in result.stdout
    # ... and the verdict says that no step time was checked, rather than passing them
    assert "(peak memory checked on 16 of 16, step time checked on 0 of 16)" in " ".join(result.stdout.split())
    assert "  timing not trusted: NEW: other processes busy:\n    seq 32 · batch 1 · every-k:k=2\n" in result.stdout
    assert len(compare_results(*frames(tmp_path, old, new), {"time": 0.10}).not_compared) == 16
    ratio = compare_results(*frames(tmp_path, old, new), {"time": 0.05}, by="ratio")
    assert ratio.regressions == [] and ratio.within_noise == [] and ratio.not_compared == []
    changes = ratio.matched["ratio_change"].dropna()  # none's own ratio is 1: nothing to compare
    assert len(changes) == 12 and changes.abs().max() < 0.03
    assert invoke(tmp_path, old, new, "--fail", "time:5%", "--by", "ratio").exit_code == 0


def test_a_load_shift_the_host_does_not_show_is_a_change_of_times_not_of_ratios(tmp_path):
    # A shift the host's CPU times do not show (a slower clock, a neighbour VM): the step times did change, which
    # only a ratio sees past. 10 steps in slow and fast spells (correlated 0.8) have no 95% interval of their
    # median: their range stands in, and only changes past it count.
    old, new = sweep(1, steps=10, rho=0.8), sweep(2, load=1.10, steps=10, rho=0.8)
    c = compare_results(*frames(tmp_path, old, new), {"time": 0.10})
    assert c.not_compared == [] and len(c.regressions) + len(c.within_noise) > 0
    assert all(float(line.split("step time +")[1].split("%")[0]) > 10 for line in c.regressions)
    assert compare_results(*frames(tmp_path, old, new), {"time": 0.05}, by="ratio").regressions == []
    old, new = sweep(1), sweep(2, load=1.10)  # 40 steps each
    assert compare_results(*frames(tmp_path, old, new), {"time": 0.10}).regressions
    assert compare_results(*frames(tmp_path, old, new), {"time": 0.05}, by="ratio").regressions == []


def test_sweeps_of_the_same_commit_with_correlated_steps_report_no_regression(tmp_path):
    # Six pairs of sweeps (`--steps 12`) of one commit on a busy CPU: steps in slow and fast spells (correlated 0.8).
    # Intervals that took the steps as independent called 6 of these 96 configs regressions past time:10%.
    regressions = []
    for pair in range(6):
        (tmp_path / str(pair)).mkdir()
        old, new = sweep(2 * pair + 1, steps=12, rho=0.8), sweep(2 * pair + 2, steps=12, rho=0.8)
        both = frames(tmp_path / str(pair), old, new)
        regressions += compare_results(*both, {"peak": 0.05, "time": 0.10}).regressions
        assert compare_results(*both, {"time": 0.05}, by="ratio").regressions == []
    assert regressions == []
    result = invoke(tmp_path, old, new, "--fail", "peak:5%,time:10%")
    assert result.exit_code == 0 and "no regression past --fail peak:5%,time:10%" in result.stdout


def test_configs_new_lacks_are_named_in_the_verdict_not_passed(tmp_path):
    old = sweep(1)
    new = [r for r in sweep(2) if r["policy"] != "full"]  # the NEW sweep lost a policy
    result = invoke(tmp_path, old, new, "--fail", "peak:5%")
    verdict = " ".join(result.stdout.split())
    assert result.exit_code == 0, result.output
    lost = len(old) - len(new)
    assert lost > 0 and f"only in OLD (not compared): {lost}" in verdict
    assert (f"in the {len(new)} config(s) of both runs (peak memory checked on {len(new)} of {len(new)}); {lost} "
            f"config(s) only in OLD not checked") in verdict


# ---------------------------------------------------------------------------------------------- a real regression

def test_a_slowed_policy_is_reported_by_time_and_by_ratio(tmp_path):
    old, new = sweep(1), sweep(2, slower={"full": 1.30})
    result = invoke(tmp_path, old, new, "--fail", "time:10%")
    assert result.exit_code == 1
    assert "4 regression(s) past --fail time:10%" in result.stdout
    lines = compare_results(*frames(tmp_path, old, new), {"time": 0.10}).regressions
    assert len(lines) == 4 and all(" · full · " in line and ": step time +" in line for line in lines)
    # By ratio, on a machine that was busier too (the timings not trusted, the paired ratios still are).
    new = sweep(2, load=1.10, busy=True, slower={"full": 1.30})
    by_ratio = invoke(tmp_path, old, new, "--fail", "time:10%", "--by", "ratio")
    assert by_ratio.exit_code == 1 and "4 regression(s)" in by_ratio.stdout
    assert by_ratio.stdout.replace("\n", "").count("step time relative to none +") == 4
    c = compare_results(*frames(tmp_path, old, new), {"time": 0.10, "tokens": 0.10}, by="ratio")
    assert len(c.regressions) == 8 and all(" · full · " in line for line in c.regressions)  # time and tokens/s
    assert all(0.27 < change < 0.33 for change in c.matched.loc[c.matched["policy_label"] == "full", "ratio_change"])


def test_a_ratio_table_shows_old_and_new_ratios(tmp_path):
    old, new = sweep(1), sweep(2, slower={"full": 1.30})
    result = invoke(tmp_path, old, new, "--by", "ratio")
    assert result.exit_code == 0  # no --fail: report only
    assert "time ratio" in result.stdout and "Δ ratio" in result.stdout and "1.00x -> 1.00x" in result.stdout
    assert "step ms" not in result.stdout


# ---------------------------------------------------------------------------------------------- not comparable

def test_cpu_jobs_side_by_side_are_listed_as_not_compared_never_as_regressions(tmp_path):
    # Two --jobs 2 sweeps: shared caches and memory bandwidth make their step times another kind of number (the
    # second sweep's neighbours were heavier: +30%). Memory is exact all the same: a peak regression still counts.
    old, new = sweep(1, jobs=2), sweep(2, load=1.30, jobs=2)
    for mode in ("time", "ratio"):
        result = invoke(tmp_path, old, new, "--fail", "peak:5%,time:10%,tokens:10%", "--by", mode)
        assert result.exit_code == 0, result.output
        assert "step times not compared (never a regression): 16" in result.stdout
        assert "  not comparable: CPU jobs side by side (OLD and NEW):\n" in result.stdout
        assert result.stdout.count("    seq ") == 16
    for r in new:
        r["peak_tracked_bytes"] = int(r["peak_tracked_bytes"] * 1.1)
    result = invoke(tmp_path, old, new, "--fail", "peak:5%,time:10%")
    assert result.exit_code == 1 and "16 regression(s)" in result.stdout
    assert result.stdout.count("peak memory +10.0%") == 16 and "step time" not in result.stdout.split("regression")[1]


def test_a_timing_either_run_does_not_trust_is_not_compared_and_says_why(tmp_path):
    old, new = sweep(1), sweep(2, slower={"full": 1.30})
    spread = TimingNote(NoteKind.SPREAD, "step times spread 31% of the median (IQR), above 10%")
    for r in new:
        if r["policy"] == "full" and r["seq_len"] == 32:
            r.update(timing_stable=False, **timing_note_fields([spread]))
    c = compare_results(*frames(tmp_path, old, new), {"time": 0.10})
    assert len(c.regressions) == 2  # the two full configs at seq 64; those at seq 32 are not trusted in NEW
    assert all(" · seq 64 · " in line and " · full · " in line for line in c.regressions)
    full = [line.split(": ", 1)[1] for line in c.not_compared if " · full · " in line]
    assert full == ["timing not trusted: NEW: steps spread past the limit"] * 2
    assert (c.matched["time_mark"] == "?").sum() == len(c.not_compared)


def test_an_unknown_by_is_one_line_and_exit_2(tmp_path):
    result = invoke(tmp_path, sweep(1), sweep(2), "--by", "speed")
    assert result.exit_code == 2
    assert "--by 'speed': expected one of time, ratio" in result.stderr and "Traceback" not in result.output


def test_configs_that_failed_in_both_runs_leave_the_verdict_complete(tmp_path):
    # a sweep records its OOMs: the same OOM in both runs has nothing to compare, and is no gap in what was checked
    from gcbench.compare import verdict

    old, new = sweep(1), sweep(2)
    for records in (old, new):
        for r in records[:2]:
            r["status"], r["error"] = "oom", "out of memory"
    c = compare_results(*frames(tmp_path, old, new), {"peak": 0.05})
    line, complete = verdict(c, {"peak": 0.05}, "peak:5%")
    assert complete and line.endswith(f"(peak memory checked on {len(old) - 2} of {len(old)}; 2 failed in both)")
    new[2]["status"] = "oom"  # ok before, out of memory now: a regression, not a config "failed in both"
    assert compare_results(*frames(tmp_path, old, new), {"peak": 0.05}).regressions


def test_a_threshold_given_twice_is_refused_not_overwritten(tmp_path):
    result = invoke(tmp_path, sweep(1), sweep(2), "--fail", "peak:5%,peak:6%")
    assert result.exit_code == 2 and "--fail 'peak:5%,peak:6%': peak given twice" in result.stderr


@pytest.mark.parametrize("options, words", [(["--fail", ""], "--fail: empty"),
                                             (["--strict"], "--strict goes with --fail")])
def test_a_gate_that_checks_nothing_is_refused(tmp_path, options, words):
    # both passed, exit 0: a CI job believed it was gating
    result = invoke(tmp_path, sweep(1), sweep(2), *options)
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""


def test_a_measurement_of_0_in_old_is_no_relative_change(tmp_path):
    # 0.00 -> 4.89 printed +inf% and failed --fail peak:5%
    old, new = sweep(1), sweep(1)
    old[0]["peak_tracked_bytes"] = 0
    c = compare_results(*frames(tmp_path, old, new), {"peak": 0.05})
    assert not c.regressions and c.matched["peak_change"].isna().sum() == 1


def test_a_doubled_step_time_of_runs_too_short_for_an_interval_is_a_regression_not_noise(tmp_path):
    # 5 steps: no 95% interval of their median exists (results/stats.py); their range stands in for it.
    old, new = sweep(1, steps=5), sweep(2, steps=5, slower={"full": 2.0})
    lines = compare_results(*frames(tmp_path, old, new), {"time": 0.10}).regressions
    assert len(lines) == 4 and all(" · full · " in line for line in lines)


def test_a_long_policy_label_leaves_the_numbers_whole_at_80_columns(tmp_path, monkeypatch):
    # a fit's plan:memory=...,allow_offload=false took 40 columns and cut every number after it with an ellipsis
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=80, record=True))
    from gcbench.units import fmt_change

    def labelled(records):
        for r in records:
            if r["policy"] == "sqrtn":
                r.update(policy="plan", policy_options={"memory": "1024TiB", "allow_offload": "false"})
            if r["policy"] == "every-k":  # a label of three parts, past 20 characters
                r.update(policy="offload", policy_options={"what": "inputs", "k": 1})
        return records

    old, new = labelled(sweep(seed=1)), labelled(sweep(seed=2, load=25.0))  # +2,400%: the widest change cells
    result = invoke(tmp_path, old, new)
    assert result.exit_code == 0, result.output
    text = cli.console.export_text()
    table = text.split("change = new / old - 1")[0]
    assert "\u2026" not in text and max(map(len, text.splitlines())) <= 80
    assert "allow_offload=false" in table and "what=inputs," in table  # a line per option
    assert "1 torch thread" in table  # the device on its own title line, whole
    c = compare_results(*frames(tmp_path, old, new), {})
    for change in c.matched["time_change"]:  # every change whole (rich cropped lines past 80 without an ellipsis)
        assert fmt_change(change) in table, fmt_change(change)
