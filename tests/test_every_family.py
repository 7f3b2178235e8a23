"""Every transformers family gcbench may meet: a config.json of nothing but its model_type resolves, or is refused
in one GcbenchError line, never another exception. And Gemma 4's text model, whose layers differ (per-layer configs:
gcbench/per_layer.py), trains under every policy with none's gradients and is simulated to the byte."""

from __future__ import annotations

import json
import re
import signal

import pytest
import torch
import transformers
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators.analytic import unavailable
from gcbench.estimators.shape import Shape
from gcbench.models import describe
from gcbench.resolved import resolve
from gcbench.spec import RunSpec
from tests.helpers import CLASSIC, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
G4 = "tiny-gemma4"  # 4 blocks: local/global layers of head size 16/32, the last 2 reusing the first 2's keys/values
SEQ = 64  # beyond its sliding window of 16: the local and global layers' masks differ
# Families that crashed with a traceback (a probe of every family, transformers 5.24): per-layer configs, and image
# classifiers fed no image of a fixed size
CRASHED = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma4_unified_assistant",
           "diffusion_gemma", "diffusion_gemma_text", "dots3_note", "dots3_note_text", "embedding_gemma2",
           "embedding_gemma2_text", "imagegpt", "siglip2")


def resolve_family(family: str, tmp_path) -> str:
    """"ok", or the one line gcbench refuses a config.json of only this model_type with (any other exception
    fails the test)."""
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps({"model_type": family}))
    try:
        resolve(RunSpec(model=str(path), seq_len=32, batch_size=1, policy="full", device="cpu"))
    except GcbenchError as e:
        assert "\n" not in str(e)
        return str(e)
    return "ok"


@pytest.mark.parametrize("family,answer", [("gemma4_text", "ok"), ("dots3_note_text", "ok"),
                                           ("embedding_gemma2_text", "no causal-LM or masked-LM head"),
                                           ("gemma4_unified_assistant", r"num_kv_shared_layers \(30\) covers all 30"),
                                           ("imagegpt", "reads input_ids, .* has no num_channels or image_size"),
                                           ("siglip2", "reads pixel_values, pixel_attention_mask, .* no image_size")])
def test_a_family_that_crashed_resolves_or_is_refused_in_one_line(tmp_path, family, answer):
    got = resolve_family(family, tmp_path)
    assert got == "ok" if answer == "ok" else re.search(answer, got), got


@pytest.mark.slow  # every family of the probe that crashed (about 15 s)
@pytest.mark.parametrize("family", CRASHED)
def test_every_family_that_crashed_resolves_or_is_refused(tmp_path, family):
    resolve_family(family, tmp_path)


@pytest.mark.slow  # every family transformers has: about 75 s on 2 cores, in 4 shares the workers split
@pytest.mark.parametrize("share", range(4))
def test_no_family_fails_with_anything_but_one_line(tmp_path, share):
    def stop(*_):
        raise TimeoutError

    crashed, before = {}, signal.signal(signal.SIGALRM, stop)
    try:
        for family in sorted(transformers.CONFIG_MAPPING.keys())[share::4]:
            signal.alarm(60)  # a family that takes a minute to resolve is a failure too
            try:
                resolve_family(family, tmp_path)
            except BaseException as e:  # noqa: BLE001 - what the test is for
                crashed[family] = f"{type(e).__name__}: {str(e)[:120]}"
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, before)
    assert not crashed, crashed


def test_gemma4s_layers_are_read_one_by_one():
    config, family = tiny_spec(G4, seq_len=SEQ).model_config()
    assert family == "gemma4_text" and config.per_layer_attributes == {"head_dim", "num_key_value_heads"}
    assert [(c.head_dim, c.num_key_value_heads) for c in config.per_layer_config] == [(16, 2), (32, 1)] * 2
    row = describe(G4)
    assert (row["heads"], row["kv_heads"], row["hidden"]) == (4, "2,1", 64)
    # the analytic model would take one head size for all layers: n/a, and its shape refuses to guess
    assert "layers differ (head_dim, num_key_value_heads per layer" in unavailable(tiny_spec(G4, seq_len=SEQ))
    with pytest.raises(GcbenchError, match=r"takes one num_key_value_heads for every layer.*\(2, 1"):
        Shape.of(tiny_spec(G4, seq_len=SEQ), config)


def test_layers_keeps_the_first_layers_own_values_and_shared_kv_layers():
    config, _ = tiny_spec(G4, seq_len=SEQ, layers=3).model_config()
    assert [c.head_dim for c in config.per_layer_config] == [16, 32, 16]
    assert config.num_kv_shared_layers == 1 and config.kv_sharing_modes == ["store", "store", "reuse"]
    assert tiny_spec(G4, seq_len=SEQ, layers=2).model_config()[0].num_kv_shared_layers == 0


def test_full_and_a_group_across_the_shared_kv_boundary_give_nones_gradients():
    """segments:k=3 groups blocks 0-2: the group runs both producers of the shared keys and values and the first
    layer that reuses them, and block 3 reads what the group's blocks left; the per-layer inputs go to each block."""
    loss, ref = gradients(G4, "none", seq_len=SEQ)
    other, _ = gradients(G4, "none", dropout_seed=2, seq_len=SEQ)
    assert loss != other  # dropout is on: the check is not vacuous
    for policy in ("full", "segments:k=3"):
        got_loss, got = gradients(G4, policy, seq_len=SEQ)
        torch.testing.assert_close(got_loss, loss)
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r)


@pytest.mark.slow  # a forward and backward per policy
@pytest.mark.parametrize("policy", [p for p in CLASSIC if p != "none"] + ["sac", "attn", "offload", "offload:what=all"])
def test_every_policy_gives_nones_gradients(policy):
    from tests.helpers import assert_gradients_equal_none

    assert_gradients_equal_none(G4, policy, seq_len=SEQ)


def test_the_simulation_equals_the_measured_peak():
    run_as_simulated(G4, "sqrtn", seq_len=SEQ)


@pytest.mark.slow  # a real run per policy
@pytest.mark.parametrize("policy", ["none", "full", "every-k", "segments:k=3", "sac", "attn", "offload"])
def test_the_simulation_is_exact_under_every_policy(policy):
    run_as_simulated(G4, policy, seq_len=SEQ)


@pytest.mark.parametrize("change,words", [
    ({"global_head_dim": 0}, "layer 1: head_dim must be a positive integer, got 0"),
    ({"per_layer_config": {"3": {"num_attention_heads": 0}}}, "layer 3: num_attention_heads must be a positive"),
    ({"num_global_key_value_heads": 3}, "layer 1: num_key_value_heads (3) must divide num_attention_heads (4)")])
def test_a_bad_per_layer_value_is_one_line(tmp_path, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "global_head_dim": 32, "attention_k_eq_v": True, "vocab_size": 256,
                                "layer_types": ["sliding_attention", "full_attention"] * 2, **change}))
    result = runner.invoke(app, ["estimate", "--model", str(path), "--seq", "64", "--device", "cpu"])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
