"""Speech encoder-decoders (Whisper): log-mel features in, text targets out, the encoder's and the decoder's blocks
checkpointed as a text encoder-decoder's are and held to the same exactness; and an encoder-decoder's target length
of its own (--target-len) on T5, BART and Whisper."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.fields import setup_words
from gcbench.modality import auto_class, target_tokens
from gcbench.models import build_meta_model, find_stacks, load_config
from gcbench.step import make_batch
from tests.helpers import assert_gradients_equal_none, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
SEQ = 16  # tiny-whisper: 16 positions per sample, from 32 frames of log-mel features (its conv stem halves them)
POLICIES = ("full", "every-k", "segments:k=2", "sqrtn", "sac", "attn", "offload", "full:stack=encoder")
# The keys of openai/whisper-small's config.json (https://huggingface.co/openai/whisper-small/blob/main/config.json),
# generation settings and token lists included (suppress_tokens shortened): a user's file, not edited for gcbench
WHISPER_SMALL = {
    "_name_or_path": "openai/whisper-small", "activation_dropout": 0.0, "activation_function": "gelu",
    "architectures": ["WhisperForConditionalGeneration"], "attention_dropout": 0.0, "begin_suppress_tokens": [220, 50257],
    "bos_token_id": 50257, "d_model": 768, "decoder_attention_heads": 12, "decoder_ffn_dim": 3072,
    "decoder_layerdrop": 0.0, "decoder_layers": 12, "decoder_start_token_id": 50258, "dropout": 0.0,
    "encoder_attention_heads": 12, "encoder_ffn_dim": 3072, "encoder_layerdrop": 0.0, "encoder_layers": 12,
    "eos_token_id": 50257, "forced_decoder_ids": [[1, 50259], [2, 50359], [3, 50363]], "init_std": 0.02,
    "is_encoder_decoder": True, "max_length": 448, "max_source_positions": 1500, "max_target_positions": 448,
    "model_type": "whisper", "num_hidden_layers": 12, "num_mel_bins": 80, "pad_token_id": 50257,
    "scale_embedding": False, "suppress_tokens": [1, 2, 7, 8, 9, 10, 14, 25, 50360, 50361, 50362],
    "torch_dtype": "float32", "transformers_version": "4.27.0.dev0", "use_cache": True, "vocab_size": 51865}


@pytest.fixture(scope="module")
def whisper_small(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("whisper-small") / "config.json"
    path.write_text(json.dumps(WHISPER_SMALL))
    return str(path)


def refused(result, *words) -> None:
    """Exit code 2, one line on stderr naming `words`, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert "Traceback" not in result.output


# every-k (k=2) and segments (k=2) on stacks of 2 blocks differ from full and sqrtn only in which block is wrapped
@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.slow) if p in ("every-k", "segments:k=2") else p
                                    for p in POLICIES])
def test_every_policy_gives_none_gradients_on_both_stacks(policy):
    assert_gradients_equal_none("tiny-whisper", policy, seq_len=SEQ)


def test_dropout_changes_the_loss_so_the_gradient_check_is_not_vacuous():
    first, _ = gradients("tiny-whisper", "none", dropout_seed=1, seq_len=SEQ)
    second, _ = gradients("tiny-whisper", "none", dropout_seed=2, seq_len=SEQ)
    assert not torch.equal(first, second)


def test_the_inputs_are_log_mel_features_and_target_ids_into_two_stacks():
    spec = tiny_spec("tiny-whisper", seq_len=SEQ)
    assert auto_class(spec.config) is transformers.AutoModelForSpeechSeq2Seq
    batch = make_batch(spec, spec.config, "cpu")
    assert set(batch) == {"input_features", "labels"}
    assert batch["input_features"].shape == (2, 80, 32) and batch["input_features"].dtype == torch.float32
    assert batch["labels"].shape == (2, SEQ)  # as long as --seq: within the decoder's 32 positions
    assert [(name, len(blocks), type(blocks[0]).__name__) for name, blocks in find_stacks(
        build_meta_model(spec.config))] == [("encoder", 2, "WhisperEncoderLayer"), ("decoder", 2, "WhisperDecoderLayer")]
    bf16 = tiny_spec("tiny-whisper", seq_len=SEQ, precision="bf16")  # the conv stem takes the weights' dtype
    assert make_batch(bf16, bf16.config, "cpu")["input_features"].dtype == torch.bfloat16


def test_a_published_config_json_runs_unedited_and_its_targets_default_to_the_decoders_positions(whisper_small):
    spec = tiny_spec(whisper_small, seq_len=1500, batch_size=1, layers=1)
    assert spec.family == "whisper" and target_tokens(spec.config, 1500) == 448
    assert [len(blocks) for _, blocks in find_stacks(build_meta_model(spec.config))] == [1, 1]
    assert target_tokens(spec.config, 1500, 100) == 100 and target_tokens(load_config("tiny-t5")[0], 32) == 32


def test_the_simulation_equals_the_measured_peak_and_the_record_names_the_target():
    from gcbench.report.run_table import run_table

    record = run_as_simulated("tiny-whisper", "full", seq_len=SEQ, target_len=24)
    assert record["stacks"] == "encoder:2,decoder:2" and record["target_len"] == 24
    assert "seq 16 · target 24 · batch 2" in str(run_table(record).title)
    assert setup_words(record) == "target 24 · fp32 · adamw"


@pytest.mark.slow  # a real run per policy (one test each, so that the workers share them)
@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_the_simulation_is_exact_on_cpu_under_every_policy(policy):
    run_as_simulated("tiny-whisper", policy, seq_len=SEQ)


@pytest.mark.slow  # about 30 s: a 59M-parameter model at 1,500 positions
def test_a_published_config_json_runs_one_block_of_each_stack_exactly(whisper_small):
    run_as_simulated(whisper_small, seq_len=1500, batch_size=1, layers=1)


@pytest.mark.parametrize("args,words", [
    (["--model", "tiny-whisper", "--seq", "20"], ("reads 32 frames of log-mel features", "give --seq 16")),
    (["--model", "tiny-llama", "--seq", "16", "--target-len", "8"], ("--target-len 8", "not an encoder-decoder")),
    (["--model", "tiny-whisper", "--seq", "16", "--target-len", "33"],
     ("--target-len 33 exceeds the 32 positions", "max_target_positions")),
    (["--model", "tiny-bart", "--seq", "16", "--target-len", "2049"], ("exceeds the 2048 positions",)),
    (["--model", "tiny-whisper", "--seq", "16", "--target-len", "0"], ("--target-len", "from 1")),
    (["--model", "tiny-whisper", "--seq", "16", "--loss", "chunked"], ("whisper is an encoder-decoder",)),
    (["--model", "tiny-whisper", "--seq", "16", "--head", "seq-cls"], ("its speech-to-text head",)),
])
def test_bad_input_is_one_line_before_anything_runs(args, words):
    refused(runner.invoke(app, ["run", *args, "--device", "cpu"]), *words)


@pytest.mark.parametrize("change,words", [({"num_mel_bins": 0}, "num_mel_bins must be a positive integer"),
                                          ({"max_source_positions": -3}, "max_source_positions must be a positive"),
                                          ({"max_target_positions": "448"}, "max_target_positions must be a positive")])
def test_a_whisper_config_that_cannot_be_trained_is_one_line(tmp_path, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**WHISPER_SMALL, **change}))
    refused(runner.invoke(app, ["estimate", "--model", str(path), "--seq", "1500", "--device", "cpu"]), *words)


@pytest.mark.parametrize("model", ["tiny-t5", "tiny-bart"])
def test_a_text_encoder_decoder_takes_a_target_length_of_its_own(model):
    spec = tiny_spec(model, seq_len=32, target_len=12)
    batch = make_batch(spec, spec.config, "cpu")
    assert batch["input_ids"].shape == (2, 32) and batch["labels"].shape == (2, 12)
    default = tiny_spec(model, seq_len=32)
    assert make_batch(default, default.config, "cpu")["labels"].shape == (2, 32)  # as long as --seq


@pytest.mark.parametrize("model", [pytest.param("tiny-t5", marks=pytest.mark.slow), "tiny-bart"])
def test_the_simulation_equals_the_measured_peak_with_targets_shorter_than_the_input(model):
    run_as_simulated(model, "full", seq_len=32, target_len=12)


def test_estimate_takes_target_lengths_as_an_axis_and_names_them():
    result = runner.invoke(app, ["estimate", "--model", "tiny-t5", "--seq", "32", "--target-len", "8,64", "--policy",
                                 "none", "--method", "simulate", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    short, long = (json.loads(line) for line in result.stdout.splitlines())
    assert (short["target_len"], long["target_len"]) == (8, 64) and short["peak_bytes"] < long["peak_bytes"]


@pytest.mark.slow  # four simulations of a CUDA step at 1,500 positions: about 30 s
def test_a_preset_is_estimated_for_a_card_with_the_adapters_that_apply():
    result = runner.invoke(app, ["estimate", "--model", "whisper-small", "--seq", "1500", "--policy", "none,full",
                                 "--adapter", "none,lora", "--layers", "1", "--gpu", "h100-80gb", "--method",
                                 "simulate", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {(r["policy"], r["adapter"]): r for r in map(json.loads, result.stdout.splitlines())}
    assert rows["full", "none"]["peak_bytes"] < rows["none", "none"]["peak_bytes"]
    assert rows["none", "lora"]["optimizer_bytes"] < rows["none", "none"]["optimizer_bytes"]
    assert rows["none", "none"]["attention_kernel"] == "flash"


@pytest.mark.slow  # a search of simulations per policy: about 30 s
def test_a_fit_is_predicted_for_the_policies_the_model_takes():
    result = runner.invoke(app, ["estimate", "--model", "tiny-whisper", "--seq", "16", "--fit", "--gpu-memory",
                                 "16MiB", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert {"none", "full", "sqrtn"} <= set(rows) and rows["full"]["value"] > rows["none"]["value"] >= 1


@pytest.mark.slow  # real trials in child processes
def test_fit_answers_with_real_trials(tmp_path):
    result = runner.invoke(app, ["fit", "--model", "tiny-whisper", "--seq", "16", "--memory", "12MiB", "--device",
                                 "cpu", "--policy", "none,full", "--range", "1..64", "--steps", "1", "--no-paired",
                                 "--out", str(tmp_path / "fit.jsonl")])
    assert result.exit_code == 0, result.output
    # which one is recommended is the faster one: a matter of this machine's speed; the batches are of memory
    assert "recommended:" in result.output
    records = [json.loads(line) for line in (tmp_path / "fit.jsonl").read_text().splitlines()]
    largest = {p: max(r["batch_size"] for r in records if r["policy"] == p and r["status"] == "ok")
               for p in ("none", "full")}
    assert largest["full"] > largest["none"] >= 1
    for policy, batch in largest.items():  # the next batch up ran out of the 12 MiB
        assert any(r["policy"] == policy and r["batch_size"] == batch + 1 and r["status"] == "oom" for r in records)


def test_an_encoder_that_refuses_its_features_is_one_line_naming_them(tmp_path):
    from gcbench.blocks import speech_input
    from gcbench.errors import GcbenchError

    config = load_config("tiny-whisper")[0]
    config.read_by = str(tmp_path)  # a config of its own: nothing cached for it yet

    def refusing(config):
        model = build_meta_model(config)
        encoder = model.get_encoder()

        def forward(*args, **kwargs):
            raise ValueError("expects other features")

        encoder.forward = forward
        return model

    frames = config.max_source_positions * 2  # Whisper's conv stem: strides 1 and 2
    with pytest.raises(GcbenchError, match=rf"^tiny-whisper: transformers cannot encode {frames} frames of "
                                           rf"{config.num_mel_bins} log-mel bins with this config: expects other "
                                           r"features$"):
        speech_input(config, refusing, "tiny-whisper")
    assert speech_input(config, build_meta_model) == (frames, config.max_source_positions)
