"""The error band `estimate` shows beside a CUDA prediction (gcbench/estimators/bands.py): how it is computed from
measured errors, that the written table covers every GPU record kept in the repository, and what the user sees."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.estimators.estimates import Unavailable
from gcbench.estimators.bands import (REGIMES, Band, band_fields, band_for, bands, class_of, order_error,
                                     time_band_fields, time_band_for, time_class_of)
from gcbench.estimators.measured_bands import BANDS, ORDER_ERRORS, TIME_BANDS
from gcbench.gpus import GPUS, matching
from gcbench.report import estimate_table
from gcbench.results.band_words import TIME_PREFIX, order_note
from gcbench.fields import ATTENTION, HEADS
from gcbench.losses import LOSSES
from gcbench.optimizers import OPTIMIZERS
from gcbench.resolved import resolve
from gcbench.spec import RunSpec
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("simulate", "analytic")


def test_a_band_is_the_classes_lowest_and_highest_error_and_their_median():
    a = ("llama", "bf16", "none", "none", "simulate")
    b = ("gpt2", "bf16", "none", "none", "simulate")
    found = bands([(a, -0.4), (b, -4.97), (a, 0.6), (a, 0.1)])
    assert found == {a: Band(3, 0.4, -0.4, 0.6), b: Band(1, 4.97, -4.97, -4.97)}
    assert found[b].worst_pct == 4.97
    assert found[a].as_record() == {"measured_configs": 3, "measured_error_low_pct": -0.4,
                                    "measured_error_high_pct": 0.6}


def test_the_written_table_is_consistent():
    assert BANDS
    for (family, precision, adapter, shard, attention, loss, head, optimizer, method), (n, median, low, high) \
            in BANDS.items():
        assert method in METHODS and shard in ("none", "fsdp2:1", "fsdp2:n") and family and precision and adapter
        assert optimizer in OPTIMIZERS
        assert attention in ATTENTION and loss in LOSSES and head in HEADS
        assert n >= 1 and low <= high and 0 <= median <= max(abs(low), abs(high))


def test_an_optimizer_never_borrows_another_optimizers_band():
    """8-bit AdamW and Adafactor keep other state than AdamW: each shows the band measured under it, and where none
    was (gpt2 has AdamW records only), none."""
    def band(model, optimizer):
        return band_for(resolve(RunSpec(model, 1024, 1, optimizer=optimizer, precision="bf16", device="cpu")),
                        "simulate")

    adamw, adafactor, eight_bit = (band("llama-7b", name) for name in ("adamw", "adafactor", "adamw8bit"))
    assert adamw and adafactor and eight_bit and len({adamw, adafactor, eight_bit}) == 3
    assert band("gpt2", "adamw") is not None and band("gpt2", "adafactor") is None


def _reserved_accuracy():
    return load_script(ROOT / "benchmarks" / "reserved_accuracy.py")


def test_every_gpu_record_kept_is_in_the_table():
    """benchmarks/error_bands.py was rerun after the last GPU window: each record's class has its band, with at
    least as many configs as there are records of that class."""
    accuracy = _reserved_accuracy()
    counts: dict[tuple, int] = {}
    for folder in accuracy.gpu_folders(ROOT):
        for record in accuracy.records(folder):
            key = class_of(resolve(accuracy.spec_of(record)), "simulate")
            counts[key] = counts.get(key, 0) + 1
    assert counts, "no GPU records found"
    missing = [key for key in counts if key not in BANDS]
    assert not missing, f"rerun benchmarks/error_bands.py: no band for {missing}"
    assert all(BANDS[key][0] >= n for key, n in counts.items())


def test_the_analytic_bands_are_what_the_records_give_today():
    """A change to the formulas without rerunning benchmarks/error_bands.py leaves a stale band: the analytic
    classes (fed by the GPU records alone: the published rows it predicts carry adapters it has no formulas for)
    are re-predicted here, in milliseconds each."""
    accuracy = _reserved_accuracy()
    errors = []
    for folder in accuracy.gpu_folders(ROOT):
        for record in accuracy.records(folder):
            spec = resolve(accuracy.spec_of(record))
            try:
                predicted = estimate(spec, "analytic").peak_bytes
            except GcbenchError:
                continue
            errors.append((class_of(spec, "analytic"), 100 * (predicted / record["peak_allocated_bytes"] - 1)))
    today = bands(errors)
    assert today and {key: BANDS[key] for key in today} == {key: tuple(vars(b).values()) for key, b in today.items()}


def test_a_cuda_row_carries_its_band_and_a_cpu_row_none():
    llama = resolve(RunSpec(model="llama-7b", seq_len=512, batch_size=1, policy="full", precision="bf16",
                            device="cpu"))
    band = band_for(llama, "simulate")
    assert band is not None and band.configs >= 1
    predicted = estimate(llama, "analytic")
    assert band_fields(llama, predicted, "cuda") == band_for(llama, "analytic").as_record()
    assert band_fields(llama, predicted, "cpu") == {}
    assert band_fields(llama, Unavailable("analytic", "cuda", "why"), "cuda") == {
        "measured_configs": 0, "measured_error_low_pct": None, "measured_error_high_pct": None}  # one shape
    bert = resolve(RunSpec(model="tiny-bert", seq_len=64, batch_size=1, policy="none", device="cpu"))
    assert band_for(bert, "simulate") is None  # nothing like it measured: no borrowed band
    assert band_fields(bert, estimate(bert, "analytic"), "cuda") == {
        "measured_configs": 0, "measured_error_low_pct": None, "measured_error_high_pct": None}


def _estimate(*args: str) -> str:
    result = CliRunner().invoke(app, ["estimate", *args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_estimate_shows_the_band_in_its_table_and_json():
    table = _estimate("--model", "llama-7b", "--layers", "4", "--seq", "512", "--policy", "none,full",
                      "--method", "analytic")
    assert " err" in table and "err = the peak's lowest..highest error" in " ".join(table.split())
    assert max(len(line) for line in table.splitlines()) <= 80
    band = BANDS[("llama", "bf16", "none", "none", "sdpa", "ce", "lm", "adamw", "analytic")]
    shown = f"{band[2]:+.1f}..{band[3]:+.1f}%" if band[2] != band[3] else f"{band[2]:+.1f}%"
    assert shown in table
    row = json.loads(_estimate("--model", "tiny-bert", "--seq", "64", "--method", "analytic", "--format",
                               "json").splitlines()[0])
    assert row["measured_configs"] == 0 and row["measured_error_low_pct"] is None
    bert = _estimate("--model", "tiny-bert", "--seq", "64", "--method", "analytic")
    [row_line] = [line for line in bert.splitlines() if line.lstrip().startswith("64 ")]
    assert row_line.split()[-1] == "-"  # nothing like it measured


def test_the_band_gives_way_at_80_columns_before_the_table_overflows():
    table = _estimate("--model", "tiny-llama,tiny-gpt2", "--seq", "64", "--policy", "segments:k=2,every-k:k=2",
                      "--optimizer", "adamw,adamw-fused", "--method", "analytic")
    words = " ".join(table.split())
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "left out at this width: B/p, grads, err, in" in words  # err's range stays in a note; the phase's none
    # its range stays: over the rows with a band (llama's), saying the others have none (tiny-gpt2 under
    # adamw-fused: nothing like it measured)
    rows = [json.loads(line) for line in _estimate("--model", "tiny-llama,tiny-gpt2", "--seq", "64", "--policy",
                                                    "segments:k=2,every-k:k=2", "--optimizer", "adamw,adamw-fused",
                                                    "--method", "analytic", "--format", "json").splitlines()]
    banded = [r for r in rows if r["measured_configs"]]
    assert 0 < len(banded) < len(rows)
    low = min(r["measured_error_low_pct"] for r in banded)
    high = max(r["measured_error_high_pct"] for r in banded)
    assert (f"err: {low:+.1f}..{high:+.1f}%, the peak's error against GPU measurements of configs like these "
            f"({len(banded)} of {len(rows)} rows, the others none measured;") in words


def test_a_cpu_estimate_has_no_band():
    table = _estimate("--model", "tiny-llama", "--seq", "64", "--method", "analytic", "--device", "cpu")
    assert " err" not in table and "err =" not in table


# The step time's bands (TIME_BANDS): per card and regime, from the GPU records' median steps


def _time_accuracy():
    return load_script(ROOT / "benchmarks" / "time_accuracy.py")


def _stored_steps() -> dict[str, dict[str, float]]:
    """The committed predictions' step time per card, by config key (the file as written: a slow test,
    test_validate's made_beforehand, holds it to this code)."""
    path = ROOT / "benchmarks" / "gpu" / "predicted" / "predictions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["key"]: r.get("predicted_step_ms_by_card") or {} for r in rows}


def _unmeasured_card() -> str:
    """A card the time model has datasheet rates for and no step record of: it must show no band."""
    from gcbench.estimators.card_rates import rates_for

    measured = {key[0] for key in TIME_BANDS}
    return next(g.name for g in GPUS if g.memory_mib and g.name not in measured and not isinstance(rates_for(g), str))


def test_the_written_time_table_is_consistent():
    assert TIME_BANDS
    cards = {g.name for g in GPUS}
    for (card, regime, family, precision, adapter, shard, attention, loss, head, optimizer), (n, median, low, high) \
            in TIME_BANDS.items():
        assert card in cards and regime in REGIMES.values() and family and precision and adapter
        assert shard in ("none", "fsdp2:1", "fsdp2:n") and optimizer in OPTIMIZERS
        assert attention in ATTENTION and loss in LOSSES and head in HEADS
        assert n >= 1 and low <= high and 0 <= median <= max(abs(low), abs(high))


def test_every_gpu_records_step_time_is_in_the_time_table_and_within_its_band():
    """benchmarks/error_bands.py was rerun after the last GPU window and the last change to the time model: each
    timed record's class has a band (in one regime or the other: which one is the simulation's to say), counting
    at least its configs; and each record whose config the committed predictions hold (all but a fit's trials) has
    its error there within a band of its class."""
    accuracy, stored = _time_accuracy(), _stored_steps()
    from gcbench.estimators.stored import prediction_key
    from gcbench.results.schema import config_key

    configs: dict[tuple, set[str]] = {}
    checked = 0
    for folder in _reserved_accuracy().gpu_folders(ROOT):
        for record in accuracy.records(folder):
            card = matching(record["env"]["gpu_name"])
            assert card is not None, record["env"]["gpu_name"]
            spec = resolve(accuracy.spec_of(record))
            found = [TIME_BANDS[k] for k in (time_class_of(spec, card.name, b) for b in REGIMES) if k in TIME_BANDS]
            assert found, f"rerun benchmarks/error_bands.py: no time band for {time_class_of(spec, card.name, False)}"
            configs.setdefault(time_class_of(spec, card.name, False), set()).add(config_key(spec.as_record()))
            predicted = stored.get(prediction_key(spec.as_record(), "cuda"), {}).get(card.name)
            if predicted is not None:
                error = 100 * (predicted / record["step_ms_median"] - 1)
                assert any(low - 0.01 <= error <= high + 0.01 for _, _, low, high in found), (spec, error, found)
                checked += 1
    assert configs, "no timed GPU records found"
    for key, seen in configs.items():
        counted = sum(TIME_BANDS.get((key[0], regime, *key[2:]), (0,))[0] for regime in REGIMES.values())
        assert counted >= len(seen), key
    assert checked >= sum(len(seen) for seen in configs.values()) // 2


def test_a_step_time_has_its_band_on_its_card_in_its_regime_only():
    llama = resolve(RunSpec(model="llama-7b", seq_len=2048, batch_size=1, policy="none", precision="bf16",
                            device="cpu"))
    band = time_band_for(llama, "h200-141gb", False)
    assert band is not None and band.configs >= 1 and band.low_pct <= band.high_pct
    assert time_band_fields(llama, "h200-141gb", False) == band.as_record(TIME_PREFIX)
    empty = {"measured_time_configs": 0, "measured_time_error_low_pct": None, "measured_time_error_high_pct": None}
    assert time_band_for(llama, _unmeasured_card(), False) is None  # never borrowed from another card
    assert time_band_fields(llama, _unmeasured_card(), False) == empty
    assert time_band_for(llama, "h200-141gb", True) is None  # no host-bound llama step measured: none borrowed
    assert time_band_fields(llama, "h200-141gb", None) == empty  # no time predicted: no band (one shape)
    assert time_band_fields(None, None, None) == empty


def test_estimate_shows_the_time_band_in_json_a_column_and_a_note():
    args = ("--model", "llama-7b", "--layers", "2", "--seq", "512", "--policy", "none,full", "--method", "simulate")
    rows = [json.loads(line) for line in _estimate(*args, "--gpu", "h200-141gb", "--format", "json").splitlines()]
    spec = resolve(RunSpec(model="llama-7b", layers=2, seq_len=512, batch_size=1, policy="none",
                           precision=rows[0]["precision"], device="cpu"))
    n, _, low, high = TIME_BANDS[time_class_of(spec, "h200-141gb", False)]
    assert all(r["predicted_step_ms"] and not r["predicted_host_bound"] for r in rows)
    assert all((r["measured_time_configs"], r["measured_time_error_low_pct"], r["measured_time_error_high_pct"])
               == (n, low, high) for r in rows)
    wide = _rendered(estimate_table.estimate_table(rows, width=200), 200)
    [header] = [line for line in wide.splitlines() if line.split()[:2] == ["seq", "batch"]]
    assert "ms err" in header and f"{low:+.1f}..{high:+.1f}%" in wide
    assert "ms err = the step time's lowest..highest error" in " ".join(wide.split())
    narrow = _estimate(*args, "--gpu", "h200-141gb")
    words = " ".join(narrow.split())
    assert max(len(line) for line in narrow.splitlines()) <= 80 and "ms err =" not in words
    assert "left out at this width: ms err" in words
    assert f"ms err: {low:+.1f}..{high:+.1f}% against measured steps of configs like these on this card (neg" in words
    other = [json.loads(line) for line in _estimate(*args, "--gpu", _unmeasured_card(), "--format",
                                                    "json").splitlines()]
    assert all(r["predicted_step_ms"] and r["measured_time_configs"] == 0 for r in other)
    unknown = " ".join(_estimate(*args, "--gpu", _unmeasured_card()).split())
    assert "no step of configs like these measured on this card yet" in unknown and "ms err" not in unknown


def test_a_host_bound_step_shows_no_band_measured_on_kernel_bound_ones():
    """tiny-llama at 64 tokens waits on Python: the llama-7b records, whose kernels kept the GPU busy, say nothing
    of how far its time is off; at 80 columns a mix of rows says how many have a band."""
    rows = [json.loads(line) for line in _estimate("--model", "tiny-llama", "--seq", "64", "--method", "simulate",
                                                    "--gpu", "h200-141gb", "--format", "json").splitlines()]
    assert rows and all(r["predicted_host_bound"] and r["measured_time_configs"] == 0 for r in rows)
    args = ("--model", "llama-7b", "--layers", "2", "--seq", "512", "--optimizer", "adamw,sgd", "--method",
            "simulate", "--gpu", "h200-141gb")
    rows = [json.loads(line) for line in _estimate(*args, "--format", "json").splitlines()]
    banded = sum(1 for r in rows if r["measured_time_configs"])
    mixed = " ".join(_estimate(*args).split())
    assert banded >= 1  # adamw: the llama-7b records'
    if banded < len(rows):  # sgd: none measured (until a window measures it)
        assert f"on this card ({banded} of {len(rows)} rows, the others none measured; negative: predicted too fast" \
            in mixed


def test_estimate_fit_carries_the_time_band_of_its_card():
    """estimate --fit: each row its step time's band on the card (the same class for every policy of one setup),
    and the caption its range, or that nothing like it was measured on that card."""
    args = ("--model", "tiny-llama", "--seq", "64", "--fit", "--policy", "none,full")
    rows = [json.loads(line) for line in _estimate(*args, "--gpu", "h200-141gb", "--format", "json").splitlines()]
    spec = resolve(RunSpec(model="tiny-llama", seq_len=64, batch_size=1, policy="none", precision="bf16",
                           device="cpu"))
    n, _, low, high = TIME_BANDS[time_class_of(spec, "h200-141gb", False)]  # batch 4096: its kernels decide
    assert [r["policy"] for r in rows] == ["none", "full"] and all(r["step_s"] for r in rows)
    assert all((r["measured_time_configs"], r["measured_time_error_low_pct"], r["measured_time_error_high_pct"])
               == (n, low, high) for r in rows)
    words = " ".join(_estimate(*args, "--gpu", "h200-141gb").split())
    assert f"step s err: {low:+.1f}..{high:+.1f}% against measured steps of configs like these on this card" in words
    assert order_note("h200-141gb", order_error("h200-141gb"), ["within"]) in words  # before it names the fastest
    assert words.index("order: on h200-141gb's records") < words.index("predicted fastest:")
    other = [json.loads(line) for line in _estimate(*args, "--gpu", _unmeasured_card(), "--format",
                                                    "json").splitlines()]
    assert all(r["step_s"] and r["measured_time_configs"] == 0 for r in other)
    unmeasured = " ".join(_estimate(*args, "--gpu", _unmeasured_card()).split())
    assert "step s: no step of configs like these measured on this card yet" in unmeasured
    assert f"order: no two steps measured in one window on {_unmeasured_card()} yet say how far a predicted order " \
        "holds" in unmeasured


def test_how_far_a_predicted_order_held_is_every_pair_of_one_windows_records():
    """ORDER_ERRORS: per card, every pair of timed records of one window (one results file, one commit), within a
    class or across two (rerun benchmarks/error_bands.py after a window: the count follows the records), the
    median at most the 90th percentile."""
    accuracy = _time_accuracy()
    windows: dict[tuple[str, str], int] = {}
    for folder in _reserved_accuracy().gpu_folders(ROOT):
        for record in accuracy.records(folder):
            key = (matching(record["env"]["gpu_name"]).name, f"{folder.name}/{record['_file']} at "
                                                              f"{record['env'].get('git_sha')}")
            windows[key] = windows.get(key, 0) + 1
    pairs: dict[str, int] = {}
    for (card, _), n in windows.items():
        pairs[card] = pairs.get(card, 0) + n * (n - 1) // 2
    assert {card: sum(f[0] for f in scopes.values()) for card, scopes in ORDER_ERRORS.items()} == pairs
    assert all(set(scopes) <= {"within", "across"} and 0 <= median <= p90
               for scopes in ORDER_ERRORS.values() for _, median, p90 in scopes.values())
    assert order_error(_unmeasured_card()) is None


def _error_bands():
    return load_script(ROOT / "benchmarks" / "error_bands.py")


def test_an_order_error_is_the_ratio_of_two_ratios_whichever_comes_first_within_one_window():
    bands_script = _error_bands()
    Timed = bands_script.Timed
    a_class, b_class = ("h200-141gb", "kernel-bound", "llama"), ("h200-141gb", "kernel-bound", "gpt2")
    one = Timed(a_class, 0.0, "c1", "h200-141gb", "f at s", 10.0, 10.0)
    two = Timed(a_class, 0.0, "c2", "h200-141gb", "f at s", 20.0, 25.0)  # predicted 2x, measured 2.5x: 25% off
    other_window = Timed(a_class, 0.0, "c3", "h200-141gb", "f at t", 10.0, 99.0)
    other_class = Timed(b_class, 0.0, "c4", "h200-141gb", "f at s", 10.0, 10.0)  # against one: 0%; two: 25%
    found = bands_script.order_errors([one, two, other_window, other_class])
    assert found == {"h200-141gb": {"within": (1, 25.0, 25.0), "across": (2, 12.5, 25.0)}}
    assert bands_script.order_errors([two, one]) == {"h200-141gb": {"within": (1, 25.0, 25.0)}}


def test_a_config_measured_twice_counts_once_in_its_time_band():
    bands_script = _error_bands()
    key = ("h200-141gb", "kernel-bound", "llama")
    timed = [bands_script.Timed(key, -10.0, "c1", "h200-141gb", "f at s", 9.0, 10.0),
             bands_script.Timed(key, -30.0, "c1", "h200-141gb", "g at t", 7.0, 10.0),
             bands_script.Timed(key, -20.0, "c2", "h200-141gb", "f at s", 8.0, 10.0)]
    assert bands_script.time_bands(timed) == {key: Band(2, 20.0, -30.0, -10.0)}


def test_the_order_note_says_which_pairs_and_where_none_were_measured():
    figures = {"within": (113, 1.8, 11.4), "across": (77, 4.9, 19.0)}
    assert order_note("h200-141gb", figures, ["within"]) == (
        "order: on h200-141gb's records the predicted ratio of two steps measured in one window was off, for configs "
        "of one class (policies, sizes): a median 1.8%, over 11.4% for 1 pair in 10 (113 pairs): configs predicted "
        "less than 11.4% apart may swap when measured")
    both = order_note("h200-141gb", figures, ["within", "across"])
    assert "of two classes (optimizers, adapters, losses): a median 4.9%, over 19% for 1 pair in 10 (77 pairs)" in both
    assert both.endswith("configs predicted less than 19% apart may swap when measured")
    for empty in (None, {"across": (1, 2.0, 2.0)}):
        assert order_note("a100-80gb", empty, ["within"]) == (
            "order: no two steps measured in one window on a100-80gb yet say how far a predicted order holds there")


def test_the_plan_across_levers_says_how_far_its_order_held_on_the_card():
    plan = " ".join(_estimate("--model", "tiny-llama", "--seq", "64", "--fit", "--gpu", "h200-141gb", "--levers",
                              "optimizer").split())
    assert order_note("h200-141gb", order_error("h200-141gb"), ["within", "across"]) in plan
    assert "=N: not told apart" in plan


def test_rewriting_the_bands_leaves_the_stored_predictions_current(tmp_path):
    """benchmarks/error_bands.py rewrites measured_bands.py after each GPU window: no prediction reads it, so the
    stored predictions' digest leaves it out (and bands.py); any predictor file still moves it."""
    import shutil

    from gcbench.estimators.stored import code_digest, digest_of

    package = tmp_path / "gcbench"
    shutil.copytree(ROOT / "gcbench", package, ignore=shutil.ignore_patterns("__pycache__"))
    assert digest_of(package) == code_digest()
    for name in ("measured_bands.py", "bands.py"):
        (package / "estimators" / name).write_text("# rewritten\n")
    assert digest_of(package) == code_digest()
    (package / "estimators" / "step_time.py").write_text("# changed\n")
    assert digest_of(package) != code_digest()


def _rendered(table, width: int) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO())
    console.print(table)
    return console.file.getvalue()
