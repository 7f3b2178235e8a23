"""Image classifiers (ViT, SigLIP's vision tower): pixel values in, a label per image, the blocks found and
checkpointed by the same rule as a language model's, held to the same exactness."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.models import build_meta_model, find_stacks, image_tokens, load_config
from tests.helpers import assert_gradients_equal_none, estimate_rows, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
TOKENS = 17  # tiny-vit: 32x32 images of 8x8 patches, and its class token
SIGLIP = dict(model_type="siglip", vision_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                      intermediate_size=128, image_size=32, patch_size=8,
                                                      attention_dropout=0.1),
              text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               vocab_size=256))


@pytest.fixture(scope="module")
def siglip(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("siglip") / "config.json"
    path.write_text(json.dumps(SIGLIP))
    return str(path)


@pytest.mark.parametrize("policy", ["full", "every-k", "segments:k=2", "sqrtn", "sac", "attn", "offload"])
def test_every_policy_gives_none_gradients_on_an_image_classifier(policy):
    assert_gradients_equal_none("tiny-vit", policy, seq_len=TOKENS)


def test_dropout_changes_the_loss_so_the_gradient_check_is_not_vacuous():
    first, _ = gradients("tiny-vit", "none", dropout_seed=1, seq_len=TOKENS)
    second, _ = gradients("tiny-vit", "none", dropout_seed=2, seq_len=TOKENS)
    assert first != second


def test_the_tokens_per_image_are_read_off_the_model_and_seq_must_name_them(siglip):
    assert image_tokens(load_config("tiny-vit")[0], build_meta_model) == 17  # 16 patches and ViT's class token
    assert image_tokens(load_config(siglip)[0], build_meta_model) == 16  # SigLIP adds none
    with pytest.raises(GcbenchError, match=r"reads 32x32 images, 17 tokens each .*give --seq 17"):
        tiny_spec("tiny-vit", seq_len=64)
    with pytest.raises(GcbenchError, match="trains its own head"):
        tiny_spec("tiny-vit", seq_len=TOKENS, head="seq-cls")


def test_siglips_blocks_are_its_vision_towers_and_layers_cuts_them(siglip):
    config, _ = tiny_spec(siglip, seq_len=16, layers=2).model_config()
    [(name, blocks)] = find_stacks(build_meta_model(config))
    assert name == "blocks" and len(blocks) == 2 and type(blocks[0]).__name__ == "SiglipEncoderLayer"


@pytest.mark.parametrize("model,tokens", [("tiny-vit", TOKENS), ("siglip", 16)])
def test_the_simulation_equals_the_measured_peak(siglip, model, tokens):
    """The labels (one int64 per image) are a tensor of the batch: the simulation holds them as the run does."""
    run_as_simulated(siglip if model == "siglip" else model, "none", seq_len=tokens)


@pytest.mark.slow  # a real run per policy
def test_the_simulation_is_exact_on_cpu_under_every_policy():
    for policy in ("full", "sqrtn", "sac", "attn", "offload"):
        run_as_simulated("tiny-vit", policy, seq_len=TOKENS)


def test_a_preset_is_estimated_for_a_card_in_one_command():
    none, full = estimate_rows("--model", "vit-base", "--seq", "197", "--batch", "64", "--policy", "none,full",
                               "--layers", "2", "--gpu", "h100-80gb", "--method", "simulate")
    assert full["peak_bytes"] < none["peak_bytes"] and none["attention_kernel"] == "flash"


@pytest.mark.parametrize("change,words", [({"image_size": 0}, "image_size must be a positive integer"),
                                          ({"patch_size": 64}, "cannot embed a 32x32 image"),
                                          ({"num_channels": -1}, "num_channels must be a positive integer")])
def test_an_image_config_that_cannot_be_trained_is_one_line(tmp_path, change, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
                                "patch_size": 8, **change}))
    result = runner.invoke(app, ["estimate", "--model", str(path), "--seq", "17", "--device", "cpu"])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


def test_a_build_that_fails_while_reading_the_image_tokens_is_one_line_and_ours_passes_through(tmp_path):
    config = load_config("tiny-vit")[0]
    config.read_by = str(tmp_path)  # a config of its own: nothing cached for it yet

    def failing(_):
        raise RuntimeError("no\nweights here")

    with pytest.raises(GcbenchError, match=r"^tiny-vit: transformers cannot build this model with this config: "
                                           r"no weights here$"):
        image_tokens(config, failing, "tiny-vit")

    def refusing(_):
        raise GcbenchError("said by gcbench")

    with pytest.raises(GcbenchError, match=r"^said by gcbench$"):
        image_tokens(config, refusing, "tiny-vit")
    assert image_tokens(config, build_meta_model) == 17  # 16 patches and the class token, once it builds
