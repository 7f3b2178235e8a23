"""The policies beyond the classic four (sac, attn, offload, budget): exact gradients, FLOPs and saved bytes.

Theory each assertion holds the measurements to is in docs/policies.md ("Policies beyond the classic four").
"""

import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.models import build_model, find_blocks
from gcbench.policies import (SAC_ATTENTION, SAC_MATMULS, AttentionCore, CompileBudget, Full, OffloadedBlock,
                              SelectiveCheckpointedBlock, attention_modules, sac_policy_fn)
from gcbench.resolved import resolve_record
from gcbench.runner import run
from gcbench.step import make_batch
from tests.helpers import CLASSIC_SEQ, TINY, tiny_spec
from tests.helpers import assert_gradients_equal_none

BEYOND = ("sac", "sac:mm=alternate", "attn", "offload", "offload:what=all", "offload:what=inputs,k=2")
SEQ, BATCH = CLASSIC_SEQ, 2  # as conftest's classic_records, whose none / full / every-k:k=2 runs are the references


@pytest.fixture(scope="module")
def records(classic_records):
    """One CPU record per (tiny family, policy), the classic references none / full / every-k:k=2 included."""
    # One warm-up step, the least allowed: the asserted fields do not depend on it.
    new = {(m, p): run(tiny_spec(m, p, seq_len=SEQ, batch_size=BATCH, warmup_steps=1)) for m in TINY for p in BEYOND}
    refs = {(m, p): classic_records[m, p] for m in TINY for p in ("none", "full", "every-k:k=2")}
    return refs | new


def field(records, model_name, name):
    return {p: rec[name] for (m, p), rec in records.items() if m == model_name}


@pytest.mark.parametrize("policy", BEYOND)
@pytest.mark.parametrize("model_name", TINY)
def test_gradients_equal_none_with_dropout_on(model_name, policy):
    assert_gradients_equal_none(model_name, policy)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["sac", "sac:mm=alternate", "attn", "offload", "offload:what=all"])
@pytest.mark.parametrize("model_name", TINY)
def test_gradients_equal_none_on_cuda(model_name, policy):
    """CUDA's fused attention kernels draw dropout from the RNG themselves: sac must recompute, not cache, them."""
    assert_gradients_equal_none(model_name, policy, device="cuda")


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_all_runs_ok(records, model_name):
    assert {p: s for p, s in field(records, model_name, "status").items() if s != "ok"} == {}


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_flops_between_none_and_full(records, model_name):
    flops = field(records, model_name, "flops")
    # The FLOP counter counts matmuls and attention kernels only, and sac:mm=all caches every one of them.
    assert flops["sac"] == flops["none"]
    assert flops["none"] < flops["sac:mm=alternate"] < flops["full"]
    assert flops["none"] < flops["attn"] < flops["full"]
    assert flops["offload"] == flops["full"]  # what=inputs is full with its inputs moved
    assert flops["offload:what=all"] == flops["none"]  # moving tensors recomputes nothing
    assert flops["offload:what=inputs,k=2"] == flops["every-k:k=2"]


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_saved_bytes_between_full_and_none(records, model_name):
    saved = field(records, model_name, "saved_activation_bytes")
    for policy in ("sac", "sac:mm=alternate", "attn"):
        assert saved["full"] < saved[policy] < saved["none"], policy
    assert saved["sac:mm=alternate"] < saved["sac"]


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_offload_moves_the_saved_bytes_to_the_host(records, model_name):
    saved = field(records, model_name, "saved_activation_bytes")
    offloaded = {p: rec.get("offloaded_bytes") for (m, p), rec in records.items() if m == model_name}
    block_input = BATCH * SEQ * 64 * 4  # batch x seq x hidden x fp32
    # what=inputs: exactly the N=4 block inputs leave the device; the rest (embeddings, head, loss) stays.
    assert offloaded["offload"] == 4 * block_input
    assert saved["offload"] == saved["full"] - offloaded["offload"]
    assert offloaded["offload:what=inputs,k=2"] == 2 * block_input
    # what=all: everything saved inside blocks leaves; each save is its own host copy (no dedup), so >= the drop.
    assert saved["offload:what=all"] == saved["offload"]
    assert offloaded["offload:what=all"] >= saved["none"] - saved["offload:what=all"]
    assert "offloaded_bytes" not in records[model_name, "none"]


def test_offload_prepare_sets_up_and_runs_nothing():
    """The runner measures: prepare only pins host memory on a CUDA run, the bytes are read after the runner's step."""
    spec = tiny_spec("tiny-gpt2", "offload", seq_len=32)
    config, _ = spec.model_config()
    model = build_model(config, "cpu", torch.float32)
    spec.policy.apply(find_blocks(model))

    def no_step():
        raise AssertionError("prepare ran a step")

    cuda_step = SimpleNamespace(model=model, device=torch.device("cuda"), forward=no_step, forward_backward=no_step)
    assert spec.policy.prepare(cuda_step) is None
    assert all(b.pin_memory for b in model.modules() if isinstance(b, OffloadedBlock))
    assert spec.policy.offloaded_bytes(model) == 0  # nothing ran yet
    model(**make_batch(spec, config, "cpu"))
    assert spec.policy.offloaded_bytes(model) == 4 * BATCH * 32 * 64 * 4  # the 4 block inputs, fp32
    assert Full().offloaded_bytes(model) is None


def test_runner_reads_the_facts_budget_declares(monkeypatch, classic_records):
    """budget's facts, without compiling for minutes: `full` declared compiling and hidden from dispatch modes."""
    assert CompileBudget.compiles and CompileBudget.hidden_from_dispatch_modes
    monkeypatch.setattr(Full, "compiles", True)
    monkeypatch.setattr(Full, "hidden_from_dispatch_modes", True)
    got = run(tiny_spec("tiny-llama", "full", seq_len=SEQ, batch_size=BATCH))
    ref = classic_records["tiny-llama", "full"]
    assert got["compile_ms"] >= 0 and "compile_ms" not in ref
    for name in ("flops", "recompute_flops_ratio", "peak_tracked_bytes", "fwd_bwd_peak_bytes", "activation_peak_bytes"):
        assert got[name] is None and ref[name] is not None, name
    # Saved bytes are counted without the FLOP counter, on the blocks as they ran; the rest is measured as ever.
    for name in ("saved_activation_bytes", "static_bytes", "model_flops"):
        assert got[name] == ref[name], name


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_tracked_peak(records, model_name):
    peak = field(records, model_name, "peak_tracked_bytes")
    for policy in ("sac", "sac:mm=alternate", "attn"):
        assert peak["full"] < peak[policy] < peak["none"], policy
    # On CPU the host is the device: save_on_cpu keeps the very same tensors, so the peak does not move.
    assert peak["offload"] == peak["full"]
    assert peak["offload:what=all"] == peak["none"]


class OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_name", TINY)
def test_sac_save_lists_cover_the_matmuls_each_family_dispatches(model_name, attn):
    """nn.Linear / Conv1D reach the dispatcher as mm or addmm through views: if that changes, sac saves nothing."""
    spec = tiny_spec(model_name, attn=attn, seq_len=32)
    config, _ = spec.model_config()
    model = build_model(config, "cpu", torch.float32)
    seen = OpsSeen()
    with seen:
        model(**make_batch(spec, config, "cpu"))
    aten = torch.ops.aten
    matmul_like = {op for op in seen.ops if op.name().startswith(("aten::mm", "aten::addmm", "aten::bmm",
                                                                  "aten::baddbmm", "aten::_scaled_dot", "aten::linear",
                                                                  "aten::matmul", "aten::_flash", "aten::_efficient"))}
    assert matmul_like <= SAC_MATMULS | SAC_ATTENTION
    assert seen.ops[aten.mm.default] + seen.ops[aten.addmm.default] >= 4 * 4  # >= 4 projections in each block


def test_sac_policy_decisions():
    mm, bmm, add = torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.add.Tensor
    forward = SimpleNamespace(is_recompute=False, op_output=None)
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    every = sac_policy_fn("all")
    assert [every(forward, op) for op in (mm, add, mm, bmm)] == [save, again, save, save]
    alternate = sac_policy_fn("alternate")
    assert [alternate(forward, mm) for _ in range(4)] == [save, again, save, again]
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 4, 8)
    assert every(forward, cpu_flash, q, q, q) == save
    # An attention kernel with dropout draws random numbers: caching it would shift every later dropout mask.
    assert every(forward, cpu_flash, q, q, q, 0.1) == again
    assert every(forward, cpu_flash, q, q, q, dropout_p=0.1) == again


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_sac_counts_cached_outputs_as_saved(records):
    """Without note_saved, sac would report only the block inputs, like full."""
    saved = field(records, "tiny-llama", "saved_activation_bytes")
    block_output = BATCH * SEQ * 64 * 4
    assert saved["sac"] - saved["full"] > 4 * 7 * block_output / 2  # 7 projections per block, most >= hidden wide


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_attn_with_eager_attention_drops_the_probabilities(model_name):
    """Eager attention keeps O(s^2) tensors per block (probabilities, dropout mask); attn keeps none of them."""
    none = run(tiny_spec(model_name, "none", attn="eager", warmup_steps=1))
    attn = run(tiny_spec(model_name, "attn", attn="eager", warmup_steps=1))
    assert none["attn_implementation"] == attn["attn_implementation"] == "eager"
    probabilities = 2 * 4 * 128 * 128 * 4  # batch x heads x seq x seq x fp32
    assert attn["saved_activation_bytes"] < none["saved_activation_bytes"] - 4 * 2 * probabilities
    loss_ref, ref = gradients_eager(model_name, "none")
    loss, got = gradients_eager(model_name, "attn")
    torch.testing.assert_close(loss, loss_ref)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def gradients_eager(model_name, policy):
    spec = tiny_spec(model_name, policy, attn="eager")
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, "cpu", torch.float32)
    spec.policy.apply(find_blocks(model))
    torch.manual_seed(1)
    loss = model(**make_batch(spec, config, "cpu")).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("model_name", TINY)
def test_attn_reroutes_one_attention_module_per_block_and_undo_restores(model_name):
    spec = tiny_spec(model_name, "attn")
    config, _ = spec.model_config()
    model = build_model(config, "cpu", torch.float32)
    blocks = find_blocks(model)
    modules = [attention_modules(b) for b in blocks]
    assert all(len(found) == 1 for found in modules)
    undo = AttentionCore().apply(blocks)
    assert all(found[0].config._attn_implementation.endswith("|sdpa") for found in modules)
    assert model.config._attn_implementation == "sdpa"  # the model's mask construction is untouched
    undo()
    assert all(found[0].config is model.config for found in modules)


@pytest.mark.parametrize("policy, wrapper", [("sac", SelectiveCheckpointedBlock), ("offload", OffloadedBlock)])
def test_block_wrappers_and_undo(policy, wrapper):
    spec = tiny_spec("tiny-gpt2", policy)
    config, _ = spec.model_config()
    model = build_model(config, "cpu", torch.float32)
    blocks = find_blocks(model)
    originals = list(blocks)
    undo = spec.policy.apply(blocks)
    assert all(isinstance(b, wrapper) for b in blocks)
    undo()
    assert list(blocks) == originals


@pytest.mark.parametrize("policy, message", [
    ("sac:mm=some", "mm=all or mm=alternate"),
    ("offload:what=grads", "what=inputs or what=all"),
    ("offload:k=9", "out of range"),
    ("budget:b=1.5", "out of range"),
    ("budget:b=half", "not a number"),
    ("every-k:k=2+offload", "do not compose"),
    ("sac+attn", "do not compose"),
])
def test_bad_options_and_compositions_are_refused(policy, message):
    with pytest.raises(GcbenchError, match=message):
        tiny_spec(policy=policy)


@pytest.mark.parametrize("policy", ["sac:mm=alternate", "offload:what=all,k=2", "budget:b=0.25", "attn"])
def test_options_round_trip_through_a_record(policy):
    spec = tiny_spec(policy=policy)
    assert resolve_record(spec.as_record()).policy == spec.policy


def test_policies_command_lists_the_new_policies_with_options():
    result = CliRunner().invoke(app, ["policies"], terminal_width=200)
    assert result.exit_code == 0
    for text in ("sac", "mm=all", "attn", "offload", "what=inputs", "k=1", "budget", "b=0.5", "EXPERIMENTAL"):
        assert text in result.output, text


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GCBENCH_SLOW"), reason="compiles for minutes on CPU: set GCBENCH_SLOW=1")
@pytest.mark.parametrize("model_name", TINY)
def test_budget_compiles_and_measures_honestly(model_name):
    """torch.compile on 2 CPU cores takes ~20-60 s per compile, so CI skips this; docs/policies.md has the manual
    check (GCBENCH_SLOW=1 python -m pytest -q -m slow tests/test_policies_beyond.py)."""
    loss_ref, ref = gradients_eval(model_name, "none")
    loss, got = gradients_eval(model_name, "budget:b=0.0")
    torch.testing.assert_close(loss, loss_ref)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)  # fused kernels reorder float sums
    none, full = run(tiny_spec(model_name, "none")), run(tiny_spec(model_name, "full"))
    low = run(tiny_spec(model_name, "budget:b=0.0"))
    assert low["status"] == "ok" and low["compile_ms"] > 0
    # Dispatch-mode instruments see the eager fallback, not the compiled blocks: reported as unknown.
    assert low["flops"] is None and low["peak_tracked_bytes"] is None
    # b=0 recomputes all it can: about full's saved bytes (the partitioner may keep a few more small tensors).
    assert low["saved_activation_bytes"] < 1.5 * full["saved_activation_bytes"] < none["saved_activation_bytes"]


def gradients_eval(model_name, policy):
    """Dropout off: inductor draws dropout masks from its own RNG, so only dropout-free gradients can match."""
    spec = tiny_spec(model_name, policy)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, "cpu", torch.float32).eval()
    spec.policy.apply(find_blocks(model))
    loss = model(**make_batch(spec, config, "cpu")).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]
