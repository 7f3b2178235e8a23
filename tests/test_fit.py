"""`gcbench fit`, `estimate --fit` and the `plan` policy: the search's bound and exactness, the recommendation,
the plan's choice, and bad input."""

import itertools
import io
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys

import pytest
from PIL import Image
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.estimators.plan import KindCost, choose, solve
from gcbench.fits.fit import Fit, FitSpec, recommend
from gcbench.fits.search import Search, Trial, extrapolate
from gcbench.gpus import for_device, peak_flops
from gcbench.policies import parse_policy
from gcbench.report.fit_tables import recommendation_lines
from gcbench.results.frame import fit_summary, load, results_frame
from gcbench.results.schema import fit_policy
from gcbench.results.stats import Stats, told_apart
from gcbench.results.store import append_record, read_records
from gcbench.runner import run
from tests.helpers import assert_gradients_equal_none, assert_refused, tiny_spec

runner = CliRunner()
FAST = {"warmup_steps": 1, "measure_steps": 2}


# ----------------------------------------------------------------------------------------------- the search

def _search_with(true_max: int, lo: int, hi: int, guess, multiple: int = 1) -> Search:
    """A search against a memory that grows 100 bytes per size above 1000 bytes of model state."""
    search = Search(lo, hi, 1000 + 100 * true_max + 50, multiple)

    def attempt(value: int) -> Trial:
        fits = value <= true_max
        return Trial(value, fits, 1000 + 100 * value if fits else None, 1000)

    return search.run(attempt, guess)


def test_the_search_is_exact_and_within_its_bound_whatever_the_prediction():
    rng = random.Random(0)
    for _ in range(2000):
        lo, multiple = rng.randint(1, 9), rng.choice([1, 1, 4, 64])
        hi = rng.randint(lo + multiple, 5000)
        true_max = rng.randint(lo - 1, hi + 1)
        prediction = rng.choice([None, true_max, true_max + 1, true_max - 1, round(true_max * 1.05),
                                 rng.randint(-5, 9000)])
        search = _search_with(true_max, lo, hi, lambda s: extrapolate(s, prediction), multiple)
        candidates = [v for v in range(search.lo, hi + 1, multiple) if v <= true_max]
        assert search.maximum == (max(candidates) if candidates else None)
        assert len(search.trials) <= math.ceil(math.log2(search.n)) + 2 == search.bound
        if search.maximum is not None and search.next_up is not None:  # both ends tried: exact
            tried = {t.value: t.fits for t in search.trials}
            assert tried[search.maximum] is True and tried[search.next_up] is False


def test_a_right_prediction_takes_two_trials_and_one_off_three():
    for prediction, trials in ((300, 2), (301, 3), (299, 3)):
        search = _search_with(300, 1, 4096, lambda s, p=prediction: extrapolate(s, p))
        assert search.maximum == 300 and 2 <= len(search.trials) <= trials, (prediction, search.trials)
    # up to 5% low: the first trial's measured peak puts the next two on the maximum and the size after it
    search = _search_with(300, 1, 4096, lambda s: extrapolate(s, 285))
    assert search.maximum == 300 and len(search.trials) == 3
    # more than one size high, the first trials run out of memory and measure nothing: two more
    search = _search_with(300, 1, 4096, lambda s: extrapolate(s, 314))
    assert search.maximum == 300 and len(search.trials) <= 5


def test_a_prediction_far_too_high_is_given_up_after_three_failures():
    """Stepping a wrong prior down by 5% at a time would spend the whole bound; after three failures the search
    bisects until a trial runs, then extrapolates from the measured peak."""
    search = _search_with(6, 1, 4096, lambda s: extrapolate(s, 32))
    assert [t.value for t in search.trials][:3] == [32, 31, 28] and not any(t.fits for t in search.trials[:3])
    assert search.maximum == 6 and len(search.trials) <= 8


def test_the_search_refuses_memory_that_is_not_monotone():
    search = Search(1, 10, 100)
    search.add(Trial(5, False))
    with pytest.raises(ValueError, match="not monotone"):
        search.add(Trial(7, True))


# ----------------------------------------------------------------------------------------------- the plan's solver

def test_the_plan_solver_is_the_exact_optimum_of_its_linear_model():
    rng = random.Random(1)
    for _ in range(200):
        costs = [KindCost("none", 0, 0)] + [KindCost(k, rng.uniform(0, 10), rng.choice([0, rng.uniform(0, 5)]))
                                            for k in ("attn", "sac", "full")]
        n, need = rng.randint(1, 6), rng.uniform(-5, 50)
        got = solve(costs, n, need)
        brute = [dict(zip(("none", "attn", "sac", "full"), c)) for c in itertools.product(range(n + 1), repeat=4)
                 if sum(c) == n]
        by_kind = {c.kind: c for c in costs}
        feasible = [m for m in brute if sum(k * by_kind[kind].saves for kind, k in m.items()) >= need - 1e-9]
        if not feasible:
            assert got is None
            continue
        best = min(sum(k * by_kind[kind].recompute for kind, k in m.items()) for m in feasible)
        assert got is not None and sum(got.values()) == n
        assert sum(k * by_kind[kind].saves for kind, k in got.items()) >= need - 1e-6
        assert sum(k * by_kind[kind].recompute for kind, k in got.items()) == pytest.approx(best, abs=1e-6)


def test_plan_needs_a_memory_and_keeps_its_label():
    with pytest.raises(GcbenchError, match="plan needs the memory"):
        tiny_spec(policy="plan")
    assert str(parse_policy("plan:memory=1.5GiB")) == "plan:memory=1536MiB,allow_offload=false"
    with pytest.raises(GcbenchError, match="cannot read"):
        parse_policy("plan:memory=lots")


def test_plan_gradients_equal_none_with_every_kind_of_block():
    plan = parse_policy("plan:memory=64MiB,allow_offload=true").with_mix({"offload": 1, "full": 1, "sac": 1,
                                                                         "attn": 1})
    assert plan.chosen == ("offload", "full", "sac", "attn")  # tiny-llama's 4 blocks, most saving first
    assert_gradients_equal_none("tiny-llama", plan)


@pytest.mark.slow  # a run per policy
def test_plan_fits_where_none_does_not_and_recomputes_least_among_what_fits():
    shape = dict(seq_len=64, batch_size=8)
    peaks = {p: estimate(tiny_spec(policy=p, **shape), "simulate", "cpu").peak_bytes for p in ("none", "full")}
    budget = (peaks["none"] + peaks["full"]) // 2  # none does not fit, full does
    records = {p: run(tiny_spec(policy=p, memory_cap_bytes=budget, **shape, **FAST))
               for p in ("none", "full", "every-k:k=2", "sqrtn", f"plan:memory={budget}B")}
    assert records["none"]["status"] == "oom"
    plan = records[f"plan:memory={budget}B"]
    assert plan["status"] == "ok" and plan["peak_tracked_bytes"] <= budget and plan["plan_mix"]
    recompute = {p: r["flops"] - r["model_flops"] for p, r in records.items() if r["status"] == "ok"}
    assert recompute[f"plan:memory={budget}B"] < recompute["full"]
    assert all(recompute[f"plan:memory={budget}B"] <= v for v in recompute.values())


@pytest.mark.slow  # five simulations
def test_the_plan_choice_fits_its_memory_by_the_simulation():
    spec = tiny_spec(policy="plan:memory=20MiB", seq_len=64, batch_size=8)
    choice = choose(spec, "cpu")
    none = estimate(tiny_spec(seq_len=64, batch_size=8), "simulate", "cpu").peak_bytes
    assert none > 20 * 2**20 and choice.fits and choice.predicted_peak <= 20 * 2**20
    assert sum(choice.counts.values()) == spec.model_config()[0].num_hidden_layers


# ----------------------------------------------------------------------------------------------- real fits on CPU

def _fit(tmp_path, policies, **kw) -> tuple:
    spec = FitSpec({"model": "tiny-llama", "seq_len": 64, "device": "cpu", **FAST}, tuple(policies), "batch_size",
                   1, 64, memory=12 * 2**20, out=tmp_path / "fit.jsonl", isolation="none", **kw)
    fits, rec = Fit(spec).run()
    return fits, rec, read_records(spec.out)


@pytest.mark.slow  # two searches of real runs
def test_fit_finds_the_exact_maximum_per_policy_within_the_bound(tmp_path):
    fits, rec, records = _fit(tmp_path, ["none", "full"], paired=False)
    assert len(records) == sum(len(f.records) for f in fits)
    for f in fits:
        assert f.best is not None and f.best["status"] == "ok" and f.best["peak_tracked_bytes"] <= 12 * 2**20
        nxt = f.next_record
        assert nxt["batch_size"] == f.search.maximum + 1 and nxt["status"] == "oom"
        assert not nxt.get("oom_predicted")  # it ran and ran out of memory
        assert len(f.records) <= f.search.bound
        assert {r["fit_id"] for r in f.records} == {fits[0].records[0]["fit_id"]}
    by = {f.policy: f.search.maximum for f in fits}
    assert by["full"] > by["none"]
    assert rec.record is max((f.best for f in fits), key=lambda r: r["tokens_per_s"]) and not rec.paired
    assert rec.command.startswith("gcbench run --model tiny-llama --seq 64 --batch ") and "--memory-cap 12MiB" \
        in rec.command


def test_the_recommendation_is_the_best_tokens_per_s_paired_when_all_were_paired():
    a = {"tokens_per_s": 100.0, "paired_tokens_per_s": 90.0}
    b = {"tokens_per_s": 95.0, "paired_tokens_per_s": 99.0}
    assert recommend([a, b], lambda r: "cmd").record is b  # paired ranking wins
    assert recommend([a, {"tokens_per_s": 95.0}], lambda r: "cmd").record is a  # not all paired: own timing
    assert recommend([], lambda r: "cmd") is None


def winner(policy: str, batch: int, steps: list[float], paired: list[float] | None = None) -> dict:
    """A fit winner's record as the speed ranking reads it (seq 10)."""
    stats = Stats.of(steps)
    record = {"policy": policy, "policy_options": {}, "batch_size": batch, "seq_len": 10, "grad_accum": 1,
              "step_ms": steps, "step_ms_median": stats.median, "step_ms_ci": list(stats.ci) if stats.ci else None,
              "tokens_per_s": batch * 10 / (stats.median / 1e3), "peak_tracked_bytes": 1 << 20}
    if paired is not None:
        record |= {"paired_step_ms": paired,
                   "paired_tokens_per_s": batch * 10 / (statistics.median(paired) / 1e3)}
    return record


def test_a_recommendation_names_the_winners_it_cannot_be_told_apart_from():
    rng = random.Random(7)
    noisy = lambda level: [level * (1 + rng.gauss(0, 0.05)) for _ in range(40)]  # noqa: E731
    # paired: per-round ratios; none (batch 2, 20 ms) and full (batch 4, 40.4 ms) 1% apart in rounds that move
    # together (each round's drift is shared), sqrtn 20% slower
    drift = [1 + rng.gauss(0, 0.05) for _ in range(40)]
    none = winner("none", 2, noisy(20), [20 * d * (1 + rng.gauss(0, 0.002)) for d in drift])
    full = winner("full", 4, noisy(40.4), [40.4 * d * (1 + rng.gauss(0, 0.002)) for d in drift])
    sqrtn = winner("sqrtn", 4, noisy(48), [48 * d * (1 + rng.gauss(0, 0.002)) for d in drift])
    rec = recommend([full, sqrtn, none], lambda r: "cmd")
    assert rec.record is none and rec.paired and rec.tied == []  # 1% apart, told apart by their shared rounds
    assert told_apart(none, full, True) is True and told_apart(full, none, True) is False  # one way only
    # a resumed fit's earlier winner was timed in another interleaving: rounds of two pairings are not paired
    earlier, later = {**none, "fit_paired_id": "aaaa"}, {**full, "fit_paired_id": "bbbb"}
    assert not recommend([earlier, later], lambda r: "cmd").paired and told_apart(earlier, later, True) is not True
    # the same levels timed in separate runs, each +-5%: 1% is inside their noise, 20% is not
    rec = recommend([winner("none", 2, noisy(20)), full := winner("full", 4, noisy(40.4)),
                     winner("sqrtn", 4, noisy(48))], lambda r: "cmd")
    assert not rec.paired and rec.record["policy"] == "none" and rec.tied == [full]
    [line] = [x for x in recommendation_lines(rec, "batch_size") if "not told apart" in x]
    assert f"not told apart from full at seq 10 x batch 4 ({full['tokens_per_s']:,.0f} tokens/s)" in line
    # no interval (too few steps): nothing says they differ, and the recommendation says it is unsure, not tied
    few = recommend([winner("none", 2, [20.0] * 3), two := winner("full", 2, [30.0] * 3)], lambda r: "c")
    assert few.tied == [two] and few.unsure == [two] and rec.unsure == []
    lines = recommendation_lines(few, "batch_size")
    assert any(x.startswith("  unsure against full at seq 10 x batch 2") for x in lines)
    assert not any("not told apart" in x for x in lines)


def test_a_fit_table_marks_a_winner_whose_own_timing_is_not_trusted():
    from rich.console import Console

    from gcbench.fits.fit import PolicyFit
    from gcbench.report.fit_tables import fit_table

    fits = []
    for policy, stable in (("none", False), ("full", True)):
        search = Search(1, 4, 100)
        search.add(Trial(2, True))
        search.add(Trial(3, False))
        best = {**winner(policy, 2, [20.0] * 8), "status": "ok", "timing_stable": stable}
        fits.append(PolicyFit(policy, search, None, [best, {"batch_size": 3, "status": "oom"}]))
    console = Console(width=80, record=True)
    console.print(fit_table(fits, "batch_size", 1 << 20, "t"))
    text = console.export_text()
    assert " none            2    ~1,000 " in text and " full            2     1,000 " in text, text
    assert "~tokens/s = the run's own timing not trusted" in text


@pytest.mark.slow  # a fit of three policies with paired timing, in children
def test_fit_command_prints_the_table_and_the_command(tmp_path):
    out = tmp_path / "f.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--vary", "batch", "--memory",
                                 "12MiB", "--device", "cpu", "--policy", "none,full,sqrtn", "--steps", "2",
                                 "--warmup", "1", "--out", str(out), "--range", "1..32"])
    assert result.exit_code == 0, result.output
    assert "max batch" in result.stdout and "recommended:" in result.stdout and "gcbench run --model" in \
        result.stdout
    # at 80 columns: the recommendation wrapped, its later lines indented; the command whole on its line, to paste
    lines = result.stdout.splitlines()
    [command] = [line for line in lines if line.lstrip().startswith("gcbench run --model")]
    assert command.rstrip().endswith("--memory-cap 12MiB") and all(len(line) <= 80 for line in lines
                                                                   if line != command), result.stdout
    best = [r for r in read_records(out) if r.get("paired_tokens_per_s")]
    assert len(best) == 3


FIT_BAD = [
    (["--memory", "1KiB"], "below what the model needs"),
    (["--memory", "12MiB", "--vary", "layers"], "unknown --vary"),
    (["--memory", "12MiB", "--range", "9..3"], "is empty"),
    (["--memory", "12MiB", "--batch", "4"], "what --vary batch searches"),
    (["--memory", "12MiB", "--headroom", "150%"], "below 100%"),
    ([], "on CPU give --memory"),
    (["--memory", "12MiB", "--policy", "bogus"], "unknown policy"),
    # messages that named the wrong thing
    (["--memory", "12MiB", "--headroom", "5"], "a number without % is a fraction; for 5 percent write 5%"),
    (["--memory", "12MiB", "--range", "1..99999999999999999999999"], "--range '1..99999999999999999999999': --batch"),
]


@pytest.mark.parametrize("args,message", FIT_BAD)
def test_fit_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "f.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--device", "cpu", "--out",
                                 str(out), *args])
    assert_refused(result, message)
    assert not out.exists()


def test_no_recommendation_says_whether_nothing_fit_or_a_search_stopped():
    # a trial that timed out read "no policy fits the budget", under "the next batch ran out of memory"
    from types import SimpleNamespace

    from gcbench.report.fit_tables import recommendation_lines

    stopped = [SimpleNamespace(error="tiny-llama seq 32 batch 2 none: timeout"), SimpleNamespace(error=None)]
    assert recommendation_lines(None, "batch_size", stopped) == [
        "no recommendation: 1 of 2 searches stopped on a trial that neither ran nor ran out of memory (the notes "
        "say which), and no other fits"]
    assert recommendation_lines(None, "seq_len", stopped[1:]) == ["no policy fits the budget at the range's "
                                                                   "smallest seq"]


def test_estimate_fit_shows_no_next_peak_where_nothing_fits_and_says_the_smallest_s():
    # "none  -  -  32.78 GiB" read as the peak of a batch + 1 beside no batch
    from rich.console import Console

    from gcbench.report.fit_tables import predicted_fit_table

    rows = [{"policy": p, "value": v, "peak": peak, "next_peak": nxt, "step_s": None, "tokens_per_s": None,
             "method": "analytic"} for p, v, peak, nxt in (("none", None, None, 32 * 2**30), ("full", 3, 2**30, 2**31))]
    console = Console(width=100, record=True)
    console.print(predicted_fit_table(rows, "batch_size", "t", ["budget 24 GiB", "PREDICTED"]))
    text = console.export_text()
    assert re.search(r"none +- +- +- ", text) and "2.00 GiB" in text
    assert text.index("budget 24 GiB") < text.index("none: the smallest batch does not fit (32.00 GiB)") < \
        text.index("PREDICTED")


def test_estimate_fit_says_when_the_top_of_its_range_fits():
    # tiny-llama's 4096 x 32 tokens take 2.2 GiB of an H100: "largest batch predicted to fit 4096" was the search's
    # ceiling, not an answer
    args = ["estimate", "--model", "tiny-llama", "--seq", "32", "--fit", "--gpu", "h100-80gb", "--method",
            "analytic", "--policy", "none"]
    [row] = map(json.loads, runner.invoke(app, [*args, "--format", "json"]).stdout.splitlines())
    assert row["value"] == 4096 and row["range_top"] is True
    text = runner.invoke(app, args, env={"COLUMNS": "120"}).stdout
    assert "4096 (top)" in text and "batch (top) = the top of the range searched fits" in text


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_estimate_fit_predicts_per_policy_for_a_named_gpu():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu-memory",
                                 "12MiB", "--device", "cpu", "--policy", "none,full", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert rows["full"]["value"] > rows["none"]["value"] >= 1
    assert all(r["peak"] <= 12 * 2**20 < r["next_peak"] for r in rows.values())
    named = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu", "l4-24gb",
                                "--policy", "none"])
    assert named.exit_code == 0, named.output
    assert "PREDICTED" in named.stdout and "l4-24gb" in named.stdout
    bad = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--fit", "--gpu", "tpu-v9"])
    assert bad.exit_code == 2 and "unknown --gpu" in bad.stderr


# ----------------------------------------------------------------------------------------------- the report

@pytest.fixture(scope="module")
def fit_records():
    """Records as `gcbench fit` writes them, made from one real run: two budgets, three policies (plan's memory
    follows the budget), a policy where nothing fit, a search stopped by an error, a search whose maximum is the
    range's top, two searches of one budget, an older search that a newer one replaces, and a sweep's record of
    the same config as a trial."""
    base = run(tiny_spec(policy="none", seq_len=32, batch_size=1, **FAST))
    assert base["status"] == "ok"

    def trial(fit_id, budget, policy, batch, status, rate=None, paired=None, **options):
        r = {**base, "policy": policy, "policy_options": options, "batch_size": batch, "status": status,
             "fit_id": fit_id, "fit_vary": "batch_size", "fit_budget_bytes": budget, "memory_cap_bytes": budget,
             "tokens_per_s": rate}
        if paired is not None:
            r["paired_tokens_per_s"] = paired
        if policy == "plan":
            r["plan_mix"] = {"full": 1, "none": 1}
        return r if status == "ok" else {k: v for k, v in r.items() if not k.startswith(("peak_", "tokens_"))}

    mib = 2**20
    plan16 = {"memory": "16MiB", "allow_offload": "false"}
    sweep_twin = {k: v for k, v in trial("x", 8 * mib, "none", 2, "ok", 999.0).items() if not k.startswith("fit_")}
    return [
        trial("20260101-000000-aaaa", 8 * mib, "none", 9, "ok", 500.0, 500.0),  # replaced by the newer search
        trial("20260102-000000-bbbb", 8 * mib, "none", 2, "ok", 300.0, 290.0),
        trial("20260102-000000-bbbb", 8 * mib, "none", 3, "oom"),
        trial("20260102-000000-bbbb", 8 * mib, "full", 6, "oom"),
        trial("20260102-000000-bbbb", 8 * mib, "full", 5, "ok", 280.0, 310.0),  # faster paired: the best
        trial("20260102-000000-bbbb", 8 * mib, "sqrtn", 1, "oom"),  # nothing fit
        sweep_twin,  # a sweep's record of bbbb's none at batch 2: neither replaces the other
        trial("20260103-000000-cccc", 16 * mib, "none", 4, "ok", 400.0, None),
        trial("20260103-000000-cccc", 16 * mib, "none", 5, "oom"),
        trial("20260103-000000-cccc", 16 * mib, "plan", 12, "ok", 350.0, None, **plan16),
        trial("20260103-000000-cccc", 16 * mib, "plan", 14, "oom", **plan16),
        trial("20260103-000000-cccc", 16 * mib, "plan", 13, "oom", **plan16),
        trial("20260103-000000-cccc", 16 * mib, "sqrtn", 3, "ok", 900.0, None),
        trial("20260103-000000-cccc", 16 * mib, "sqrtn", 6, "error"),  # stopped: no answer, never the best
        trial("20260105-000000-eeee", 16 * mib, "full", 7, "ok", 100.0, 999.0),  # another search, range top
        trial("20260104-000000-dddd", 32 * mib, "plan", 4, "ok", 200.0, 150.0, memory="32MiB",
              allow_offload="false"),
    ]


@pytest.fixture
def fit_file(tmp_path, fit_records):
    path = tmp_path / "fit.jsonl"
    for r in fit_records:
        append_record(path, r)
    return path


def test_the_fit_summary_keeps_each_search_latest_max_next_and_best(fit_file):
    frame = results_frame(load(fit_file))
    assert len(frame[(frame["batch_size"] == 2) & (frame["policy"] == "none")]) == 2  # the trial and the sweep's
    summary = fit_summary(frame)
    rows = {(r["budget_bytes"] // 2**20, r["policy"]): r for r in summary.to_dict("records")}
    assert set(rows) == {(8, "none"), (8, "full"), (8, "sqrtn"), (16, "none"), (16, "plan"), (16, "sqrtn"),
                         (16, "full"), (32, "plan")}
    assert rows[8, "none"]["maximum"] == 2 and rows[8, "none"]["fit_id"].endswith("bbbb")  # the newer search
    assert (rows[8, "none"]["next_value"], rows[8, "none"]["next_status"]) == (3, "oom")
    assert rows[8, "full"]["maximum"] == 5 and rows[8, "full"]["best"] and not rows[8, "none"]["best"]
    assert rows[8, "full"]["rate"] == 310.0 and rows[8, "full"]["rate_paired"]  # one search, paired: full wins
    assert math.isnan(rows[8, "sqrtn"]["maximum"]) and rows[8, "sqrtn"]["next_value"] == 1  # nothing fit
    assert rows[16, "plan"]["maximum"] == 12 and rows[16, "plan"]["next_value"] == 13  # the size above the max
    assert rows[16, "plan"]["plan_mix"] == "full 1 · none 1"
    stopped = rows[16, "sqrtn"]
    assert stopped["stopped"] and math.isnan(stopped["maximum"]) and not stopped["best"]
    assert (stopped["next_value"], stopped["next_status"]) == (6, "error")
    assert rows[16, "full"]["maximum"] == 7 and math.isnan(rows[16, "full"]["next_value"])  # the range's top
    # two searches at 16 MiB: their paired timings are not one ranking, so each run's own tokens/s decides
    assert rows[16, "none"]["best"] and not rows[16, "full"]["rate_paired"] and rows[16, "full"]["rate"] == 100.0
    assert rows[32, "plan"]["maximum"] == 4 and rows[32, "plan"]["best"]  # alone at its budget


@pytest.mark.parametrize("full_ms,tied", [(49.5, True), (40.0, False)])
def test_the_fit_summary_marks_a_winner_not_told_apart_from_the_best(tmp_path, fit_records, full_ms, tied,
                                                                       monkeypatch):
    # 8 MiB: none at batch 2 and full at batch 5, timed in the same paired rounds; full's tokens/s 2.5x its step
    rng = random.Random(3)
    drift = [1 + rng.gauss(0, 0.05) for _ in range(30)]
    rounds = {"none": [20 * d * (1 + rng.gauss(0, 0.03)) for d in drift],
              "full": [full_ms * d * (1 + rng.gauss(0, 0.03)) for d in drift]}
    path = tmp_path / "fit.jsonl"
    for r in fit_records:
        if r.get("fit_id", "").endswith("bbbb") and r["status"] == "ok" and r["policy"] in rounds:
            steps = rounds[r["policy"]]
            r = {**r, "paired_step_ms": steps,
                 "paired_tokens_per_s": r["batch_size"] * r["seq_len"] / (statistics.median(steps) / 1e3)}
        append_record(path, r)
    rows = {(r["budget_bytes"] // 2**20, r["policy"]): r for r in fit_summary(results_frame(load(path))).to_dict(
        "records")}
    assert rows[8, "full"]["best"] and not rows[8, "full"]["tied"]  # 5 x 32 / 49.5 ms beats 2 x 32 / 20 ms by 1%
    assert rows[8, "none"]["tied"] is tied  # 1% in 30 rounds of 3% noise each: not told apart; 25%: told apart
    from rich.console import Console

    from gcbench import cli

    monkeypatch.setattr(cli, "console", Console(width=250))
    text = runner.invoke(app, ["report", str(path)]).output
    assert ("none (tied)" in text and "(tied) = not told apart from the best" in text) is tied


def test_fit_policy_keeps_a_plan_memory_given_apart_from_the_budget():
    record = {"policy": "plan", "fit_budget_bytes": 16 * 2**20}
    assert fit_policy({**record, "policy_options": {"memory": "16MiB", "allow_offload": "false"}}) == "plan"
    assert fit_policy({**record, "policy_options": {"memory": "8GiB", "allow_offload": "true"}}) == \
        "plan:memory=8GiB,allow_offload=true"


def test_the_report_shows_the_fit_table_and_the_frontier_figure(tmp_path, fit_file):
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", str(fit_file), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "largest batch that fits · tiny-llama" in md and "| full (best) | 5 |" in md and md.count("(best) |") == 3
    assert "none fit" in md and "3: OOM" in md and "full 1 · none 1" in md and "6: error" in md
    assert "| sqrtn | stopped |" in md and "range top" in md
    # 8 MiB's none and full: paired tokens/s without the rounds behind them: nothing to tell them apart by
    assert "| none (unsure) | 2 |" in md and "(unsure) = nothing to tell it from the best by" in md
    with Image.open(out / "figures" / "7-fit-frontier.png") as im:
        im.verify()
        assert im.size[0] > 400
    assert "Throughput at the largest fit vs memory budget" in md
    # a fit's trials are not a grid: the grid figures leave them out (here: nothing else, so not drawn)
    # the sweep's one record ran out of nothing, and the fit trials are not in that table: no "largest" to tell
    assert "Largest config that fit" not in md
    assert "5 fits of 15 trials" in md
    narrow = subprocess.run([sys.executable, "-m", "gcbench", "report", str(fit_file)], capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "80"})
    assert narrow.returncode == 0, narrow.stderr
    table = narrow.stdout[narrow.stdout.index("largest batch that fits"):]
    assert "full (best)" in table and max(map(len, narrow.stdout.splitlines())) <= 80


def test_a_fit_trial_and_a_run_of_one_config_are_each_their_own_none_baseline(tmp_path, fit_records):
    # a fit, then its --levers winner (the same config, no fit_id, here 1.2x slower) in one file: neither `none`
    # row is a ratio to the other, and the report tells them apart
    path = tmp_path / "fit.jsonl"
    for r in fit_records:
        append_record(path, r if "fit_id" in r else {**r, "step_ms_median": r["step_ms_median"] * 1.2})
    frame = results_frame(load(path))
    nones = frame[(frame["policy"] == "none") & (frame["batch_size"] == 2)]
    assert len(nones) == 2 and list(nones["time_x"]) == [1.0, 1.0] and list(nones["peak_x_none"]) == [1.0, 1.0]
    result = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "report" / "report.md").read_text()
    # marked where a table mixes the two (the 8 MiB one), not in the 16 MiB one of trials only
    assert "| 32 | 2 | none (fit) | ok |" in md and "| 32 | 2 | none | ok |" in md and "| 32 | 4 | none | ok |" in md
    assert "(fit) = a trial of a `gcbench fit` search" in md


def test_a_report_without_fits_has_no_fit_table_or_figure(tmp_path):
    record = run(tiny_spec(policy="none", seq_len=32, batch_size=1, **FAST))
    append_record(tmp_path / "r.jsonl", record)
    result = runner.invoke(app, ["report", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert "gcbench fit" not in (tmp_path / "rep" / "report.md").read_text()
    assert not (tmp_path / "rep" / "figures" / "7-fit-frontier.png").exists()


def test_the_gpu_table_names_a_device_only_when_its_memory_is_that_entrys():
    h100 = for_device("NVIDIA H100 80GB HBM3", 81_559 * 2**20)
    assert h100 is not None and h100.name == "h100-80gb"
    assert for_device("NVIDIA A100 80GB PCIe", 81_920 * 2**20) is None  # "A100" alone is the 40 GB entry
    assert for_device("NVIDIA GH200 480GB", 97_871 * 2**20) is None  # not the H200 entry, whose name it contains
    assert peak_flops("NVIDIA GH200 480GB") == 989e12


def test_estimate_fit_json_rows_each_name_their_setup_and_the_size_found():
    # the rows carried policy and value alone: two setups' outputs in one file could not be told apart
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu-memory", "64MiB",
                                 "--policy", "none,full", "--optimizer", "adafactor", "--method", "analytic",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in rows] == ["none", "full"]
    for r in rows:
        assert (r["model"], r["seq_len"], r["optimizer"], r["vary"]) == ("tiny-llama", 64, "adafactor", "batch_size")
        assert r["batch_size"] == r["value"] and r["value"] >= 1


def test_estimate_fit_where_nothing_fits_says_what_may():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu-memory", "1MiB",
                                 "--policy", "none,full", "--method", "analytic"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert "nothing fits: an adapter (--adapter lora, qlora), a lighter optimizer (--optimizer adamw8bit, " \
           "adafactor) or a shorter --seq may; --levers auto searches them" in said
    assert "peaks are max_memory_allocated" not in said  # no size found: nothing for the allocator to undo
    # what was given is not suggested again; qlora and adamw8bit are CUDA's
    given = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu-memory", "1MiB",
                                "--policy", "none", "--method", "analytic", "--optimizer", "adafactor",
                                "--device", "cpu"])
    said = " ".join(given.stdout.split())
    assert "nothing fits: an adapter (--adapter lora) or a shorter --seq may; --levers auto searches them" in said


def test_a_predicted_fit_tables_title_stays_whole_where_the_terminal_has_room():
    # a 64-column table wrapped its longer title at 80 columns: "· seq" / "4096"
    from rich.console import Console

    from gcbench.report.fit_tables import predicted_fit_table

    rows = [{"policy": "full", "value": 8, "peak": 2**30, "next_peak": 2**31, "step_s": 2.0, "tokens_per_s": 16384,
             "method": "analytic", "range_top": False}]
    title = "configs/mistral-nemo-12b.json · largest batch predicted to fit · seq 4096"
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(predicted_fit_table(rows, "batch_size", title, ["budget"]))
    assert console.export_text().splitlines()[0].strip() == title
