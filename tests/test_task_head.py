"""--head seq-cls: transformers' sequence-classification head through the same Auto-class path as the language
models (issue 31, item 2): built, trained and simulated as the run does it, its math unchanged by checkpointing,
refused in one line where a family has no such head or an estimator cannot describe it."""

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.grid import SweepSpec
from gcbench.estimators.analytic import unavailable
from gcbench.models import auto_class, build_model
from gcbench.runner import run
from gcbench.step import make_batch
from tests.helpers import assert_gradients_equal_none, assert_refused, run_as_simulated, tiny_spec

runner = CliRunner()


def _config(tmp_path, **fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=256, max_position_embeddings=512)


@pytest.mark.parametrize("model, head_class", [("tiny-llama", "LlamaForSequenceClassification"),
                                               ("tiny-bert", "BertForSequenceClassification")])
def test_the_head_chooses_the_model_class_and_one_label_per_sequence(model, head_class):
    lm, cls = tiny_spec(model), tiny_spec(model, head="seq-cls")
    assert auto_class(lm.config) is not transformers.AutoModelForSequenceClassification
    assert auto_class(cls.config) is transformers.AutoModelForSequenceClassification
    batch = make_batch(cls, cls.config, "cpu")
    assert batch["labels"].shape == (2,) and batch["labels"].dtype == torch.long and not batch["labels"].any()
    lm_batch = make_batch(lm, lm.config, "cpu")
    assert lm_batch["labels"] is lm_batch["input_ids"]  # a language model: the tokens are the labels
    model_ = build_model(cls.config, "cpu", torch.float32)
    assert type(model_).__name__ == head_class
    out = model_(**batch)
    assert out.logits.shape == (2, cls.config.num_labels) and out.loss.ndim == 0


def test_a_decoder_without_a_pad_token_takes_its_eos_else_id_0(tmp_path):
    spec = tiny_spec(_config(tmp_path, **LLAMA, eos_token_id=[7, 9]), head="seq-cls")
    assert spec.config.pad_token_id == 7  # batches of several sequences need one: transformers refuses otherwise
    assert run(tiny_spec(spec.model, head="seq-cls", seq_len=32))["status"] == "ok"
    bare = _config(tmp_path, **LLAMA, eos_token_id=None)
    assert tiny_spec(bare, head="seq-cls").config.pad_token_id == 0
    assert run(tiny_spec(bare, head="seq-cls", seq_len=32))["status"] == "ok"
    assert tiny_spec(bare).config.pad_token_id is None  # the LM run of the same config is untouched


def test_a_family_without_a_classifier_head_is_refused_in_one_line(tmp_path):
    path = _config(tmp_path, model_type="codegen", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512,
                   rotary_dim=8)
    assert tiny_spec(path).head == "lm"
    result = runner.invoke(app, ["estimate", "--model", path, "--head", "seq-cls", "--seq", "32"])
    assert_refused(result, "codegen models have no sequence-classification head")


def test_a_classifiers_config_trains_its_lm_head_unless_asked(tmp_path):
    path = _config(tmp_path, **LLAMA, problem_type="single_label_classification", pad_token_id=0)
    assert auto_class(tiny_spec(path).config) is transformers.AutoModelForCausalLM
    assert auto_class(tiny_spec(path, head="seq-cls").config) is transformers.AutoModelForSequenceClassification


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
@pytest.mark.parametrize("policy", ["full", "sqrtn", "sac"])
def test_every_policy_gives_nones_gradients_with_the_classifier(model, policy):
    assert_gradients_equal_none(model, policy, head="seq-cls")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_the_simulation_predicts_the_classifiers_measured_peak_exactly_on_cpu(model):
    record = run_as_simulated(model, "full", head="seq-cls", seq_len=64)
    assert record["head"] == "seq-cls"
    lm = run(tiny_spec(model, "full", seq_len=64))
    assert lm["head"] == "lm" and lm["param_bytes"] != record["param_bytes"]  # another head, other weights


def test_what_cannot_describe_a_classifier_says_so():
    spec = tiny_spec("tiny-llama", head="seq-cls")
    assert "--head seq-cls" in unavailable(spec)
    assert unavailable(tiny_spec("tiny-llama")) is None
    with pytest.raises(GcbenchError, match="seq-cls"):
        tiny_spec("tiny-llama", head="seq-cls", loss="chunked")


def test_the_command_line_takes_the_head_and_refuses_an_unknown_one():
    result = runner.invoke(app, ["estimate", "--model", "tiny-bert", "--head", "seq-cls,lm", "--seq", "64",
                                 "--method", "simulate"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["seq"])
    rows = [dict(zip(header, line.split())) for line in lines if line.split()[:1] == ["64"]]
    assert {row["head"] for row in rows} == {"seq-cls", "lm"}  # one row per head, the head in its column
    simulated = {row["head"]: row["peak"] for row in rows if row["method"] == "simulate"}
    assert simulated["seq-cls"] != simulated["lm"]
    bad = runner.invoke(app, ["estimate", "--model", "tiny-bert", "--head", "token-cls", "--seq", "64"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "--head" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_sweep_over_both_heads_builds_each_its_own_model(tmp_path):
    """Configs that share a model config share one build (grid.py): the head is part of what they must share."""
    toml = tmp_path / "sweep.toml"
    toml.write_text('model = "tiny-llama"\nseq = 32\nbatch = 2\nhead = ["lm", "seq-cls"]\npolicy = "none"\n'
                    'device = "cpu"\n')
    specs = SweepSpec.load(toml).expand()
    assert [(s.head, s.config.problem_type) for s in specs] == [("lm", None),
                                                                ("seq-cls", "single_label_classification")]


def test_adapter_targets_are_looked_up_per_head(tmp_path):
    """A classifier's `score` layer is a LoRA target an LM of the same config does not have, whichever is asked
    first (adapters.check_targets remembers what it found per kind of model)."""
    assert tiny_spec("tiny-llama", head="seq-cls", adapter="lora:targets=score").head == "seq-cls"
    with pytest.raises(GcbenchError, match="targets score name no linear layer"):
        tiny_spec("tiny-llama", adapter="lora:targets=score")
