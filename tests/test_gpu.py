"""CUDA checks on a real GPU (skipped without one): allocator numbers, the policy ordering, gradients, the memory
cap, the CLI and a sweep's child processes. Without a GPU, tests/test_cuda_contract.py drives the same code
through a fake torch.cuda; these check what a fake cannot: the numbers."""

import pytest
import torch
from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.results.store import read_records
from gcbench.spec import RunSpec
from gcbench.runner import run
from tests.helpers import assert_gradients_equal_none

pytestmark = pytest.mark.gpu


def cuda_run(**fields):
    defaults = dict(model="tiny-llama", seq_len=256, batch_size=2, device="cuda", warmup_steps=2, measure_steps=5)
    return run(RunSpec(**(defaults | fields)))


def test_cuda_record_has_consistent_allocator_numbers():
    r = cuda_run()
    assert r["status"] == "ok" and r["precision"] == "bf16" and r["device"] == "cuda:0"
    state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
    assert r["peak_allocated_bytes"] >= r["fwd_bwd_peak_bytes"] > r["static_bytes"] >= state
    assert r["activation_peak_bytes"] == r["fwd_bwd_peak_bytes"] - r["static_bytes"]
    assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"]
    assert len(r["step_ms"]) == 5 and len(r["wall_ms"]) == 5
    assert all(w >= s * 0.9 for w, s in zip(r["wall_ms"], r["step_ms"]))  # events inside the synchronized wall time
    assert r["env"]["gpu_name"] == torch.cuda.get_device_name(0) and "peak_tracked_bytes" not in r
    assert isinstance(r["num_alloc_retries"], int) and r["num_alloc_retries"] >= 0


def test_cuda_peak_order_none_every_k_full():
    peaks = {p: cuda_run(model="gpt2", layers=4, seq_len=1024, batch_size=4, policy=p)["peak_allocated_bytes"]
             for p in ("none", "every-k:k=2", "full")}
    assert peaks["none"] > peaks["every-k:k=2"] > peaks["full"]


@pytest.mark.parametrize("policy", ["full", "every-k:k=2", "segments:k=2", "sqrtn"])
def test_cuda_gradients_equal_none(policy):
    assert_gradients_equal_none("tiny-gpt2", policy, device="cuda")


def test_cuda_memory_cap_turns_into_an_oom_record_and_is_lifted_afterwards():
    r = cuda_run(model="gpt2", seq_len=1024, batch_size=8, memory_cap_bytes=int(1.5 * 2**30))
    assert r["status"] == "oom" and r["memory_cap_kind"] == "reserved"
    assert cuda_run()["status"] == "ok"  # the per-process fraction does not stick


def test_offload_pins_host_memory_on_cuda():
    r = cuda_run(policy="offload")
    assert r["status"] == "ok" and r["offloaded_bytes"] > 0
    assert r["peak_allocated_bytes"] < cuda_run(policy="none")["peak_allocated_bytes"]


def test_run_command_picks_the_gpu_by_default(tmp_path):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", "tiny-llama", "--seq", "64", "--warmup", "1", "--steps", "2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    [record] = read_records(out)
    assert record["device"] == "cuda:0" and record["env"]["gpu_name"] == torch.cuda.get_device_name(0)


def test_sweep_children_use_cuda_after_the_fork_server(tmp_path):
    """The fork server must not initialise CUDA, or no child forked from it could use the GPU."""
    records = gcbench.sweep(model="tiny-llama", seq=64, batch=[1, 2], policy=["none", "full"], device="cuda",
                            warmup=1, steps=2, out=tmp_path / "s.jsonl", progress=False)
    assert [r["status"] for r in records] == ["ok"] * 4
    assert {r["device"] for r in records} == {"cuda:0"}
