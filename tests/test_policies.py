"""Policies are exact and device-free: same gradients as `none`, recompute FLOPs and saved bytes as theory says."""

import pytest
import torch

from gcbench.errors import GcbenchError
from gcbench.models import build_model, find_blocks
from gcbench.policies import POLICIES, CheckpointedGroup, EveryK, GroupArguments, Segments, SqrtN, parse_policy
from tests.helpers import CLASSIC, CLASSIC_SEQ, TINY, assert_gradients_equal_none, gradients, tiny_spec


@pytest.mark.parametrize("model_name", TINY)
def test_dropout_is_active_so_rng_replay_is_tested(model_name):
    loss_a, _ = gradients(model_name, "none", dropout_seed=1)
    loss_b, _ = gradients(model_name, "none", dropout_seed=2)
    assert not torch.equal(loss_a, loss_b)


@pytest.mark.parametrize("policy", [p for p in CLASSIC if p != "none"])
@pytest.mark.parametrize("model_name", TINY)
def test_gradients_equal_none(model_name, policy):
    assert_gradients_equal_none(model_name, policy)


def test_policy_wraps_the_blocks_it_should_and_undo_restores_them():
    spec = tiny_spec("tiny-gpt2", "segments:k=3")
    config, _ = spec.model_config()
    model = build_model(config, "cpu", torch.float32)
    blocks = find_blocks(model)
    originals, params = list(blocks), list(model.parameters())
    undo = spec.policy.apply(blocks)
    # a group stands at its last block; the blocks before it note their own arguments for it
    assert isinstance(blocks[2], CheckpointedGroup) and list(blocks[2].blocks) == originals[:3]
    assert all(isinstance(blocks[i], GroupArguments) and blocks[i]._group == [blocks[2]] for i in (0, 1))
    assert isinstance(blocks[3], CheckpointedGroup) and list(blocks[3].blocks) == originals[3:]
    # each block registered once, in its place: the optimizer sees the parameters in the same order
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    undo()
    assert list(blocks) == originals


def test_groups_follow_the_documented_semantics():
    assert EveryK(k=2).groups(5) == [range(1, 2), range(3, 4)]
    assert EveryK(k=1).groups(3) == POLICIES["full"]().groups(3)
    assert Segments(k=2).groups(5) == [range(0, 2), range(2, 4), range(4, 5)]
    assert SqrtN().groups(32) == Segments(k=6).groups(32)  # ceil(sqrt(32)) = 6
    assert SqrtN().groups(16) == Segments(k=4).groups(16)


def test_parse_policy():
    assert parse_policy("every-k:k=3") == EveryK(k=3)
    assert str(parse_policy("segments:k=4")) == "segments:k=4"
    assert str(parse_policy("sqrtn")) == "sqrtn"
    for bad, msg in [("bogus", "unknown policy"), ("every-k:j=2", "bad option"), ("every-k:k=two", "not an integer"),
                     ("full:k=2", "bad option"), ("every-k:k", "bad option")]:
        with pytest.raises(GcbenchError, match=msg):
            parse_policy(bad)


@pytest.mark.parametrize("policy", ["every-k:k=0", "segments:k=999", "every-k:k=-1"])
def test_k_out_of_range_is_refused_not_clamped(policy):
    with pytest.raises(GcbenchError, match="out of range"):
        tiny_spec(policy=policy)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
@pytest.mark.parametrize("model_name", TINY)
def test_flops_order_with_recompute(classic_records, model_name):
    flops = {p: classic_records[model_name, p]["flops"] for p in CLASSIC}
    model_flops = {classic_records[model_name, p]["model_flops"] for p in CLASSIC}
    assert len(model_flops) == 1  # model FLOPs do not depend on the policy
    assert flops["none"] == model_flops.pop()
    assert flops["none"] < flops["every-k:k=2"] < flops["full"]
    assert flops["segments:k=2"] > flops["none"] and flops["sqrtn"] > flops["none"]
    # full recomputes every block's forward once: at most one extra forward (a third of fwd+bwd)
    assert flops["full"] <= flops["none"] * 4 / 3


@pytest.mark.parametrize("model_name", TINY)
def test_saved_bytes_and_tracked_peak_order(classic_records, model_name):
    saved = {p: classic_records[model_name, p]["saved_activation_bytes"] for p in CLASSIC}
    peak = {p: classic_records[model_name, p]["peak_tracked_bytes"] for p in CLASSIC}
    assert saved["none"] > saved["every-k:k=2"] > saved["full"]
    assert peak["none"] > peak["every-k:k=2"] > peak["full"]
    assert peak["sqrtn"] < peak["none"]


def test_full_saves_exactly_the_block_inputs_plus_the_unwrapped_rest(classic_records):
    """With every block checkpointed, the saving from `none` is all block internals minus one input per block."""
    rec_none, rec_full = classic_records["tiny-gpt2", "none"], classic_records["tiny-gpt2", "full"]
    block_input = 2 * CLASSIC_SEQ * 64 * 4  # batch x seq x hidden x fp32
    saved_full = rec_full["saved_activation_bytes"]
    assert saved_full >= 4 * block_input  # 4 stored block inputs
    assert saved_full < rec_none["saved_activation_bytes"] / 2
