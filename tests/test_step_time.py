"""The step-time model (estimators/step_time.py, step_clock.py, card_rates.py): what the clock writes down for an op,
how the work is played on a card, what the simulated step's work holds for each lever, and the calibration's
derivation of card rates. Exact and device-free: synthetic items and rates, CPU fakes, the fake GPU."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gcbench.estimators import estimate
from gcbench.estimators import step_time as st
from gcbench.estimators.card_rates import Rates, rates_for
from gcbench.estimators.step_clock import StepClock, _multi_tensor_launches
from gcbench.gpus import GPUS, gpu
from gcbench.spec import RunSpec
from tests.helpers import estimate_rows, load_script

ROOT = Path(__file__).resolve().parent.parent


def rates(**changes) -> Rates:
    """Round numbers: 100 TFLOP/s, 1 TB/s, 10 SMs, fractions 1, no floor, 10 us per op on the host."""
    base = Rates(card="test", tensor_flops=100e12, fp32_flops=10e12, bandwidth=1e12, sms=10, host_link=10e9,
                 interconnect=100e9, gemm_fraction=1.0, pipeline_k=0.0, fp32_pipeline_k=0.0,
                 bandwidth_fraction=1.0,
                 flash_fraction=(0.5, 0.25), efficient_fraction=(0.5, 0.25), cudnn_fraction=(0.5, 0.25),
                 dequant_fraction=0.5, optimizer_8bit_fraction=0.5, kernel_floor_s=0.0,
                 host_op_s=(10e-6, 10e-6, 10e-6), host_launch_s=0.0, host_mode_s=0.0, host_library_s=0.0,
                 basis="test rates")
    return dataclasses.replace(base, **changes)


def items(*rows: dict) -> np.ndarray:
    """WORK items from dicts (missing fields 0; one host op and one launch each unless given)."""
    out = np.zeros(len(rows), st.WORK)
    for i, row in enumerate(rows):
        out[i]["host_forward"], out[i]["launches"] = 1, 1
        for key, value in row.items():
            out[i][key] = value
    return out


def test_a_device_bound_step_takes_its_kernels_time_and_a_host_bound_one_its_issuing():
    r = rates()
    device_bound = items(*[{"kind": st.MEMORY, "bytes": 1e9}] * 3)  # 1 ms each at 1 TB/s
    played = st._play(device_bound, r)
    assert played.step_ms == pytest.approx(0.010 + 3.0)  # waits for the first issue only
    host_bound = items(*[{"kind": st.MEMORY, "bytes": 1e3}] * 100)  # 1 ns each, 10 us to issue
    played = st._play(host_bound, r)
    assert played.step_ms == pytest.approx(100 * 0.010 + 1e-6, rel=1e-6) and played.host_bound


def test_a_value_read_back_makes_the_host_wait_and_collectives_overlap_compute():
    r = rates()
    work = items({"kind": st.MEMORY, "bytes": 1e9}, {"kind": st.SYNC, "launches": 0},
                 {"kind": st.MEMORY, "bytes": 1e3})
    # the host waits 1 ms for the device, then issues the last op (10 us)
    assert st._play(work, r).step_ms == pytest.approx(0.010 + 1.0 + 0.010 + 1e-6, rel=1e-6)
    overlapped = items({"kind": st.COLLECTIVE, "bytes": 100e6}, {"kind": st.GEMM, "flops": 100e9, "m": 1280,
                                                                   "n": 1280, "k": 4096, "batch": 1})  # 10 waves
    # 1 ms on the interconnect beside 1 ms of matmul: together, not one after the other
    assert st._play(overlapped, r).step_ms == pytest.approx(1.020, rel=1e-3)
    waiting = items({"kind": st.COLLECTIVE, "bytes": 100e6}, {"kind": st.MEMORY, "bytes": 1e9, "waits": 1})
    assert st._play(waiting, r).step_ms == pytest.approx(0.010 + 1.0 + 1.0, rel=1e-3)


def test_a_matmul_pays_for_a_partly_filled_last_wave_and_a_short_k():
    r = rates()
    full = items({"kind": st.GEMM, "flops": 1e12, "m": 128 * 10, "n": 128, "k": 4096, "batch": 1})  # 10 tiles
    partial = items({"kind": st.GEMM, "flops": 1e12, "m": 128 * 11, "n": 128, "k": 4096, "batch": 1})  # 11: 2 waves
    assert st._device_seconds(full, r)[0] == pytest.approx(0.01)
    assert st._device_seconds(partial, r)[0] == pytest.approx(0.01 * 20 / 11)
    # a matmul's time is never under the floor, and holds it inside (its fraction was read off whole kernels)
    assert st._device_seconds(full, dataclasses.replace(r, kernel_floor_s=1e-3))[0] == pytest.approx(0.01)
    assert st._device_seconds(full, dataclasses.replace(r, kernel_floor_s=0.05))[0] == pytest.approx(0.05)
    short_k = dataclasses.replace(r, pipeline_k=256.0, fp32_pipeline_k=16.0)
    assert st._device_seconds(full, short_k)[0] == pytest.approx(0.01 * (4096 + 256) / 4096)
    # an fp32 matmul runs on the SIMT cores: its own, shallower pipeline (at a tenth of the rate: 10 TFLOP/s)
    simt = full.copy()
    simt["dtype"] = st.FP32
    assert st._device_seconds(simt, short_k)[0] == pytest.approx(0.1 * (4096 + 16) / 4096)
    assert st._device_seconds(simt, r)[0] == pytest.approx(0.1)


def test_a_streaming_kernel_pays_the_floor_and_then_its_bytes():
    r = rates(kernel_floor_s=3e-6)
    work = items({"kind": st.MEMORY, "bytes": 1e9}, {"kind": st.MEMORY, "bytes": 1e3, "launches": 4},
                 {"kind": st.DEQUANT, "bytes": 1e9}, {"kind": st.OPTIMIZER_8BIT, "bytes": 1e9})
    # 1 ms of bytes at 1 TB/s after 3 us; a tiny one 4 floors; bitsandbytes' kernels at half the bandwidth
    assert list(st._device_seconds(work, r)) == pytest.approx([1e-3 + 3e-6, 1e-9 + 12e-6, 2e-3 + 3e-6, 2e-3 + 3e-6])


def test_the_clock_counts_flops_and_bytes_as_the_card_moves_them():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    grads = [torch.zeros(70000), torch.zeros(10)]
    clock = StepClock()
    with clock:
        torch.mm(a, b)
        a.t().contiguous()  # a view (nothing), then a copy
        a.add_(1.0)  # read and written
        grads[0].zero_()  # written only
        a.size(0)  # metadata: not even a host op
    work = clock.work().items
    assert list(work["kind"]) == [st.GEMM, st.MEMORY, st.MEMORY, st.MEMORY]
    assert work[0]["flops"] == 2 * 64 * 32 * 16 and work[0]["bytes"] == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert work[1]["bytes"] == 2 * 4 * 64 * 32 and work[1]["host_forward"] == 2  # the view's host op rides along
    assert work[2]["bytes"] == 2 * 4 * 64 * 32 and work[3]["bytes"] == 4 * 70000


def test_a_multi_tensor_op_launches_a_kernel_per_packed_chunk_of_tensors():
    small = [torch.zeros(4)] * 600
    assert _multi_tensor_launches((small,), None) == 3  # 256 tensors per launch: 256 + 256 + 88
    big = [torch.zeros(65536 * 6000)]
    assert _multi_tensor_launches((big, big), None) == 2  # depth 2: 4863 chunks of 65536 per launch, 6000 chunks


def simulated(**fields):
    spec = RunSpec(model="tiny-llama", seq_len=64, batch_size=2, device="cpu", precision="bf16", **fields)
    return estimate(spec, "simulate", "cuda").work.items


def test_recompute_is_issued_by_python_and_adds_the_forward_matmuls_to_the_backward():
    none, full = simulated(policy="none"), simulated(policy="full")
    gemms = lambda w, phase: w[(w["kind"] == st.GEMM) & (w["phase"] == phase)]  # noqa: E731
    recomputed = gemms(full, 1)[gemms(full, 1)["issuer"] == 0]
    # each of the 4 blocks' matmuls again, but its last (torch stops recomputing once backward has what it saved)
    assert len(recomputed) == len(gemms(none, 0)) - 4 - 1 == len(gemms(full, 1)) - len(gemms(none, 1))
    assert not ((none["phase"] == 1) & (none["issuer"] == 0)).any()
    assert full["host_forward"][full["phase"] == 1].sum() > 0 == none["host_forward"][none["phase"] == 1].sum()


def test_selective_checkpointing_costs_host_time_per_op_and_adamw_step_counts_launch_nothing():
    sac, none = simulated(policy="sac"), simulated(policy="none")
    assert sac["modes"].sum() > 0 and none["modes"].sum() == 0
    optimizer = none[none["phase"] == 2]
    # AdamW's step counts live on the host on CUDA: their foreach add launches nothing; the rest is multi-tensor
    assert len(optimizer) == 9 and optimizer["launches"].min() >= 1
    fused = simulated(policy="none", optimizer="adamw-fused")
    assert (fused["phase"] == 2).sum() == 2  # the step counts, on the device when fused, then one fused kernel


@pytest.mark.slow
def test_offload_copies_over_the_host_link_and_qlora_dequantises_its_weights():
    offload = simulated(policy="offload")
    assert (offload["kind"] == st.HOST_COPY).sum() > 0
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    qlora = simulated(policy="none", adapter="qlora")
    assert (qlora["kind"] == st.DEQUANT).sum() > 0


@pytest.mark.slow
def test_a_long_model_made_from_two_short_ones_takes_the_whole_ones_time(tmp_path):
    from tests.families import config_with_blocks

    from gcbench.estimators import simulate as sim
    from gcbench.estimators.layer_scaling import FEWEST, StepTrace
    from gcbench.resolved import resolve

    # one block past the shipped threshold (FEWEST), well beyond the short ones (3, 4) on their line
    spec = resolve(RunSpec(model=config_with_blocks(tmp_path, "llama", FEWEST + 1), seq_len=32, batch_size=2,
                           policy="full", device="cpu"))
    scaled = sim._simulate(spec, "cuda", True, True)
    whole = sim._simulate(spec, "cuda", True, True, trace=StepTrace())
    assert scaled.work.scaled_from is not None and whole.work.scaled_from is None
    for card in ("h200-141gb", "a100-80gb"):
        r = rates_for(gpu(card))
        assert scaled.work.time(r).step_ms == pytest.approx(whole.work.time(r).step_ms, rel=0.01)
    assert scaled.work.kernels == whole.work.kernels


def test_estimate_rows_carry_the_time_on_a_named_card_and_say_why_not_elsewhere(capsys):
    from gcbench.cli import app
    from typer.testing import CliRunner

    args = ["estimate", "--model", "tiny-llama", "--seq", "64", "--policy", "none,full", "--format", "json"]
    result = CliRunner().invoke(app, [*args, "--gpu", "h100-80gb"])
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    simulated_rows = [r for r in rows if r["method"] == "simulate"]
    assert all(r["predicted_step_ms"] > 0 and r["predicted_tokens_per_s"] == pytest.approx(
        1 * 64 * 1e3 / r["predicted_step_ms"]) and "h100-80gb" in r["time_basis"] for r in simulated_rows)
    # the analytic rows take the simulation's time for the same config
    assert [r["predicted_step_ms"] for r in rows if r["method"] == "analytic"] == \
        [r["predicted_step_ms"] for r in simulated_rows]
    result = CliRunner().invoke(app, args)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(r["predicted_step_ms"] is None and "--gpu" in r["time_not_available"] for r in rows)


def test_a_prediction_made_next_to_a_gpu_is_the_one_made_on_a_cpu_machine(request):
    """The predictions validate commits are made on a CPU machine and read beside the GPU: the simulation's fakes
    are CPU tensors on both, so an offloaded copy (save_on_cpu's `.cpu()`) is the same op, and so is its time."""
    from gcbench.estimators import sharing

    args = ("--model", "tiny-llama", "--seq", "64", "--policy", "offload,offload:what=all", "--method", "simulate",
            "--gpu", "h100-80gb")
    fields = ("predicted_step_ms", "peak_bytes")
    on_a_cpu_machine = [[r[f] for f in fields] for r in estimate_rows(*args)]
    sharing.forget()
    request.getfixturevalue("fake_cuda")
    assert [[r[f] for f in fields] for r in estimate_rows(*args)] == on_a_cpu_machine


def test_a_card_without_datasheet_figures_has_no_time_and_says_which_are_missing():
    card = dataclasses.replace(gpu("l4-24gb"), bandwidth=None)
    work = st.StepWork(items({"kind": st.MEMORY, "bytes": 1e6}))
    fields = st.time_fields(work, 128, card)
    assert fields["predicted_step_ms"] is None and "bandwidth" in fields["time_not_available"]
    assert all(not isinstance(rates_for(g), str) for g in GPUS)  # every card gcbench knows has its figures


def test_a_calibration_replaces_the_assumed_rates_and_says_so(monkeypatch):
    import gcbench.estimators.calibrated as calibrated

    monkeypatch.setitem(calibrated.CALIBRATED, "h200-141gb", {"source": "results/x.jsonl, 2026-01-01",
                                                             "rates": {"gemm_fraction": 0.7,
                                                                       "flash_fraction": [0.4, 0.3]}})
    r = rates_for(gpu("h200-141gb"))
    assert r.gemm_fraction == 0.7 and r.flash_fraction == (0.4, 0.3) and "calibration" in r.basis
    assert "assumed" in rates_for(gpu("h100-80gb")).basis


def derive_module():
    return load_script(ROOT / "benchmarks" / "calibration.py")


def test_the_calibration_is_read_back_into_the_rates_that_made_its_times():
    """Lines made by known rates (as if a card ran at them) give those rates back."""
    truth = dataclasses.replace(rates_for(gpu("h100-80gb")), gemm_fraction=0.62, pipeline_k=320.0,
                                bandwidth_fraction=0.85, flash_fraction=(0.41, 0.29))
    lines = []
    for m, n, k in [(2048, 4096, 4096), (8192, 768, 768), (4096, 4096, 256), (2048, 11008, 4096)]:
        work = items({"kind": st.GEMM, "flops": 2.0 * m * n * k, "m": m, "n": n, "k": k, "batch": 1,
                      "bytes": 2.0 * (m * k + k * n + m * n)})
        lines.append({"what": "gemm", "dtype": "bfloat16", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
                      "model_bytes": float(work["bytes"][0]), "ms": st._device_seconds(work, truth)[0] * 1e3})
    # streaming kernels: a floor per launch (the card's own, not the default), then the bytes at the truth's rates;
    # bitsandbytes' dequantisation is three kernels (the nested absmax, an add, the weight), its time theirs summed
    truth = dataclasses.replace(truth, kernel_floor_s=7e-6, dequant_fraction=0.4)
    copy = items({"kind": st.MEMORY, "bytes": 2e9})
    lines.append({"what": "copy", "model_bytes": 2e9, "launches": 1,
                  "ms": st._device_seconds(copy, truth)[0] * 1e3})
    dequant = items({"kind": st.DEQUANT, "bytes": 1e5}, {"kind": st.MEMORY, "bytes": 1e4},
                    {"kind": st.DEQUANT, "bytes": 4e7})
    lines.append({"what": "dequant-4bit", "model_bytes": 1e5 + 1e4 + 4e7, "launches": 3,
                  "ms": st._device_seconds(dequant, dataclasses.replace(truth, bandwidth_fraction=0.4)).sum() * 1e3})
    lines.append({"what": "kernel-floor", "ms": truth.kernel_floor_s * 1e3})
    lines.append({"what": "cast", "model_bytes": 1e3, "launches": 1, "ms": 1e-3})  # within its floor: says nothing
    forward = 4.0 * 32 * 2048 * 2048 * 128 * 0.5
    lines.append({"what": "attention", "kernel": "flash", "direction": "forward", "batch": 1, "heads": 32,
                  "seq": 2048, "head_dim": 128, "flops": forward, "ms": forward / (truth.tensor_flops * 0.41) * 1e3})
    lines.append({"what": "attention", "kernel": "flash", "direction": "forward+backward", "batch": 1, "heads": 32,
                  "seq": 2048, "head_dim": 128, "flops": 3.5 * forward,
                  "ms": (forward / 0.41 + 2.5 * forward / 0.29) / truth.tensor_flops * 1e3})
    found = derive_module().derive(lines, rates_for(gpu("h100-80gb")))
    assert found["gemm_fraction"] == pytest.approx(0.62, rel=1e-3) and found["pipeline_k"] == 320.0
    assert found["bandwidth_fraction"] == pytest.approx(0.85, rel=1e-3) and found["kernel_floor_s"] == 7e-6
    assert found["dequant_fraction"] == pytest.approx(0.4, rel=1e-3)
    assert found["flash_fraction"] == pytest.approx([0.41, 0.29], rel=1e-3)


def test_the_calibration_runs_on_the_fake_gpu_and_counts_what_the_model_counts(fake_cuda):
    from gcbench.calibration import calibrate

    lines = calibrate("cuda", quick=True)
    what = {x["what"] for x in lines}
    assert {"gemm", "copy", "add", "cast", "kernel-floor", "attention", "host-link", "host-ops"} <= what
    gemm = next(x for x in lines if x["what"] == "gemm")
    assert gemm["flops"] == 2 * gemm["m"] * gemm["n"] * gemm["k"] and gemm["ms"] > 0
    host = {(x["policy"], x["phase"]): x for x in lines if x["what"] == "host-ops"}
    assert host[("sac", "forward")]["modes"] > 0 and host[("none", "forward")]["modes"] == 0
    assert all(x["host_ops"] > 0 and x["host_ms"] > 0 for x in host.values())
    assert all(math.isfinite(x["ms"]) for x in lines if "ms" in x)
    # a config's start, measured first, in a forked child (the fake GPU's calls carried into it by the fork)
    (start,) = [x for x in lines if x["what"] == "start"]
    assert lines[0] is start and start["model"] == "tiny-llama" and "unavailable" not in start, start.get("unavailable")
    # measured, not judged: on the fake GPU a tiny model's builds take what this machine's CPU gives them (the fixed
    # part, a difference of two builds, may even come out below 0; cost.measured_starts clamps it)
    assert all(math.isfinite(start[k]) for k in ("context_s", "cublas_s", "build_fixed_s", "build_per_block_s"))
    assert start["context_s"] >= 0 and start["cublas_s"] >= 0


def test_the_calibrated_rates_are_what_the_committed_calibrations_give():
    assert derive_module().main(["--check"]) == 0


def test_a_cuda_run_record_carries_its_predicted_step_time_and_a_cpu_run_none(fake_cuda):
    from gcbench.report.run_table import run_table
    from gcbench.runner import run

    record = run(RunSpec(model="tiny-llama", seq_len=32, batch_size=2, policy="full", device="cuda:0", warmup_steps=1,
                         measure_steps=2, predict=True))
    simulated = estimate(RunSpec(model="tiny-llama", seq_len=32, batch_size=2, policy="full", device="cpu",
                                 precision="bf16"), "simulate", "cuda")
    # the fake GPU is an H100 by name: the prediction is the simulated step played on that card's rates
    assert record["predicted_step_ms"] == pytest.approx(simulated.work.time(rates_for(gpu("h100-80gb"))).step_ms)
    assert "predicted_step_ms_by_card" not in record
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(run_table(record))
    assert "predicted step time" in console.export_text()
    cpu = run(RunSpec(model="tiny-llama", seq_len=32, batch_size=2, policy="full", device="cpu", warmup_steps=1,
                      measure_steps=2))
    assert cpu["predicted_step_ms"] is None
