"""`gcbench fit --levers` / `estimate --fit --levers`: the plan's candidates from the one table, the ranking by
predicted tokens/s (on fake predictions, exactly), the level-by-level search within a class, an end-to-end CPU plan
verified by a real run, bad input, and tables that fit 80 columns."""

import json
from dataclasses import dataclass

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gcbench.adapters import Adapter
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.fits import lever_command, levers
from gcbench.fits.lever_command import make_plan
from gcbench.fits.levers import ADAPTERS, FULL, NOT_NEEDED, Row, lever_space, predict_plan, ranked, tier_heads
from gcbench.fits.lever_table import lever_tables
from gcbench.optimizers import OptimizerKind
from tests.helpers import assert_refused

runner = CliRunner()
TINY = {"model": ("tiny-llama",), "seq_len": (64,)}


# ----------------------------------------------------------------------------------------------- the space

def test_auto_searches_the_tables_values_less_what_is_fixed():
    searched, fixed = lever_space("auto", {"optimizer": ("adafactor",)}, "cpu")
    assert fixed == {"optimizer": "adafactor"} and "optimizer" not in searched
    assert searched["policy"] == ("none", "full", "sac")
    assert searched["adapter"] == ("none", "lora")  # qlora needs CUDA: not for a CPU target
    assert searched["loss"] == ("ce", "chunked")
    assert "compile" not in searched  # compiled blocks are not predicted: searched only where --levers names it
    assert lever_space("compile", {}, "cpu")[0]["compile"] == ("none", "blocks")
    cuda, _ = lever_space("auto", {}, "cuda")
    assert "qlora" in cuda["adapter"] and "paged_adamw8bit" in cuda["optimizer"]
    assert "paged_adamw8bit" not in lever_space("auto", {}, "cpu")[0]["optimizer"]
    # values given several times are the candidates of a lever searched
    assert lever_space("policy,optimizer", {"policy": ("none", "full")}, "cpu")[0]["policy"] == ("none", "full")


def test_candidates_are_the_product_less_fixed_and_adapters_keep_the_optimizer():
    plan = make_plan({**TINY, "optimizer": ("adafactor",)}, "policy,adapter,loss", 12 * 2**20, "cpu", None)
    assert {r.spec_fields["optimizer"] for r in plan.rows} == {"adafactor"}
    assert len(plan.rows) == 3 * 2 * 2  # policy x adapter x loss
    assert {(r.levers["policy"], r.levers["adapter"], r.levers["loss"]) for r in plan.rows} == {
        (p, a, l) for p in ("none", "full", "sac") for a in ("none", "lora") for l in ("ce", "chunked")}
    with_optimizer = make_plan(TINY, "adapter,optimizer", 12 * 2**20, "cpu", None)
    # with an adapter the optimizer is not searched: one adapter row, the optimizer's default
    lora = [r for r in with_optimizer.rows if r.levers["adapter"] != "none"]
    assert len(lora) == 1 and lora[0].spec_fields["optimizer"] == "adamw"
    assert len(with_optimizer.rows) == 1 + len(levers.lever_space("optimizer", {}, "cpu")[0]["optimizer"])


# ----------------------------------------------------------------------------------------------- the ranking

def _row(policy="none", optimizer="adamw", loss="ce", adapter="none", batch=4, peak=100, fpt=10.0) -> Row:
    lev = {"policy": policy, "optimizer": optimizer, "loss": loss, "adapter": adapter}
    row = Row(lev, {"model": "tiny-llama", "seq_len": 64, **lev}, "cuda", micro_batch=batch, peak=peak)
    row.flops_per_token = fpt
    return row


def test_ranked_by_speed_then_fewer_changes_then_batch_then_peak():
    slow = _row("full", fpt=13.0, batch=20)
    fast = _row("none", batch=3)  # no change from the defaults
    fast_big = _row("sac", batch=8)  # one change, the largest micro-batch of those
    small_peak = _row("none", "adafactor", batch=5, peak=90)
    large_peak = _row("none", "adamw8bit", batch=5, peak=95)
    two_changes = _row("sac", "adafactor", batch=20)
    adapter = _row("none", adapter="lora", fpt=7.0)
    out = _row("none", loss="chunked", fpt=1.0)
    out.reason = "batch 1 does not fit"
    order = ranked([slow, out, adapter, large_peak, two_changes, fast_big, fast, small_peak])
    assert order == [fast, fast_big, small_peak, large_peak, two_changes, slow, adapter, out]
    assert [r.group for r in order[:7]] == [FULL] * 6 + [ADAPTERS]


def test_a_chain_not_told_apart_is_one_tier_whatever_the_tie_breaks_put_first():
    # each within 3% of the next faster: 5,737 > 5,599 > 5,487 > 5,406 tokens/s is one tier; the tie-breaks put
    # the slowest first (no change), and the table numbered them 1, 2, =2, 4: row 4 faster than rows 1-3
    none, sac, full, sac8 = _row("none"), _row("sac", batch=8), _row("full"), _row("sac", "adamw8bit")
    for row, tokens in ((none, 5406), (sac, 5599), (full, 5487), (sac8, 5737)):
        row.tokens_per_s = tokens
    order = ranked([sac8, sac, full, none])
    assert order == [none, sac, full, sac8] and tier_heads(order) == [1, 1, 1, 1]
    apart = _row("none", "adafactor")
    apart.tokens_per_s = 5000  # 7.5% below the slowest of them: a tier of its own
    assert tier_heads(ranked([sac8, sac, full, none, apart])) == [1, 1, 1, 1, 5]


@dataclass
class _Found:
    value: int | None
    estimate: object
    next_peak: int | None


@dataclass
class _Est:
    peak_bytes: int
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    optimizer_paged_bytes: int | None = None  # an optimizer that pages nothing, as estimators.Estimate has it


# A fake model of memory (bytes) and FLOPs: state by optimizer, activations per sample by policy and loss.
STATE = {"adamw": 80, "adafactor": 40, "adamw8bit": 60, "paged_adamw8bit": 2}
PAGED = {"paged_adamw8bit": 50}  # in CUDA managed memory, outside the allocator's peak
PER_SAMPLE = {("none", "ce"): 30, ("none", "chunked"): 20, ("full", "ce"): 5, ("full", "chunked"): 4,
              ("sac", "ce"): 12, ("sac", "chunked"): 10}
FLOPS = {("none", "ce"): 300, ("none", "chunked"): 310, ("full", "ce"): 400, ("full", "chunked"): 410,
         ("sac", "ce"): 350, ("sac", "chunked"): 360}


def _fake(monkeypatch, budget):
    predicted = []

    def fake_fit(fields, policy, vary, search, target, tried=None, method=None, prior=None):
        optimizer, loss = fields.get("optimizer", "adamw"), fields.get("loss", "ce")
        predicted.append((policy, optimizer, loss))
        per, state = PER_SAMPLE[(policy, loss)], STATE[optimizer]
        room = search.budget - state  # the budget it is given (less a paged optimizer's state), as predict_fit
        best = min(room // per, search.hi) if room >= per else None
        return _Found(best, _Est(state + per * best) if best else None, state + per * ((best or 0) + 1))

    monkeypatch.setattr(levers, "predict_fit", fake_fit)
    monkeypatch.setattr(levers, "estimate", lambda spec, method, target: _Est(
        0, optimizer_bytes=STATE[spec.optimizer], optimizer_paged_bytes=PAGED.get(spec.optimizer)))
    monkeypatch.setattr(levers, "step_flops", lambda spec, target: FLOPS[(spec.policy.name, spec.loss)] * 64)
    return predicted


def test_plan_ranks_fitting_candidates_by_predicted_tokens_per_s(monkeypatch):
    budget = 110  # adamw: 30 bytes of room; adafactor: 70; adamw8bit: 50
    predicted = _fake(monkeypatch, budget)
    plan = make_plan({**TINY, "optimizer": ("adamw", "adafactor", "adamw8bit")}, "policy,optimizer,loss", budget,
                     "cuda", None)
    told = []
    rows = predict_plan(plan, progress=lambda d, t, w: told.append((d, t)), top=1)
    # the progress bar's total is the plan's bound, known up front; it falls to the predictions made
    assert told[0][1] >= told[-1][1] and told[-1][0] == told[-1][1] and all(d <= t for d, t in told)
    best = [r for r in rows if r.fits]
    # none fits with adamw at batch 1 (30 <= 30): the fastest class, no memory lever needed
    assert (best[0].levers["policy"], best[0].levers["optimizer"], best[0].micro_batch) == ("none", "adamw", 1)
    # no card named: no time model, ranked by FLOPs per token (the fewest first), no tokens/s claimed
    assert best[0].flops_per_token == 300 and all(r.tokens_per_s is None for r in best)
    assert [r.flops_per_token for r in best] == sorted(r.flops_per_token for r in best)
    # within a class, adding a lever to one that fits is never predicted: it would rank below
    skipped = [r for r in rows if r.reason == NOT_NEEDED]
    assert skipped and all(r.levers["optimizer"] != "adamw" or r.levers["loss"] != "ce" for r in skipped)
    assert ("none", "adafactor", "ce") not in predicted and ("none", "adamw", "chunked") not in predicted


def test_a_paged_optimizers_state_stays_on_the_card_beside_the_peak(monkeypatch):
    # paged past the budget the state moves over PCIe every step, a time the model does not predict: the plan
    # ranked such a row first (its allocator peak alone within the budget, 13.59 GiB of paged state beside it)
    _fake(monkeypatch, 100)
    plan = make_plan({**TINY, "optimizer": ("adamw", "paged_adamw8bit")}, "policy,optimizer", 100, "cuda", None)
    rows = {(r.levers["policy"], r.levers["optimizer"]): r for r in predict_plan(plan, top=1)}
    paged = rows[("none", "paged_adamw8bit")]
    # 100 - 50 paged - 2 in the allocator leaves one sample of 30 (the allocator's part alone: three)
    assert (paged.micro_batch, paged.peak, paged.paged) == (1, 32, 50) and not rows[("none", "adamw")].fits
    _fake(monkeypatch, 60)
    plan = make_plan({**TINY, "optimizer": ("paged_adamw8bit",)}, "policy", 60, "cuda", None)
    none = next(r for r in predict_plan(plan, top=1) if r.levers["policy"] == "none")
    assert not none.fits and none.reason == "batch 1 does not fit beside its paged optimizer state (50 B)"
    plan = make_plan({**TINY, "optimizer": ("paged_adamw8bit",)}, "policy", 40, "cuda", None)
    assert {r.reason for r in predict_plan(plan, top=1)} == {"model state 52 B (50 B of it paged optimizer state) "
                                                             "> budget"}


def test_on_a_card_the_plan_ranks_by_predicted_step_time_and_ties_what_it_cannot_tell_apart(monkeypatch):
    """With a card, each fitting candidate is simulated at its size and timed (estimators/step_time.py): a policy
    with more FLOPs can rank first when its larger micro-batch makes the step faster per token."""
    import numpy as np

    from gcbench.estimators import step_time as st
    from gcbench.gpus import gpu

    budget = 110
    _fake(monkeypatch, budget)

    class Timed:  # an estimate whose work takes `ms` on the card: one host-free kernel, its floor then its bytes
        def __init__(self, ms):
            items = np.zeros(1, st.WORK)
            items["kind"], items["launches"] = st.MEMORY, 1
            rates = levers_rates()
            items["bytes"] = (ms / 1e3 - rates.kernel_floor_s) * rates.bandwidth * rates.bandwidth_fraction
            self.work = st.StepWork(items)

    def levers_rates():
        from gcbench.estimators.card_rates import rates_for
        return rates_for(gpu("h100-80gb"))

    times = {("none", 1): 10.0, ("full", 6): 20.0, ("sac", 2): 10.2}  # ms at each one's micro-batch
    from gcbench.fits import ranking

    monkeypatch.setattr(ranking, "estimate", lambda spec, method, target: Timed(
        times.get((spec.policy.name, spec.batch_size), 1e3)))
    plan = make_plan(TINY, "policy", budget, "cuda", None)
    rows = [r for r in predict_plan(plan, gpu("h100-80gb")) if r.fits]
    # full: 6 x 64 tokens in 20 ms (19.2k/s) beats none's 64 in 10 ms and sac's 128 in 10.2 ms, though it
    # recomputes most
    assert [r.levers["policy"] for r in rows] == ["full", "sac", "none"]
    assert rows[0].tokens_per_s == pytest.approx(6 * 64 / 0.020, rel=1e-6) and rows[0].step_ms == pytest.approx(20)
    times[("none", 1)] = 10.2 / 2 * 1.02  # 2% below sac per token, within TIED: tied, fewer changes first
    plan = make_plan(TINY, "policy", budget, "cuda", None)
    tied_rows = [r for r in predict_plan(plan, gpu("h100-80gb")) if r.fits]
    assert levers.tied(tied_rows[1], tied_rows[2]) and [r.levers["policy"] for r in tied_rows][1:] == ["none", "sac"]


def test_memory_levers_are_tried_where_the_class_does_not_fit_without_them(monkeypatch):
    budget = 95  # adamw: 15 of room (none and sac do not fit), adafactor: 55, adamw8bit: 35
    _fake(monkeypatch, budget)
    plan = make_plan({**TINY, "optimizer": ("adamw", "adafactor", "adamw8bit")}, "policy,optimizer,loss", budget,
                     "cuda", None)
    best = [r for r in predict_plan(plan, top=1) if r.fits]
    top = best[0]
    # none needs a memory lever: adafactor (55 // 30 = 1) and adamw8bit (35 // 30 = 1) tie in speed, changes and
    # micro-batch; the smaller peak wins: adafactor's 40 + 30 against adamw8bit's 60 + 30
    assert top.levers["policy"] == "none" and top.levers["loss"] == "ce"
    assert top.levers["optimizer"] == "adafactor" and top.peak == 70
    full = next(r for r in best if r.levers["policy"] == "full")
    assert full.levers["optimizer"] == "adamw" and full.micro_batch == 3  # fits without a lever


def test_a_global_batch_is_the_largest_dividing_micro_batch_times_accumulation(monkeypatch):
    budget = 110  # none: (110 - 80) // 30 = 1; sac: 30 // 12 = 2; full: 30 // 5 = 6
    _fake(monkeypatch, budget)
    plan = make_plan(TINY, "policy,grad_accum", budget, "cuda", 16)
    rows = {r.levers["policy"]: r for r in predict_plan(plan)}
    assert [(rows[p].micro_batch, rows[p].accum) for p in ("none", "sac", "full")] == [(1, 16), (2, 8), (4, 4)]


# ----------------------------------------------------------------------------------------------- end to end

@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it (the default suite stays under 5 minutes)
def test_fit_levers_on_cpu_prints_a_ranked_plan_and_verifies_the_winner(tmp_path):
    out = tmp_path / "levers.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--memory", "12MiB", "--device",
                                 "cpu", "--levers", "policy,optimizer,loss", "--isolation", "none", "--warmup",
                                 "1", "--steps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "plan across levers · full fine-tune" in text and "x best" in text
    assert " 1  none " in text  # the fastest class fits 12 MiB without a lever
    assert "winner run for real (none, batch 3 x 1): ok" in text
    measured = next(line for line in text.splitlines() if line.startswith("peak: measured"))
    assert "(+0.0% predicted vs measured)" in measured  # the CPU simulation and analytic model are exact here
    table = text[:text.index("winner run for real")]  # then plain lines with the results file's path
    assert all(len(line) <= 80 for line in table.splitlines())
    assert out.exists()


# ----------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, message", [
    (["--levers", "policy,colour", "--memory", "12MiB"], "unknown lever 'colour'"),
    (["--levers", "policy,policy", "--memory", "12MiB"], "lever 'policy' named twice"),  # issue 48
    (["--levers", "auto,auto", "--memory", "12MiB"], "auto (every lever) stands alone"),
    (["--levers", "auto,loss", "--memory", "12MiB"], "auto (every lever) stands alone"),
    (["--levers", "policy", "--policy", "full", "--memory", "12MiB"], "--levers names policy and --policy fixes"),
    (["--levers", "auto"], "give --memory"),
    (["--levers", "policy", "--batch", "8", "--memory", "12MiB"], "add grad_accum to --levers"),
    (["--levers", "auto", "--grad-accum", "2", "--memory", "12MiB", "--batch", "8"], "give one of them"),
    # a plan searches the micro-batch: these ran their winner outside the range given, in silence
    (["--levers", "auto", "--memory", "12MiB", "--range", "1..4", "--no-paired"],
     "--range, --no-paired do not apply with --levers"),
    (["--levers", "auto", "--memory", "12MiB", "--vary", "seq"], "--vary does not apply with --levers"),
])
def test_bad_levers_input_is_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "f.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--device", "cpu", "--out",
                                 str(out), *args])
    assert_refused(result, message)
    assert not out.exists()


def test_estimate_levers_goes_with_fit_and_a_gpu():
    bad = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--levers", "auto"])
    assert bad.exit_code == 2 and "--levers goes with --fit" in bad.stderr
    bad = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--fit", "--levers", "auto"])
    assert bad.exit_code == 2 and "--gpu NAME or --gpu-memory" in bad.stderr


@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it (the default suite stays under 5 minutes)
def test_estimate_levers_for_a_gpu_by_name():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu",
                                 "rtx4090-24gb", "--levers", "policy"])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.stdout and "rtx4090-24gb" in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines())


def test_the_plan_as_json_is_a_row_per_candidate_ranked_as_the_table_with_why_the_rest_are_not():
    # --format json with --levers printed the rich table, exit 0: a script reading it failed
    from gcbench.fits.lever_table import lever_rows

    plan = make_plan(TINY, "policy,optimizer", 12 * 2**20, "cuda", None)
    for i, row in enumerate(plan.rows):
        row.micro_batch, row.peak, row.method = 2, 11 * 2**20, "simulate"
        row.tokens_per_s, row.step_ms = 1000.0 - i, 64 * 2 / (1000.0 - i) * 1e3
        if i == 1:
            row.reason = "batch 1 does not fit"
    order = ranked(plan.rows)
    rows = [json.loads(json.dumps(r, default=str)) for r in lever_rows(plan, order, "h200-141gb", "datasheet")]
    assert [r["config"] for r in rows] == [r.words() for r in order]  # one group: the table's order
    ranks = [(r["rank"], r["tier"]) for r in rows]
    assert ranks[:len(order) - 1] == [(i, 1) for i in range(1, len(order))]  # 1000, 998, ... each within 3%
    assert rows[-1]["rank"] is None and rows[-1]["not_ranked"] == "batch 1 does not fit"
    first = rows[0]
    assert (first["model"], first["seq_len"], first["target"], first["batch_size"], first["gpu"]) == \
        ("tiny-llama", 64, "cuda", 2, "h200-141gb") and "device" not in first
    assert first["predicted_tokens_per_s"] == 1000.0 and first["peak_bytes"] == 11 * 2**20


@pytest.mark.slow  # seconds on 2 cores
def test_estimate_levers_writes_json_lines_where_asked():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--fit", "--gpu-memory",
                                 "64MiB", "--levers", "policy", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows and {r["policy"] for r in rows} >= {"none", "full"} and rows[0]["rank"] == 1


def test_a_plan_needs_the_sequence_length():
    with pytest.raises(GcbenchError, match="--seq"):
        make_plan({"model": ("tiny-llama",)}, "auto", 2**20, "cpu", None)


# ----------------------------------------------------------------------------------------------- the table

def test_tables_fit_80_columns_piped():
    plan = make_plan(TINY, "auto", 12 * 2**20, "cpu", None)
    rows = []
    for i, row in enumerate(plan.rows):
        row.micro_batch, row.peak, row.flops_per_token, row.method = 1 + i, 11 * 2**20 + i, 10.0 + i, "simulate"
        if i % 3 == 0:
            row.reason = "not predicted: " + "a long reason " * 8
        rows.append(row)
    tables = lever_tables(plan, ranked(rows), ["budget 12.00 MiB (--memory 12MiB)"], None)
    assert len(tables) == 2
    for table in tables:
        console = Console(width=80, record=True)
        console.print(table)
        text = console.export_text()
        assert all(len(line) <= 80 for line in text.splitlines())
        assert " 1  " in text and "not ranked" in text  # the rows and the reasons are there, wrapped


# ----------------------------------------------------------------------------------------------- not installed

def _no_8bit(monkeypatch):
    """bitsandbytes counted as missing, whatever is installed: the 8-bit optimizers' check raises as the real one."""
    def check(self):
        if "8bit" in self.name:
            raise GcbenchError(f"--optimizer {self.name} needs bitsandbytes, which is not installed: "
                               "pip install 'gcbench[bnb]'")

    monkeypatch.setattr(OptimizerKind, "check_installed", check)


def _no_peft(monkeypatch):
    def check(self):
        if self.active:
            raise GcbenchError(f"--adapter {self.name} needs peft, which is not installed: "
                               "pip install 'gcbench[peft]'")

    monkeypatch.setattr(Adapter, "check_installed", check)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def test_a_plan_run_here_ranks_only_what_this_machine_can_run(tmp_path, monkeypatch):
    _no_8bit(monkeypatch)
    out = tmp_path / "levers.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--memory", "12MiB", "--device",
                                 "cpu", "--levers", "optimizer", "--optimizer", "adamw,adamw8bit", "--isolation",
                                 "none", "--warmup", "1", "--steps", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = _one_line(result.stdout)
    # adamw8bit fits too (ranked second without the check): left out, and said once
    assert "adamw8bit 3 x 1" not in text and " 1 defaults 3 x 1" in text
    assert text.count("not ranked: --optimizer adamw8bit needs bitsandbytes (pip install 'gcbench[bnb]')") == 1
    assert "winner run for real (defaults, batch 3 x 1): ok" in text


def test_a_prediction_only_ranks_what_is_not_installed(tmp_path, monkeypatch):
    _no_8bit(monkeypatch)
    monkeypatch.setattr(lever_command, "_cuda_here", lambda: False)  # --device cuda: predicted on this CPU
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--memory", "12MiB", "--device",
                                 "cuda", "--levers", "optimizer", "--optimizer", "adamw,adamw8bit", "--out",
                                 str(tmp_path / "f.jsonl")])
    assert result.exit_code == 0, result.output
    text = _one_line(result.stdout)
    # the same FLOPs per token (no card: no time model): not told apart from the row above
    assert " =1 adamw8bit 9 x 1" in text and "needs bitsandbytes" not in text
    assert "not verified: no GPU here" in text


def test_a_failed_winner_run_exits_1_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(lever_command, "verify", lambda *a: {"status": "error", "error": "boom\nTraceback ..."})
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--memory", "12MiB", "--device",
                                 "cpu", "--levers", "optimizer", "--optimizer", "adamw,adafactor", "--out",
                                 str(tmp_path / "f.jsonl")])
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stdout.splitlines() if "FAILED" in line]
    assert failed == ["winner run for real (defaults, batch 3 x 1) FAILED: error: boom"]


def test_nothing_runnable_is_one_line(monkeypatch):
    _no_8bit(monkeypatch)
    plan = make_plan({**TINY, "optimizer": ("adamw8bit", "paged_adamw8bit")}, "optimizer", 12 * 2**20, "cuda", None)
    with pytest.raises(GcbenchError, match="no candidate this machine can run: --optimizer adamw8bit needs"):
        lever_command.leave_out_unrunnable(plan)


def _render(renderable) -> str:
    console = Console(width=80, record=True)
    console.print(renderable)
    return console.export_text()


def _predicted(rows):
    for i, row in enumerate(rows):
        row.micro_batch, row.peak, row.flops_per_token, row.method = 1 + i, 11 * 2**20 + i, 10.0 + i, "simulate"
    return rows


def test_a_group_with_nothing_ranked_is_one_line(monkeypatch):
    _no_peft(monkeypatch)
    plan = make_plan(TINY, "policy,adapter", 12 * 2**20, "cpu", None)
    lever_command.leave_out_unrunnable(plan)
    assert {r.group for r in plan.rows} == {FULL} and len(plan.unrunnable) == 3  # lora under each policy
    shown = lever_tables(plan, ranked(_predicted(plan.rows)), ["budget 12.00 MiB"], None)
    assert len(shown) == 2
    assert _render(shown[1]).strip() == "adapters: not searched: --adapter lora needs peft (pip install " \
                                        "'gcbench[peft]')"
    # predicted, none fits: one line with the reasons, no empty table
    for row in plan.rows:
        row.reason = "batch 1 does not fit" if row.levers["policy"] == "none" else "model state 13.00 MiB > budget"
    text = _render(lever_tables(plan, ranked(plan.rows), ["budget 12.00 MiB"], None)[0])
    assert _one_line(text) == ("full fine-tune: none of 3 candidates ranked: batch 1 does not fit (1); model "
                               "state 13.00 MiB > budget (2)")


def test_the_caption_says_each_reason_whole_wrapped_at_80_columns():
    """docs/reporting.md: nothing is cropped. A reason longer than a line is wrapped, never cut with an ellipsis
    (issue 48)."""
    plan = make_plan(TINY, "policy,optimizer,loss", 12 * 2**20, "cpu", None)
    rows = _predicted(plan.rows)
    reasons = [f"not predicted: reason number {i} " + "and a long tail of words " * 5 + "END" for i in range(5)]
    for row, reason in zip(rows, reasons):  # five reasons, one candidate each: four on their own lines, one more
        row.reason = reason
    text = _render(lever_tables(plan, ranked(rows), ["budget 12.00 MiB"], None)[0])
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in text
    whole = _one_line(text)
    assert all(_one_line(reason) in whole for reason in reasons)
    assert "not ranked: 1 more candidate, 1 other reason: not predicted: reason number 4 and a long" in whole
    assert "batch 6 x 1 = micro-batch x accumulation" in whole  # said once what the batch column means (the top's)
    assert whole.count("micro-batch x accumulation") == 1
    assert whole.count("not ranked (1): ") == 4 and whole.count("not ranked: ") == 1
    # a group with nothing ranked: its one line keeps the reason whole too
    for row in rows:
        row.reason = reasons[0]
    alone = _render(lever_tables(plan, ranked(rows), ["budget 12.00 MiB"], None)[0])
    assert "…" not in alone and _one_line(reasons[0]) in _one_line(alone)
    assert all(len(line) <= 80 for line in alone.splitlines())


@pytest.mark.parametrize("given", [{"loss": ("chunked:n=0", "ce")}, {"adapter": ("lora:r=0", "qlora:bogus=1")},
                                   {"adapter": ("bogus",)}, {"policy": ("none", "every-k:k=x")}])
def test_a_bad_value_is_one_line_not_a_refused_combination(given):
    with pytest.raises(GcbenchError):
        make_plan({**TINY, **given}, "auto", 12 * 2**20, "cpu", None)


def test_a_lever_the_command_fixed_is_named_in_the_title():
    # --adapter qlora --levers auto: no row names qlora (it is no lever searched), and nothing else said it
    plan = make_plan({**TINY, "adapter": ("qlora",)}, "policy", 12 * 2**20, "cuda", None)
    for row in plan.rows:
        row.micro_batch, row.peak, row.flops_per_token, row.method = 2, 2**20, 10.0, "simulate"
    text = " ".join(_render(lever_tables(plan, ranked(plan.rows), ["budget 12.00 MiB"], None)[0]).split())
    assert "tiny-llama · seq 64 · qlora · plan across levers · adapters" in text
    plan = make_plan(TINY, "policy", 12 * 2**20, "cuda", None)  # nothing fixed: the title as it was
    for row in plan.rows:
        row.micro_batch, row.peak, row.flops_per_token, row.method = 2, 2**20, 10.0, "simulate"
    assert "tiny-llama · seq 64 · plan across levers · full fine-tune" in " ".join(
        _render(lever_tables(plan, ranked(plan.rows), ["budget 12.00 MiB"], None)[0]).split())


def test_the_help_names_what_auto_searches_and_what_only_a_name_adds():
    from gcbench.fits.space import AUTO, LEVERS

    shown = " ".join(runner.invoke(app, ["estimate", "--help"], env={"COLUMNS": "200"}).stdout.split())
    words = {"optim_in_backward": "its step", "grad_accum": "accumulation to --batch"}
    auto = shown.split("auto (")[1].split(")")[0]
    assert all(words.get(name, name) in auto for name in AUTO), auto
    assert all(name not in auto and name in shown for name in set(LEVERS) - set(AUTO)), auto
