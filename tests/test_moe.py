"""Mixtures of experts as transformers runs them: the tiny MoE preset under the policies (gradients, the simulated
peak against the measured one), the experts' grouped matmul that CUDA runs and the simulation runs for it, its
FLOPs and step time, and the big MoE presets (docs/models.md, "Mixtures of experts")."""

from __future__ import annotations

import types

import pytest
import torch

from gcbench.estimators.shape import cuda_kernel
from gcbench.estimators.simulate import simulate
from gcbench.estimators.step_clock import StepClock
from gcbench.estimators.step_time import GEMM, SYNC
from gcbench.measure import counting_flops
from gcbench.models import build_meta_model, build_model, describe, experts_implementation, load_config
from tests.helpers import assert_gradients_equal_none, estimate_rows, gradients, run_as_simulated, tiny_spec

TINY_MOE = "tiny-mixtral"
SEQ = 32
BIG = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")


def test_the_tiny_moe_preset_routes_randomly_so_the_gradient_check_is_not_vacuous():
    """Router jitter and attention dropout draw from the RNG: another seed, another loss."""
    first, _ = gradients(TINY_MOE, "none", dropout_seed=1, seq_len=SEQ)
    second, _ = gradients(TINY_MOE, "none", dropout_seed=2, seq_len=SEQ)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("policy", ["full", "sqrtn", "sac"])
def test_every_policy_gives_the_tiny_moe_none_gradients(policy):
    assert_gradients_equal_none(TINY_MOE, policy, seq_len=SEQ)


@pytest.mark.parametrize("policy", ["none", pytest.param("full", marks=pytest.mark.slow),
                                    pytest.param("sqrtn", marks=pytest.mark.slow), "sac"])  # a run each: 2 s
def test_the_simulation_is_the_measured_cpu_peak_of_the_tiny_moe(policy):
    run_as_simulated(TINY_MOE, policy, seq_len=SEQ)


def test_transformers_runs_the_experts_through_torchs_grouped_matmul_on_cuda(monkeypatch):
    """transformers 5's default experts implementation is grouped_mm on every device
    (modeling_utils.get_correct_experts_implementation), and on an sm80+ card it multiplies through torch's
    grouped matmul (integrations/moe.py, _can_use_grouped_mm): what the simulated CUDA step runs."""
    moe = pytest.importorskip("transformers.integrations.moe")
    config, _ = load_config(TINY_MOE)
    assert experts_implementation(build_meta_model(config)) == "grouped_mm"
    assert experts_implementation(build_meta_model(load_config("tiny-llama")[0])) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    weight = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert moe._can_use_grouped_mm(None, weight, None)
    assert simulate(tiny_spec(TINY_MOE, "full", seq_len=SEQ, precision="bf16"), "cuda").experts_kernel == "grouped_mm"


def test_the_simulated_cuda_step_takes_cudas_grouped_matmul_whatever_the_cpu_would(monkeypatch):
    """Where the CPU's torch takes transformers' loop over the experts (no CPU grouped matmul before torch 2.9; up
    to 2.10 one that reads the fakes' pointers), the CUDA target still runs torch's grouped matmul, as the card
    would; the CPU target runs what the CPU runs."""
    moe = pytest.importorskip("transformers.integrations.moe")
    def cpu_answer(input, weight, offs):
        return False

    monkeypatch.setattr(moe, "_can_use_grouped_mm", cpu_answer)
    spec = tiny_spec(TINY_MOE, "none", seq_len=SEQ)
    assert simulate(spec, "cpu", shortcut=False).experts_kernel == "grouped_mm_fallback"
    assert simulate(spec, "cuda", shortcut=False).experts_kernel == "grouped_mm"
    assert moe._can_use_grouped_mm is cpu_answer  # put back


def test_the_experts_grouped_matmul_counts_its_flops():
    """FlopCounterMode has no formula for aten._grouped_mm: without gcbench's, the experts' matmuls counted 0."""
    config, _ = load_config(TINY_MOE)
    config.use_cache = False
    model = build_model(config, "cpu", torch.float32)
    ids = torch.zeros((1, SEQ), dtype=torch.long)
    with counting_flops() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    rows, hidden, inner = SEQ * config.num_experts_per_tok, config.hidden_size, config.intermediate_size
    forward = config.num_hidden_layers * (2 * rows * hidden * 2 * inner + 2 * rows * inner * hidden)
    assert counter.get_flop_counts()["Global"][torch.ops.aten._grouped_mm] == 3 * forward  # forward + 2 gradients


def test_the_step_clock_charges_the_grouped_matmul_as_matmuls():
    """One kernel in bf16; fp32 (amp's fp32 weights): torch's fallback reads the offsets back, one mm per expert."""
    experts, rows, hidden, inner = 8, 64, 32, 48
    x, offs = torch.randn(rows, hidden), torch.arange(1, experts + 1, dtype=torch.int32) * (rows // experts)
    for dtype, launches in ((torch.bfloat16, 1), (torch.float32, experts)):
        clock = StepClock()
        with clock:
            torch._grouped_mm(x.to(dtype), torch.randn(experts, hidden, inner, dtype=dtype), offs)
        items = clock.work().items
        gemm = items[items["kind"] == GEMM]
        assert gemm["flops"].tolist() == [2.0 * rows * hidden * inner] and gemm["launches"].tolist() == [launches]
        assert (gemm["m"][0], gemm["batch"][0]) == (rows // experts, experts)
        assert (items["kind"] == SYNC).sum() == (dtype == torch.float32)


def test_the_big_moe_presets_have_their_published_sizes():
    """Parameter counts as their model cards state them: 46.7B, 30.5B, 15.7B."""
    for name, params, layers, kv in (("mixtral-8x7b", 46.7e9, 32, 8), ("qwen3-30b-a3b", 30.5e9, 48, 4),
                                     ("deepseek-v2-lite", 15.7e9, 27, 16)):
        row = describe(name)
        assert abs(row["params"] / params - 1) < 0.002 and row["layers"] == layers and row["kv_heads"] == kv, name


def test_values_of_their_own_head_size_leave_flash_for_the_efficient_kernel():
    """DeepSeek's MLA: queries and keys of 192, values of 128 (sdp_utils.cpp: flash wants one head size for all
    three, memory-efficient only queries equal to keys); on the fakes, flash's meta kernel gave 192-wide outputs
    that the output projection then refused."""
    assert cuda_kernel(torch.bfloat16, False, 192, (16, 16), value_head_dim=128) == "efficient"
    assert cuda_kernel(torch.bfloat16, False, 192, (16, 16), value_head_dim=192) == "flash"
    assert cuda_kernel(torch.bfloat16, False, 192, (16, 16), value_head_dim=132) == "math"  # not 16-byte aligned


# Two simulations each (the step, the caching allocator replayed on it): 2 s. In the default suite: DeepSeek's (MLA
# attention, shared experts, a dense first block); all three are built by the test above.
@pytest.mark.parametrize("name", [*(pytest.param(name, marks=pytest.mark.slow) for name in BIG[:2]), BIG[2]])
def test_a_big_moe_preset_is_estimated_for_a_gpu(name):
    [row] = estimate_rows("--model", name, "--seq", "512", "--gpu", "h100-80gb", "--method", "simulate", "--layers",
                          "2")
    assert row["peak_bytes"] > row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    assert row["experts_kernel"] == "grouped_mm" and row["predicted_step_ms"] > 0
    # DeepSeek's MLA: values of 128 beside queries and keys of 192, which flash refuses (check_head_dim_size_flash)
    assert row["attention_kernel"] == ("efficient" if name == "deepseek-v2-lite" else "flash")
