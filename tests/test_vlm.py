"""Vision-language models (LLaVA): two stacks of blocks, the vision tower's and the language model's, the policy
applied to each on its own; the text's ids with each image's placeholders, pixel values beside them; held to what
one stack is held to: gradients equal to `none`'s with dropout on, the simulation equal to the measured peak."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.models import build_meta_model, count_params, find_stacks, load_config
from gcbench.policies import CheckpointedGroup, GroupArguments, apply_to_stacks, parse_policy
from gcbench.step import make_batch
from tests.helpers import estimate_rows, gradients, run_as_simulated, tiny_spec

runner = CliRunner()
SEQ = 32  # text tokens; tiny-llava's 32x32 image of 8x8 patches adds 16 (its CLS token dropped: "default")
TOKENS = 16
# llava-hf/llava-1.5-7b-hf's config.json as published (https://huggingface.co/llava-hf/llava-1.5-7b-hf)
LLAVA_15 = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
            "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
            "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                            "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                            "torch_dtype": "float16", "vocab_size": 32064},
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
            "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                              "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                              "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}


def _unused(model_name: str = "tiny-llava") -> list[str]:
    """The parameters no loss reaches: LLaVA takes the features of the tower's second-to-last block
    (vision_feature_layer -2), so its last block and post-layernorm get no gradient, under any policy."""
    config, _ = tiny_spec(model_name, seq_len=SEQ).model_config()
    return [name for name, _ in build_meta_model(config).named_parameters()
            if ".encoder.layers.2." in name or "post_layernorm" in name]


def assert_gradients_equal_none(policy: str, **overrides) -> None:
    """As tests.helpers' check, where a parameter without a gradient under none has none under the policy too."""
    loss_ref, ref = gradients("tiny-llava", "none", seq_len=SEQ, **overrides)
    loss, got = gradients("tiny-llava", policy, seq_len=SEQ, **overrides)
    torch.testing.assert_close(loss, loss_ref)
    assert [g is None for g in got] == [r is None for r in ref] and sum(r is None for r in ref) == len(_unused())
    for g, r in zip(got, ref):
        if r is not None:
            torch.testing.assert_close(g, r)


@pytest.mark.parametrize("policy", ["full", "attn", "offload"])
def test_every_policy_gives_none_gradients_on_both_stacks(policy):
    assert_gradients_equal_none(policy)


@pytest.mark.slow  # the rest of the classic policies, and two images a sample
@pytest.mark.parametrize("policy", ["every-k", "segments:k=2", "sqrtn", "sac", "full:stack=vision"])
def test_the_other_policies_give_none_gradients_too(policy):
    assert_gradients_equal_none(policy)
    assert_gradients_equal_none(policy, images=2)


def test_dropout_changes_the_loss_so_the_gradient_check_is_not_vacuous():
    first, _ = gradients("tiny-llava", "none", dropout_seed=1, seq_len=SEQ)
    second, _ = gradients("tiny-llava", "none", dropout_seed=2, seq_len=SEQ)
    assert not torch.equal(first, second)


def test_both_stacks_are_found_in_forward_order_and_layers_keeps_the_first_blocks_of_each():
    config, _ = tiny_spec("tiny-llava", seq_len=SEQ).model_config()
    stacks = find_stacks(build_meta_model(config))
    assert [(name, len(b), type(b[0]).__name__) for name, b in stacks] == [
        ("vision", 3, "CLIPEncoderLayer"), ("language", 3, "LlamaDecoderLayer")]
    config, _ = tiny_spec("tiny-llava", seq_len=SEQ, layers=2).model_config()
    assert [(name, len(b)) for name, b in find_stacks(build_meta_model(config))] == [("vision", 2), ("language", 2)]
    with pytest.raises(GcbenchError, match="the model has 3 in its vision and 3 in its language"):
        tiny_spec("tiny-llava", seq_len=SEQ, layers=4)


def test_a_policy_counts_its_blocks_in_each_stack():
    config, _ = tiny_spec("tiny-llava", seq_len=SEQ).model_config()
    stacks = [blocks for _, blocks in find_stacks(build_meta_model(config))]
    undo = apply_to_stacks(parse_policy("sqrtn"), stacks)  # ceil(sqrt(3)) = 2 in each: [0, 1], [2]
    assert [[type(b) for b in blocks] for blocks in stacks] == 2 * [[GroupArguments, CheckpointedGroup,
                                                                      CheckpointedGroup]]
    undo()
    assert not any(isinstance(b, (GroupArguments, CheckpointedGroup)) for blocks in stacks for b in blocks)
    undo = apply_to_stacks(parse_policy("sqrtn:stack=language"), stacks)  # the tower left as it is
    assert [any(isinstance(b, CheckpointedGroup) for b in blocks) for blocks in stacks] == [False, True]
    undo()


@pytest.mark.parametrize("images", [1, 2])
def test_the_batch_holds_each_images_placeholders_and_the_text(images):
    spec = tiny_spec("tiny-llava", seq_len=SEQ, images=images, batch_size=2)
    config, _ = spec.model_config()
    batch = make_batch(spec, config, "cpu")
    ids, labels, pixels = batch["input_ids"], batch["labels"], batch["pixel_values"]
    assert ids.shape == (2, SEQ + images * TOKENS) and pixels.shape == (2 * images, 3, 32, 32)
    image = ids == config.image_token_id
    assert image[:, :images * TOKENS].all() and not image[:, images * TOKENS:].any()  # no stray placeholder
    assert (labels[image] == -100).all() and torch.equal(labels[~image], ids[~image])


def test_the_simulation_equals_the_measured_peak_and_the_record_names_the_stacks():
    record = run_as_simulated("tiny-llava", "full", seq_len=SEQ)
    assert record["stacks"] == "vision:3,language:3" and record["n_layers"] == 6 and record["images"] == 1


@pytest.mark.slow  # a real run each (one test each, so that the workers share them)
@pytest.mark.parametrize("policy,overrides", [
    *((policy, {}) for policy in ("none", "every-k", "segments:k=2", "sqrtn", "sac", "attn", "offload")),
    *(("full", overrides) for overrides in ({"images": 2}, {"images": 2, "grad_accum": 2}, {"adapter": "lora"},
                                             {"loss": "chunked"}, {"loss": "litgpt"}))])
def test_the_simulation_is_exact_on_cpu_under_every_policy(policy, overrides):
    run_as_simulated("tiny-llava", policy, seq_len=SEQ, **overrides)


def test_lora_adapts_the_language_model_alone():
    """peft's all-linear would adapt the vision tower and the projector too; LLaVA's recipe leaves them out."""
    from gcbench.adapters import apply_adapter, parse_adapter

    config, _ = tiny_spec("tiny-llava", seq_len=SEQ, adapter="lora").model_config()
    model = apply_adapter(build_meta_model(config), parse_adapter("lora"), torch.float32, "meta")
    adapted = {name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_" in name}
    assert len(adapted) == 3 * 7 and all(".language_model.layers." in name for name in adapted)


def test_the_chunked_loss_equals_the_models_own():
    from gcbench.models import build_model
    from gcbench.step import TrainingStep

    losses = []
    for loss in ("ce", "chunked"):
        spec = tiny_spec("tiny-llava", "none", seq_len=SEQ, loss=loss, precision="fp32")
        torch.manual_seed(0)
        model = build_model(spec.config, "cpu", torch.float32).eval()
        losses.append(TrainingStep(model, None, make_batch(spec, spec.config, "cpu"), spec).forward())
    torch.testing.assert_close(losses[0], losses[1])


def test_the_published_llava_config_runs_as_it_is(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAVA_15))
    config, family = load_config(str(path))
    assert family == "llava" and count_params(build_meta_model(config)) == 7_063_427_072  # 7.06 B, as its card
    spec = tiny_spec(str(path), seq_len=512, layers=2)
    assert spec.config._image_tokens == 576  # (336 / 14)^2 patches, the CLS token dropped
    assert count_params(build_meta_model(load_config("llava-1.5-7b")[0])) == 7_063_427_072


@pytest.mark.slow  # a simulation of two blocks of each stack at 7B's widths
def test_the_preset_is_estimated_for_a_card():
    none, full = estimate_rows("--model", "llava-1.5-7b", "--seq", "512", "--batch", "16", "--layers", "2",
                               "--policy", "none,full", "--gpu", "h100-80gb", "--method", "simulate")
    assert full["peak_bytes"] < none["peak_bytes"]


def test_a_gemma3_config_with_a_vision_tower_is_a_vlm_and_without_one_its_text_model(tmp_path):
    text = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 64, "patch_size": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text, "vision_config": vision,
                                "mm_tokens_per_image": 16, "image_token_index": 299}))
    spec = tiny_spec(str(path), seq_len=16)
    assert spec.family == "gemma3" and spec.config._image_tokens == 16  # 8x8 patches pooled to 4x4
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))  # no tower described
    assert load_config(str(path))[1] == "gemma3_text"


@pytest.mark.parametrize("args,words", [
    (["--model", "tiny-llama", "--images", "2"], "--images 2: this llama model has no vision tower"),
    (["--model", "tiny-llava", "--images", "0"], "--images"),
    (["--model", "tiny-llava", "--head", "seq-cls"], "llava is a vision-language model"),
    (["--model", "tiny-llava", "--seq", "2040"], "would see 2056 tokens, beyond its 2048 positions"),
    (["--model", "tiny-llava", "--policy", "plan:memory=1GiB"], "a vision-language model's two"),
])
def test_bad_input_is_one_line(args, words):
    result = runner.invoke(app, ["estimate", "--seq", "32", *args, "--device", "cpu"])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("change,words", [({"patch_size": 64}, "cannot embed a 32x32 image"),
                                          ({"image_size": 0}, "vision_config's image_size must be a positive")])
def test_a_vision_config_that_cannot_be_trained_is_one_line(tmp_path, change, words):
    from gcbench.presets import MODELS

    data = json.loads(json.dumps(MODELS["tiny-llava"].config))
    data["vision_config"].update(change)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    result = runner.invoke(app, ["estimate", "--model", str(path), "--seq", "32", "--device", "cpu"])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


def test_a_vlm_whose_tower_gcbench_cannot_feed_is_refused_for_that_reason(tmp_path):
    """Qwen2-VL's tower reads images of any size (flattened patches and their grid); its text model has no causal-LM
    head of its own in transformers: the refusal names the tower, not the text model's missing head."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": 2, "embed_dim": 64,
                                                                              "hidden_size": 64, "num_heads": 4},
                                "text_config": {"model_type": "qwen2_vl_text", "hidden_size": 64,
                                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                                "num_key_value_heads": 2, "intermediate_size": 128,
                                                "vocab_size": 512}}))
    with pytest.raises(GcbenchError, match="qwen2_vl is a vision-language model whose vision tower gcbench makes no "
                                           r"inputs for .* its text model \(qwen2_vl_text\) has no causal-LM head"):
        load_config(str(path))
