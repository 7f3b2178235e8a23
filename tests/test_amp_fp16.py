"""--precision amp-fp16: fp32 weights under fp16 autocast with torch.amp.GradScaler (step.TrainingStep.scaler).
Checkpointing keeps its gradients; both predictors count the scaler's memory; CPU measurements equal the
simulation byte for byte; what it cannot run with is one line."""

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.estimators.shape import CUDA_BLOCK_BYTES
from gcbench.grid import SweepSpec
from gcbench.models import build_model, find_blocks
from gcbench.spec import RunSpec
from gcbench.step import TrainingStep, make_batch, make_optimizer
from tests.helpers import CLASSIC, TINY, run_as_simulated, tiny_spec

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default init_scale


def scaled_step(model_name: str, policy: str, **overrides) -> TrainingStep:
    """The runner's amp-fp16 step on CPU, its model built from seed 0, the policy applied."""
    spec = tiny_spec(model_name, policy, precision="amp-fp16", seq_len=32, **overrides)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, "cpu", spec.param_dtype)
    spec.policy.apply(find_blocks(model))
    return TrainingStep(model, make_optimizer(spec, model), make_batch(spec, config, "cpu"), spec)


def unscaled_gradients(model_name: str, policy: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, gradients unscaled by the scaler) of one amp-fp16 forward and scaled backward, dropout seeded."""
    step = scaled_step(model_name, policy)
    torch.manual_seed(1)
    step.model.zero_grad(set_to_none=False)
    loss = step.forward()
    step.scaler.scale(loss).backward()
    step.scaler.unscale_(step.optimizer)
    return loss.detach(), [p.grad.clone() for p in step.model.parameters()]


def test_the_step_autocasts_to_fp16_scales_the_loss_and_steps():
    step = scaled_step("tiny-llama", "none")
    assert step.scaler is not None and step.scaler.get_scale() == INIT_SCALE
    assert [t.dtype for t in step.scaler_state()] == [torch.float32, torch.int32]  # made with the step: static
    assert all(p.dtype == torch.float32 for p in step.model.parameters())  # fp32 master weights
    with step._autocast():
        logits = step.model(**step.micro_batches[0]).logits
    assert logits.dtype == torch.float16
    before = [p.detach().clone() for p in step.model.parameters()]
    torch.manual_seed(1)
    step.forward_backward()
    loss_grads = [p.grad.clone() for p in step.model.parameters()]
    step.optimizer_step()
    # no inf/NaN in the tiny model's gradients: the optimizer stepped, the scale did not back off
    assert step.scaler.get_scale() == INIT_SCALE
    assert any(not torch.equal(p, b) for p, b in zip(step.model.parameters(), before))
    assert all(g.dtype == torch.float32 for g in loss_grads)
    # the gradients were scaled by the scale and unscaled in place before the step
    for g_scaled, p in zip(loss_grads, step.model.parameters()):
        torch.testing.assert_close(p.grad * INIT_SCALE, g_scaled)


def test_not_a_scaler_in_the_other_precisions():
    for precision in ("fp32", "amp-bf16"):
        spec = tiny_spec(precision=precision, seq_len=8)
        config, _ = spec.model_config()
        model = build_model(config, "cpu", spec.param_dtype)
        step = TrainingStep(model, make_optimizer(spec, model), make_batch(spec, config, "cpu"), spec)
        assert step.scaler is None and step.scaler_state() == []


@pytest.mark.parametrize("model_name,policy", [("tiny-llama", p) for p in CLASSIC if p != "none"]
                         + [(m, "full") for m in TINY if m != "tiny-llama"])
def test_gradients_equal_none_under_amp_fp16(model_name, policy):
    loss_ref, ref = unscaled_gradients(model_name, "none")
    loss, got = unscaled_gradients(model_name, policy)
    torch.testing.assert_close(loss, loss_ref)
    assert all(torch.isfinite(g).all() for g in ref)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_the_simulation_predicts_an_amp_fp16_run_exactly_on_cpu():
    record = run_as_simulated(seq_len=32, precision="amp-fp16")
    assert record["predicted_peak_phase"] == record["peak_phase"]
    assert record["mfu"] is None  # a CPU has no known peak


@pytest.mark.slow  # four measured runs
@pytest.mark.parametrize("fields", [dict(grad_accum=2), dict(model="tiny-gpt2", policy="full"),
                                    dict(model="tiny-gpt2", optimizer="adamw-fused"),
                                    dict(optimizer="adafactor", policy="sac")])
def test_the_simulation_predicts_each_amp_fp16_lever_exactly_on_cpu(fields):
    record = run_as_simulated(**({"seq_len": 32, "precision": "amp-fp16"} | fields))
    assert record["predicted_peak_phase"] == record["peak_phase"]


@pytest.mark.parametrize("model,target,scalar",  # one in the default suite (it neared its 5 minutes), all in CI
                         [pytest.param(m, "cuda", CUDA_BLOCK_BYTES, marks=() if m == "tiny-llama" else pytest.mark.slow)
                          for m in TINY] + [pytest.param("tiny-llama", "cpu", 4, marks=pytest.mark.slow)])
def test_both_predictors_count_the_scaler_alike(model, target, scalar):
    """Over amp-bf16 (the same activations: fp16 and bf16 are both 2 bytes, autocast's op lists are the dtype's
    alike): the scale and growth tracker from the start, the scaled loss through backward, found_inf's per-device
    copy through the optimizer's step."""
    for method in ("simulate", "analytic"):
        bf16, fp16 = (estimate(tiny_spec(model, seq_len=32, precision=p), method, target)
                      for p in ("amp-bf16", "amp-fp16"))
        added = {f: getattr(fp16, f) - getattr(bf16, f) for f in
                 ("forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "optimizer_bytes")}
        assert added == {"forward_peak_bytes": 2 * scalar, "backward_peak_bytes": 3 * scalar,
                         "optimizer_peak_bytes": 3 * scalar, "optimizer_bytes": 0}, (method, added)


def test_the_analytic_model_holds_amp_fp16_within_10_percent():
    spec = tiny_spec(seq_len=64, precision="amp-fp16", grad_accum=2)
    for target in ("cuda", "cpu"):
        a, s = estimate(spec, "analytic", target), estimate(spec, "simulate", target)
        assert a.peak_bytes == pytest.approx(s.peak_bytes, rel=0.10) and a.peak_phase == s.peak_phase


@pytest.mark.parametrize("fields,message", [
    (dict(optim_in_backward=True), "not with --precision amp-fp16"),
    (dict(shard="fsdp2"), "--precision amp-fp16 with --shard fsdp2 is not supported"),
])
def test_what_amp_fp16_cannot_run_with_is_one_line(fields, message):
    with pytest.raises(GcbenchError, match=message) as raised:
        RunSpec(model="tiny-llama", seq_len=8, batch_size=1, precision="amp-fp16", **fields)
    assert "\n" not in str(raised.value)


def test_the_command_line_refuses_in_one_line_exit_2(tmp_path):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", "tiny-llama", "--seq", "8", "--out", str(out),
                                      "--precision", "amp-fp16", "--optim-in-backward", "on"])
    assert result.exit_code == 2
    assert "amp-fp16" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_grid_crossing_amp_fp16_with_the_optimizer_in_backward_leaves_those_out():
    grid = SweepSpec({"model": ("tiny-llama",), "seq_len": (8,), "batch_size": (1,), "policy": ("none",),
                      "precision": ("amp-bf16", "amp-fp16"), "optim_in_backward": (False, True)})
    assert [(s.precision, s.optim_in_backward) for s in grid.expand()] == [
        ("amp-bf16", False), ("amp-bf16", True), ("amp-fp16", False)]
    assert "amp-fp16" in grid.left_out()


def test_estimate_and_run_take_amp_fp16_on_the_command_line(tmp_path):
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "16", "--batch", "1",
                                      "--precision", "amp-fp16"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["run", "--model", "tiny-llama", "--seq", "16", "--batch", "1", "--warmup", "1",
                                      "--steps", "1", "--precision", "amp-fp16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert '"precision": "amp-fp16"' in out.read_text()
