"""--loss: the chunked cross-entropy is the model's own loss (value and gradients, under every policy, with gradient
accumulation), lowers the tracked peak by what the estimators say, and fused-linear is refused on CPU, predicted
for CUDA from liger-kernel's code and run through liger's loss on (fake) CUDA."""

import importlib.machinery
import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.losses import parse_loss
from gcbench.models import build_model, find_blocks
from gcbench.policies import parse_policy
from gcbench.resolved import resolve
from gcbench.runner import run
from gcbench.spec import RunSpec
from gcbench.step import TrainingStep, make_batch
from tests.families import FAMILY_CONFIGS
from tests.helpers import policy_examples, tiny_spec

runner = CliRunner()
# A tiny llama whose logits dominate: vocabulary 32k, hidden 64, so the batch x seq x vocab fp32 logits (32 MiB at
# 256 tokens) outweigh everything else the step holds.
BIG_VOCAB = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32768, max_position_embeddings=512, tie_word_embeddings=False)


def step_gradients(model, policy="none", loss="ce", dropout_seed=1, train=True, **overrides):
    """(loss, gradients in parameter order) of one fp32 training step's forward and backward (dropout on, the same
    seeds), through TrainingStep, so that --loss is the step's own."""
    spec = tiny_spec(model, policy, precision="fp32", loss=loss, seq_len=64, **overrides)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    net = build_model(config, "cpu", torch.float32).train(train)
    params = list(net.parameters())
    spec.policy.apply(find_blocks(net))
    step = TrainingStep(net, None, make_batch(spec, config, "cpu"), spec)
    torch.manual_seed(dropout_seed)
    total = 0.0
    for micro_batch in step.micro_batches:
        value = step.forward(micro_batch)
        value.backward()
        total += value.detach()
    return total, [p.grad for p in params]


def assert_same(got, ref, **tolerance):
    torch.testing.assert_close(got[0], ref[0])
    assert all(g is not None for g in got[1]) and len(got[1]) == len(ref[1])
    for g, r in zip(got[1], ref[1]):
        torch.testing.assert_close(g, r, **tolerance)


_REFERENCES: dict = {}


def reference(model, policy="none", loss="ce", **overrides):
    """step_gradients, once per test session for the same arguments (the references several tests compare to)."""
    key = (model, str(policy), loss, tuple(sorted(overrides.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = step_gradients(model, policy, loss, **overrides)
    return _REFERENCES[key]


@pytest.mark.parametrize("model, loss", [("tiny-llama", "chunked"), ("tiny-llama", "chunked:n=128"),
                                         ("tiny-gpt2", "chunked:n=3"),  # gpt2: the head tied to the embedding
                                         ("tiny-llama", "litgpt"), ("tiny-llama", "litgpt:len=7"),
                                         ("tiny-gpt2", "litgpt:len=9"),
                                         ("tiny-llama", "litgpt:len=99999999999999999999")])  # one slice
def test_chunked_loss_and_gradients_equal_the_models_own(model, loss):
    assert_same(step_gradients(model, loss=loss), reference(model))


@pytest.mark.parametrize("loss", ["chunked:n=5", "litgpt:len=10"])
def test_chunked_with_gradient_accumulation_equals_ce(loss):
    assert_same(step_gradients("tiny-llama", loss=loss, grad_accum=2), step_gradients("tiny-llama", grad_accum=2))


@pytest.mark.parametrize("policy", ["full", "sqrtn", "sac"])
def test_gradients_under_a_policy_equal_none_with_litgpts_loss(policy):
    assert_same(step_gradients("tiny-llama", policy, loss="litgpt:len=10"),
                reference("tiny-llama", loss="litgpt:len=10"))


def test_litgpts_loss_keeps_every_slices_logits_in_fp32_until_its_backward_is_done():
    """LitGPT's finetune scripts hold the list of the slices' logits through the backward (their `logits`), which
    Fabric hands them in fp32."""
    spec = tiny_spec("tiny-llama", "none", precision="bf16", loss="litgpt:len=10", seq_len=64)
    config, _ = spec.model_config()
    net = build_model(config, "cpu", torch.bfloat16).train()
    step = TrainingStep(net, None, make_batch(spec, config, "cpu"), spec)
    loss = step.forward()
    assert [t.shape[1] for t in step.held] == [10] * 6 + [3]  # 64 positions in slices of 10, the last one cut
    assert all(t.shape[-1] == config.vocab_size and t.dtype == torch.float32 and t.grad_fn is not None
               for t in step.held)
    loss.backward()
    step.forward_backward()
    assert step.held == []


def test_analytic_refuses_litgpts_loss_and_simulate_predicts_it():
    spec = tiny_spec("tiny-llama", "none", loss="litgpt")
    with pytest.raises(GcbenchError, match="no formulas for --loss litgpt"):
        estimate(spec, "analytic", "cuda")
    assert estimate(spec, "simulate", "cuda").peak_bytes > 0


def _policies():
    plan = parse_policy("plan:memory=64MiB,allow_offload=true").with_mix({"offload": 1, "full": 1, "sac": 1,
                                                                         "attn": 1})
    return [p for p in policy_examples() if not p.startswith("plan") and not parse_policy(p).compiles
            and p != "none"] + [plan]


@pytest.mark.parametrize("policy", _policies(), ids=str)
def test_gradients_under_every_policy_equal_none_with_chunked_loss(policy):
    assert_same(step_gradients("tiny-llama", policy, loss="chunked:n=3"), reference("tiny-llama", loss="chunked:n=3"))


@pytest.mark.slow  # torch.compile on 2 CPU cores
@pytest.mark.parametrize("policy", [p for p in policy_examples() if parse_policy(p).compiles])
def test_gradients_under_a_compiling_policy_equal_none_with_chunked_loss(policy):
    """Compiled blocks draw other dropout masks than eager ones, whatever the loss: compared with dropout off and
    the tolerance of fused kernels' reordered sums, as tests/test_policies_beyond.py compares them with `ce`."""
    assert_same(step_gradients("tiny-llama", policy, loss="chunked:n=3", train=False),
                step_gradients("tiny-llama", loss="chunked:n=3", train=False), rtol=1e-4, atol=1e-6)


def test_dropout_is_on_in_the_chunked_step():
    """Another dropout draw gives another loss: the policy tests above do replay the RNG."""
    assert not torch.equal(step_gradients("tiny-llama", loss="chunked:n=3", dropout_seed=2)[0],
                           reference("tiny-llama", loss="chunked:n=3")[0])


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("big-vocab") / "config.json"
    path.write_text(json.dumps(BIG_VOCAB))
    return str(path)


@pytest.mark.slow  # seconds on 2 cores: CI's slow set runs it (the default suite stays under 5 minutes)
def test_chunked_lowers_the_tracked_peak_as_the_estimate_says_and_each_loss_simulates_exactly(big_vocab):
    fields = dict(model=big_vocab, seq_len=128, batch_size=2, device="cpu", precision="fp32", optimizer="sgd",
                  warmup_steps=1, measure_steps=1)
    logits = 2 * 128 * BIG_VOCAB["vocab_size"] * 4  # the fp32 logits of the batch: 32 MiB
    measured, simulated, analytic = {}, {}, {}
    for loss in ("ce", "chunked", "litgpt"):
        spec = RunSpec(**fields, loss=loss)
        record = run(spec)
        assert record["status"] == "ok", record.get("error")
        measured[loss] = record["peak_tracked_bytes"]
        simulated[loss] = estimate(spec, "simulate", "cpu").peak_bytes
        if loss != "litgpt":  # the analytic model has no formulas for it
            analytic[loss] = estimate(spec, "analytic", "cpu").peak_bytes
    drop = measured["ce"] - measured["chunked"]
    # ce's backward holds log-softmax's fp32 output and its two fp32 gradients (3 x the logits); chunked holds an
    # eighth of those, plus the head's weight gradient waiting for the other chunks' (here 0.25 x the logits)
    assert 2 * logits < drop < 3 * logits
    assert drop == simulated["ce"] - simulated["chunked"]  # the simulation is exact on CPU
    assert measured == simulated
    assert analytic["ce"] - analytic["chunked"] == pytest.approx(drop, rel=0.01)


def test_fused_linear_is_predicted_for_cuda_and_refused_for_a_cpu_target(big_vocab):
    spec = RunSpec(model=big_vocab, seq_len=128, batch_size=2, device="cpu", loss="fused-linear")
    ce = estimate(RunSpec(model=big_vocab, seq_len=128, batch_size=2, device="cpu"), "simulate", "cuda")
    simulated, analytic = estimate(spec, "simulate", "cuda"), estimate(spec, "analytic", "cuda")
    assert simulated.peak_bytes < ce.peak_bytes
    assert analytic.peak_bytes == pytest.approx(simulated.peak_bytes, rel=0.01)
    for method in ("simulate", "analytic"):
        with pytest.raises(GcbenchError, match="CUDA only"):
            estimate(spec, method, "cpu")


def test_loss_values_are_parsed_and_written_one_way():
    assert str(parse_loss("chunked:n=8")) == str(parse_loss("chunked")) == "chunked"
    assert str(parse_loss("chunked:n=4")) == "chunked:n=4" and parse_loss("chunked:n=4").chunks == 4
    assert str(parse_loss("litgpt:len=128")) == str(parse_loss("litgpt")) == "litgpt"
    assert str(parse_loss("litgpt:len=64")) == "litgpt:len=64" and parse_loss("litgpt:len=64").length == 64
    assert resolve(RunSpec(model="tiny-llama", seq_len=8, batch_size=1, device="cpu", loss="chunked:n=8")).loss == \
        "chunked"
    for bad, words in [("bogus", "unknown loss"), ("chunked:n=0", "at least 1"), ("chunked:n=x", "whole number"),
                       ("chunked:k=2", "one option"), ("ce:n=2", "no options"), ("chunked:", "nothing after"),
                       ("chunked:n=9", "more chunks than the 8 tokens"), ("litgpt:n=2", "one option, len"),
                       ("litgpt:len=0", "at least 1"), ("litgpt:len=1.5", "whole number")]:
        with pytest.raises(GcbenchError, match=words):
            resolve(RunSpec(model="tiny-llama", seq_len=8, batch_size=1, device="cpu", loss=bad))
    with pytest.raises(GcbenchError, match="--shard fsdp2 is not supported"):  # FSDP2's root hooks: the model's forward
        resolve(RunSpec(model="tiny-llama", seq_len=8, batch_size=1, device="cpu", loss="chunked", shard="fsdp2",
                        nproc=2))


@pytest.mark.parametrize("family, why", [("gemma2", "final_logit_softcapping"), ("bert", "masked-LM head")])
def test_a_head_that_cannot_be_chunked_exactly_is_refused(tmp_path, family, why):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, **FAMILY_CONFIGS[family]}))
    for loss in ("chunked", "fused-linear"):
        with pytest.raises(GcbenchError, match=why):
            resolve(RunSpec(model=str(path), seq_len=16, batch_size=1, device="cpu", loss=loss))


def _refused(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words) and "Traceback" not in result.output, result.stderr


RUN = ["run", "--model", "tiny-llama", "--seq", "16", "--batch", "1", "--device", "cpu", "--warmup", "1", "--steps",
       "1"]


def test_fused_linear_on_cpu_and_bad_values_exit_2_with_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(runner.invoke(app, [*RUN, "--loss", "fused-linear"]), "--loss fused-linear needs CUDA",
             "--loss chunked")
    _refused(runner.invoke(app, [*RUN, "--loss", "chunky"]), "--loss", "unknown loss")
    _refused(runner.invoke(app, [*RUN, "--loss", "chunked:n=0"]), "--loss chunked", "at least 1")
    _refused(runner.invoke(app, ["estimate", "--model", "tiny-bert", "--seq", "16", "--batch", "1", "--loss",
                                 "chunked"]), "--loss chunked", "masked-LM")
    assert not (tmp_path / "results").exists()


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss as plain torch (the real one needs Triton), recording
    what it is called with: the run path to it is what is tested."""
    calls = []

    class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
        def __init__(self, ignore_index=-100):
            super().__init__()
            self.ignore_index = ignore_index

        def forward(self, lin_weight, _input, target, bias=None):
            calls.append((tuple(lin_weight.shape), tuple(_input.shape), tuple(target.shape)))
            logits = torch.nn.functional.linear(_input, lin_weight, bias).float()
            return torch.nn.functional.cross_entropy(logits, target, ignore_index=self.ignore_index)

    package, transformers_ = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    transformers_.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    package.transformers = transformers_
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_)
    return calls


def test_fused_linear_runs_through_liger_on_cuda(fake_cuda, fake_liger):
    spec = resolve(RunSpec(model="tiny-llama", seq_len=64, batch_size=2, device="cuda", loss="fused-linear",
                           warmup_steps=1, measure_steps=2))
    record = run(spec)
    assert record["status"] == "ok", record.get("error")
    assert record["loss"] == "fused-linear" and record["predicted_peak_bytes_analytic"] is not None
    config, _ = spec.model_config()
    # liger's call: the head's weight (vocab x hidden), the hidden states (tokens x hidden), the shifted labels
    assert fake_liger[0] == ((config.vocab_size, config.hidden_size), (128, config.hidden_size), (128,))


def test_fused_linear_without_liger_is_refused_on_cuda(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # importlib.util.find_spec: not installed
    spec = resolve(RunSpec(model="tiny-llama", seq_len=16, batch_size=1, device="cuda", loss="fused-linear"))
    with pytest.raises(GcbenchError, match=r"gcbench\[liger\]"):
        spec.check_runnable()
