"""Encoder-decoders (T5, BART): two stacks of blocks, the policy applied to each on its own, held to what one
stack is held to: gradients equal to `none`'s with dropout on, and the simulation equal to the measured peak."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.models import build_meta_model, find_stacks, load_config
from gcbench.policies import CheckpointedGroup, GroupArguments, apply_to_stacks, parse_policy
from gcbench.runner import run
from tests.helpers import assert_gradients_equal_none, estimate_rows, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
SEQ = 32
# T5's blocks hand the next one their position biases (a tuple the stack's loop unpacks): no group policies
POLICIES = {"tiny-t5": ("full", "every-k", "sac", "attn", "offload"),
            "tiny-bart": ("full", "every-k", "segments:k=2", "sqrtn", "sac", "attn", "offload")}


def _stacks(model: str, policy: str = "none", **overrides) -> list[tuple[str, torch.nn.ModuleList]]:
    config, _ = tiny_spec(model, policy, seq_len=SEQ, **overrides).model_config()
    return find_stacks(build_meta_model(config))


@pytest.mark.parametrize("model,policy", [(m, p) for m, ps in POLICIES.items() for p in ps])
def test_every_policy_gives_none_gradients_on_both_stacks(model, policy):
    assert_gradients_equal_none(model, policy, seq_len=SEQ)


@pytest.mark.parametrize("model", POLICIES)
def test_dropout_changes_the_loss_so_the_gradient_check_is_not_vacuous(model):
    first, _ = gradients(model, "none", dropout_seed=1, seq_len=SEQ)
    second, _ = gradients(model, "none", dropout_seed=2, seq_len=SEQ)
    assert not torch.equal(first, second)


def test_both_stacks_are_found_and_layers_keeps_the_first_blocks_of_each():
    assert [(name, len(blocks)) for name, blocks in _stacks("tiny-bart")] == [("encoder", 3), ("decoder", 2)]
    assert [(name, len(blocks)) for name, blocks in _stacks("tiny-t5", layers=2)] == [("encoder", 2), ("decoder", 2)]
    with pytest.raises(GcbenchError, match="the model has 3 in its encoder and 2 in its decoder"):
        tiny_spec("tiny-bart", layers=3)


def test_an_estimate_row_names_the_stacks_layers_kept_of_each():
    [row] = estimate_rows("--model", "tiny-t5", "--layers", "2", "--seq", "32", "--method", "analytic", "--device",
                          "cpu")
    assert row["stacks"] == "encoder:2,decoder:2" and row["layers"] == 2
    [one] = estimate_rows("--model", "tiny-llama", "--layers", "2", "--seq", "32", "--method", "analytic", "--device",
                          "cpu")
    assert "stacks" not in one  # a model of one stack: its rows keep the keys they had
    # a record of a config not run names them too, as its title does
    record = run(tiny_spec("tiny-t5", layers=2, seq_len=32, memory_cap_bytes=2**20))
    assert record["status"] == "oom" and record["error"].startswith("not run")
    assert (record["stacks"], record["n_layers"], record["family"]) == ("encoder:2,decoder:2", 4, "t5")


def test_a_policy_counts_its_blocks_in_each_stack():
    stacks = [blocks for _, blocks in _stacks("tiny-bart")]
    undo = apply_to_stacks(parse_policy("sqrtn"), stacks)  # encoder: ceil(sqrt(3)) = 2 -> [0, 1], [2]; decoder: [0, 1]
    assert [[type(b) for b in blocks] for blocks in stacks] == [
        [GroupArguments, CheckpointedGroup, CheckpointedGroup], [GroupArguments, CheckpointedGroup]]
    undo()
    assert not any(isinstance(b, (GroupArguments, CheckpointedGroup)) for blocks in stacks for b in blocks)
    with pytest.raises(GcbenchError, match="the decoder has 2 blocks, so k must be 1..2"):
        tiny_spec("tiny-bart", "every-k:k=3")


def test_a_policy_that_names_one_stack_wraps_that_stack_only_and_the_record_says_so():
    stacks = [blocks for _, blocks in _stacks("tiny-bart")]
    policy = parse_policy("full:stack=decoder")
    assert (str(policy), str(parse_policy("full"))) == ("full:stack=decoder", "full")
    undo = apply_to_stacks(policy, stacks)
    assert [[isinstance(b, CheckpointedGroup) for b in blocks] for blocks in stacks] == [[False] * 3, [True] * 2]
    undo()
    record = run_as_simulated("tiny-bart", "sqrtn:stack=encoder", seq_len=SEQ)
    assert record["policy"] == "sqrtn" and record["policy_options"] == {"stack": "encoder"}
    assert_gradients_equal_none("tiny-bart", "sqrtn:stack=encoder", seq_len=SEQ)


@pytest.mark.parametrize("model,policy,words", [
    ("tiny-bart", "full:stack=vision", "stack=vision is not a stack of this model, which has the stacks encoder and "
     "decoder"),
    ("tiny-llama", "full:stack=decoder", "which has one stack of blocks: leave stack out"),
    ("tiny-bart", "every-k:k=3,stack=decoder", "the decoder has 2 blocks, so k must be 1..2")])
def test_a_stack_the_model_lacks_is_refused_in_one_line(model, policy, words):
    with pytest.raises(GcbenchError, match=words):
        tiny_spec(model, policy, seq_len=SEQ)
    tiny_spec("tiny-bart", "every-k:k=3,stack=encoder", seq_len=SEQ)  # the encoder has 3


@pytest.mark.parametrize("policy", ["segments:k=2", "sqrtn"])
def test_t5_refuses_a_group_of_blocks_in_one_line_that_says_why(policy):
    result = runner.invoke(app, ["run", "--model", "tiny-t5", "--seq", "32", "--policy", policy, "--device", "cpu"])
    assert result.exit_code == 2
    assert "T5Stack.forward unpacks each block's output" in result.output
    assert "Traceback" not in result.output


def test_what_two_stacks_cannot_run_yet_is_refused_before_anything_runs():
    with pytest.raises(GcbenchError, match="a plan chooses among one stack's blocks"):
        tiny_spec("tiny-bart", "plan:memory=1GiB")
    with pytest.raises(GcbenchError, match="not an encoder-decoder"):
        tiny_spec("tiny-bart", "full", shard="fsdp2", nproc=2)


def test_a_speech_encoder_decoder_is_refused_for_its_real_reason(tmp_path):
    """Whisper trains (tests/test_speech.py); Speech2Text's encoder reads its features as frames x their channels
    (input_feat_per_channel), not Whisper's log-mel bins x frames: gcbench does not make them up."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "speech_to_text", "d_model": 64, "encoder_layers": 2,
                                "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                "vocab_size": 512}))
    with pytest.raises(GcbenchError, match="speech encoder-decoder whose encoder reads features gcbench does not make "
                                           r"up \(its config has no num_mel_bins\)"):
        load_config(str(path))


@pytest.mark.parametrize("model", POLICIES)
def test_the_simulation_equals_the_measured_peak_and_the_record_names_the_stacks(model):
    record = run_as_simulated(model, "full", seq_len=SEQ)
    assert record["stacks"] == {"tiny-t5": "encoder:3,decoder:3", "tiny-bart": "encoder:3,decoder:2"}[model]
    assert record["n_layers"] == {"tiny-t5": 6, "tiny-bart": 5}[model]


@pytest.mark.slow  # a real run per model and policy (one test each, so that the workers share them)
@pytest.mark.parametrize("model,policy", [(m, p) for m, ps in POLICIES.items() for p in ("none", *ps)])
def test_the_simulation_is_exact_on_cpu_under_every_policy(model, policy):
    run_as_simulated(model, policy, seq_len=64)


def test_presets_estimate_on_a_card_with_each_stack_checkpointed():
    from gcbench.estimators.simulate import simulate

    none, full = (simulate(tiny_spec("flan-t5-base", p, seq_len=256, batch_size=2, layers=2, precision="bf16"),
                           "cuda") for p in ("none", "full"))
    assert full.peak_bytes < none.peak_bytes
    assert none.param_bytes == full.param_bytes > 0


def test_a_command_given_no_policy_runs_the_defaults_the_model_takes_and_names_the_rest(tmp_path):
    from gcbench.grid import SweepSpec

    grid = SweepSpec.load(None, {"model": "tiny-t5", "seq": "32", "batch": "1", "device": "cpu",
                                 "out": str(tmp_path / "r.jsonl")})
    assert [spec.policy.name for spec in grid.expand()] == ["none", "full", "every-k"]
    assert "left out for tiny-t5: sqrtn: T5Stack.forward unpacks" in grid.left_out()
    named = SweepSpec.load(None, {"model": "tiny-t5", "seq": "32", "batch": "1", "policy": "sqrtn", "device": "cpu",
                                  "out": str(tmp_path / "r.jsonl")})
    with pytest.raises(GcbenchError, match="sqrtn: T5Stack.forward unpacks"):
        named.expand()


@pytest.mark.slow  # a fit searched by simulation, per default policy
def test_a_fit_given_no_policy_searches_the_defaults_the_model_takes():
    result = runner.invoke(app, ["estimate", "--model", "tiny-t5", "--seq", "32", "--fit", "--gpu-memory", "64MiB",
                                 "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["policy"] for line in result.stdout.splitlines()][:3] == ["none", "full", "sac:mm=all"]


def test_a_classifier_head_on_an_encoder_decoder_is_refused_in_one_line():
    result = runner.invoke(app, ["run", "--model", "tiny-t5", "--seq", "32", "--head", "seq-cls", "--device", "cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--head seq-cls: t5 is an encoder-decoder" in result.output


def test_a_loop_over_enumerated_blocks_is_read_too(tmp_path):
    """LongT5 runs its blocks as `for i, layer_module in enumerate(self.block)`, unpacking each output."""
    from gcbench.models import build_meta_model, group_refusal

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "longt5", "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                                "num_heads": 4, "vocab_size": 256}))
    config, _ = load_config(str(path))
    assert "LongT5Stack.forward unpacks each block's output" in group_refusal(config, build_meta_model)
    assert group_refusal(load_config("tiny-bart")[0], build_meta_model) is None


def test_default_policies_need_no_sequence_when_the_fit_varies_it(tmp_path):
    """A fit over the sequence, given no --policy, leaves the sequence to the search (no length is made up)."""
    from gcbench.resolved import runnable_defaults

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128,
                                "n_positions": 64}))
    assert runnable_defaults(("none", "sqrtn"), {"model": str(path)}) == (["none", "sqrtn"], [])


@pytest.mark.parametrize("decoder,words", [(0, "num_decoder_layers must be a positive integer"),
                                           (10**8, "the decoder's layers must be at most 1,000")])
def test_a_decoder_of_no_blocks_or_millions_is_refused_before_anything_is_built(tmp_path, decoder, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5", "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                                "num_heads": 4, "vocab_size": 256, "num_decoder_layers": decoder}))
    with pytest.raises(GcbenchError, match=words):
        load_config(str(path))
