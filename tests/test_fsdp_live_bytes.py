"""Issue 31: the CPU stand-in for FSDP2 counts what is live, and the per-rank model predicts it.

FSDP2 frees a gathered parameter by resizing its storage to 0 and gathers into it again by resizing it back
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py, free_storage / alloc_storage); the live-tensor tracker follows
those resizes, so its per-rank peak equals torch's own MemTracker's. The per-rank model (estimators/per_rank.py) is
held to the fixed stand-in at 2 ranks and to the H200's FSDP2 records at one rank."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gcbench.estimators import estimate
from gcbench.measure import LiveTensorTracker
from gcbench.resolved import resolve
from gcbench.spec import RunSpec

H200 = Path(__file__).resolve().parent.parent / "results" / "gpu" / "nvidia-h200" / "llama-7b-8layers-fsdp2.jsonl"


def test_the_tracker_follows_a_storage_resized_to_zero_and_back():
    with LiveTensorTracker() as tracker:
        t = torch.empty(1000, dtype=torch.float32)
        assert tracker.current == 4000
        t.untyped_storage().resize_(0)  # FSDP2's free_storage
        assert tracker.current == 0
        t.untyped_storage().resize_(4000)  # FSDP2's alloc_storage
        u = torch.empty(250, dtype=torch.float32)
        assert (tracker.current, tracker.peak) == (5000, 5000)
        del t, u
        assert tracker.current == 0
    assert torch.UntypedStorage.resize_ is not None and "LiveTensorTracker" not in repr(torch.UntypedStorage.resize_)


def test_a_storage_first_seen_when_resized_up_is_counted_and_the_cap_bites():
    empty = torch.empty(0, dtype=torch.float32)  # size 0 when the tracker starts: FSDP2's resharded parameters
    with LiveTensorTracker(cap_bytes=10_000) as tracker:
        empty.untyped_storage().resize_(8000)
        assert tracker.current == 8000
        with pytest.raises(torch.OutOfMemoryError):
            empty.untyped_storage().resize_(12_000)


def _peaks(tmp_path, *args) -> dict[str, list[int]]:
    """{"rank/model/policy": [tracked peak, MemTracker peak]} of tiny-llama and tiny-gpt2, 2 CPU ranks."""
    out = tmp_path / "peaks"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tests.fsdp_live_bytes", str(out), *args, "none", "full", "sqrtn"],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {f"{rank}/{key}": peaks for rank in (0, 1)
            for key, peaks in json.loads((tmp_path / f"peaks-{rank}.json").read_text()).items()}


@pytest.fixture(scope="module")
def fixed_peaks(tmp_path_factory):
    return _peaks(tmp_path_factory.mktemp("fixed"))


def _errors(peaks: dict[str, list[int]]) -> dict[str, float]:
    return {k: tracked / memtracker - 1 for k, (tracked, memtracker) in peaks.items()}


@pytest.mark.slow  # torchrun: a fresh interpreter per rank
def test_the_per_rank_peak_of_fsdp2_on_cpu_equals_memtracker_within_half_a_percent(fixed_peaks):
    errors = _errors(fixed_peaks)
    assert len(errors) == 12
    assert {k: e for k, e in errors.items() if abs(e) > 0.005} == {}


@pytest.mark.slow  # torchrun: a fresh interpreter per rank
def test_without_following_resizes_the_tracker_overstates_fsdp2s_peak(tmp_path):
    # The check above can fail: ignoring resizes (the tracker before issue 31) overstates every policy's peak.
    errors = _errors(_peaks(tmp_path, "--unfixed"))
    assert min(errors.values()) > 0.05


@pytest.mark.slow  # torchrun: a fresh interpreter per rank
def test_the_per_rank_model_predicts_the_cpu_stand_in_at_two_ranks(fixed_peaks):
    # Measured (tracked, fixed) against predicted. The per-rank model (analytic) may overestimate a little (a
    # unit's whole gradients are taken at its backward's peak), never underestimate by more than 3%; the
    # simulation runs FSDP2 itself over a fake world (fake_ranks.py), and gets each rank's peak to the byte.
    errors, simulated = {}, {}
    for key, (tracked, _) in fixed_peaks.items():
        rank, model, policy = key.split("/")
        spec = resolve(RunSpec(model=model, seq_len=64, batch_size=2, policy=policy, device="cpu", precision="fp32",
                               shard="fsdp2", nproc=2))
        errors[key] = estimate(spec, "analytic", "cpu").peak_bytes / tracked - 1
        simulated[key] = (estimate(spec, "simulate", "cpu").peak_bytes, tracked)
    assert {k: e for k, e in errors.items() if not -0.03 <= e <= 0.05} == {}
    assert {k: v for k, v in simulated.items() if v[0] != v[1]} == {}


@pytest.mark.slow  # torchrun: a fresh interpreter per rank
def test_under_amp_the_per_rank_model_computes_on_the_bf16_parameters_fsdp2_gathers(tmp_path):
    # MixedPrecisionPolicy(bf16, fp32): the ranks compute on bf16 weights, so the unsharded amp-bf16 step's fp32
    # hidden states and autocast copies are not there. Predicted from that step, the model was +5.8..+12.3% over.
    errors, simulated = {}, {}
    for key, (tracked, memtracker) in _peaks(tmp_path, "--precision", "amp-bf16").items():
        assert abs(tracked / memtracker - 1) <= 0.005, key
        rank, model, policy = key.split("/")
        spec = resolve(RunSpec(model=model, seq_len=64, batch_size=2, policy=policy, device="cpu",
                               precision="amp-bf16", shard="fsdp2", nproc=2))
        errors[key] = estimate(spec, "analytic", "cpu").peak_bytes / tracked - 1
        simulated[key] = (estimate(spec, "simulate", "cpu").peak_bytes, tracked)
    assert len(errors) == 12
    assert {k: e for k, e in errors.items() if not -0.01 <= e <= 0.02} == {}
    assert {k: v for k, v in simulated.items() if v[0] != v[1]} == {}


@pytest.mark.skipif(not H200.exists(), reason="the H200 records are not in this checkout")
@pytest.mark.parametrize("policy", ["none", "full", "sqrtn"])
def test_the_per_rank_model_predicts_fsdp2_at_one_rank_on_the_h200(policy):
    # results/gpu/nvidia-h200 (torch 2.11): llama-7b with 8 blocks, seq 2048, batch 1, bf16, --shard fsdp2 --nproc 1.
    # The model before issue 31 was 3.8-10.0% over in forward and 7.2-12.7% over in backward.
    record, spec = _h200(policy)
    got = estimate(spec, "analytic", "cuda")
    for phase in ("forward", "backward"):
        assert getattr(got, f"{phase}_peak_bytes") / record[f"{phase}_peak_bytes"] - 1 == pytest.approx(0, abs=0.02)


@pytest.mark.slow  # three 8-block simulations of FSDP2 itself
@pytest.mark.skipif(not H200.exists(), reason="the H200 records are not in this checkout")
@pytest.mark.parametrize("policy", ["none", "full", "sqrtn"])
def test_fsdp2_itself_on_fakes_predicts_one_rank_on_the_h200(policy):
    # The same records: with the card's two cuBLAS workspaces, within 0.05% (4 MiB under `none`; the per-rank
    # model is +0.6% over under none and sqrtn)
    record, spec = _h200(policy)
    simulated = estimate(spec, "simulate", "cuda").peak_bytes + 2 * 32 * 2**20
    assert simulated / record["peak_allocated_bytes"] - 1 == pytest.approx(0, abs=0.0005)


def _h200(policy: str):
    """The H200's FSDP2 record of `policy` (one rank) and its spec, predicted from this CPU machine."""
    record = next(r for r in map(json.loads, H200.read_text().splitlines()) if r["policy"] == policy)
    return record, resolve(RunSpec(model="llama-7b", layers=8, seq_len=2048, batch_size=1, policy=policy,
                                   device="cpu", precision="bf16", shard="fsdp2", nproc=1))
