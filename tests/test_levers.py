"""The memory levers beside checkpointing (docs/levers.md): optimizer state, the optimizer's step path, the step
fused into backward, gradient accumulation, precision, and the phase that holds a step's peak."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.results.schema import SCHEMA_VERSION
from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.instruments import CpuInstrument
from gcbench.measure import storage_bytes
from gcbench.models import build_model, find_blocks
from gcbench.optimizers import OPTIMIZERS, optimizer_kind
from gcbench.results.store import read_records
from gcbench.runner import run
from gcbench.cli_options import with_bare_switches
from gcbench.spec import RunSpec
from gcbench.step import OptimizerInBackward, TrainingStep, make_batch, make_optimizer
from tests.helpers import run_as_simulated, tiny_spec

runner = CliRunner()
STEPPING = [name for name, kind in OPTIMIZERS.items() if kind.steps]


def built_step(spec: RunSpec, multi_tensor: bool | None = None, seed: int = 0) -> TrainingStep:
    """The runner's step for `spec` on CPU (fp32), its model built from `seed`."""
    config, _ = spec.model_config()
    torch.manual_seed(seed)
    model = build_model(config, "cpu", spec.param_dtype)
    return TrainingStep(model, make_optimizer(spec, model, multi_tensor), make_batch(spec, config, "cpu"), spec)


# --------------------------------------------------------------------------------------------------- optimizer state


@pytest.mark.parametrize("name", STEPPING)
def test_optimizer_state_per_parameter_matches_its_definition(name):
    spec = tiny_spec(optimizer=name, seq_len=16, precision="fp32")
    step = built_step(spec)
    step()
    optimizer, kind = step.optimizer, optimizer_kind(name)
    for p in step.model.parameters():
        state = {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        n = p.numel()
        if name.startswith("adamw") and name != "adamw8bit":  # two moments of the parameter's shape and dtype
            assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
                "exp_avg": (p.shape, p.dtype), "exp_avg_sq": (p.shape, p.dtype)}
        elif name == "sgd":  # momentum: one buffer
            assert {k: v.shape for k, v in state.items()} == {"momentum_buffer": p.shape}
        elif name == "adafactor":  # a row and a column factor per matrix, a full variance per vector
            if p.dim() > 1:
                assert state["row_var"].shape == (*p.shape[:-1], 1)
                assert state["col_var"].shape == (*p.shape[:-2], 1, p.shape[-1])
            else:
                assert state["variance"].shape == p.shape
        elif name == "adamw8bit":  # one byte per element and state, in blocks with an fp32 absmax each
            if n >= 4096:
                assert state["state1"].dtype == state["state2"].dtype == torch.uint8
                assert state["state1"].numel() == n and state["absmax1"].numel() == math.ceil(n / 256)
            else:
                assert state["state1"].dtype == torch.float32
        # what the estimators count for this parameter is what the optimizer holds (the 0-dim step included)
        held = [v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and not k.startswith("qmap")]
        assert storage_bytes(held) == sum(kind.state(tuple(p.shape), p.element_size(), False))
    # and what it keeps once (bitsandbytes' quantisation maps)
    maps = [v for state in optimizer.state.values() for k, v in state.items() if k.startswith("qmap")]
    shapes = [tuple(p.shape) for p in step.model.parameters()]
    assert storage_bytes(maps) == kind.shared_bytes(shapes, in_backward=False)


def test_state_bytes_per_parameter_of_each_layout():
    """The README's layouts: AdamW in pure bf16 keeps 8 bytes per parameter, under amp 16; SGD 12 (fp32);
    Adafactor a little over 8 (fp32, factored state)."""
    def per_param(**fields):
        e = estimate(tiny_spec(seq_len=16, **fields), "analytic", "cuda")
        return e.state_bytes_per_param

    assert per_param(precision="bf16") == pytest.approx(8, abs=0.2)
    assert per_param(precision="amp-bf16") == pytest.approx(16, abs=0.2)
    assert per_param(precision="fp32", optimizer="sgd") == pytest.approx(12, abs=0.2)
    assert 8 < per_param(precision="fp32", optimizer="adafactor") < 8.5
    assert per_param(precision="fp32", optimizer="adamw", optim_in_backward=True) == pytest.approx(12, abs=0.2)


# --------------------------------------------------------------------------------------------------- the step path


def test_the_loop_optimizer_lowers_the_optimizer_phase_peak():
    """foreach=False (adamw-loop) against the multi-tensor path (what `adamw` takes on CUDA), measured on CPU."""
    def optimizer_peak(name: str, multi_tensor: bool | None) -> int:
        step = built_step(tiny_spec(optimizer=name, seq_len=16, precision="fp32"), multi_tensor)
        step()
        return CpuInstrument("cpu").peak_fields(step, lambda _: None)["optimizer_peak_bytes"]

    multi, loop, fused = optimizer_peak("adamw", True), optimizer_peak("adamw-loop", None), \
        optimizer_peak("adamw-fused", None)
    assert loop < multi
    assert fused < loop


def test_torch_takes_the_step_path_the_estimators_assume_on_cuda():
    """`multi_tensor_on_cuda`: whether torch's functional optimizer picks its multi-tensor path by default (it asks
    _default_to_fused_or_foreach, which says yes for CUDA tensors); Adafactor only takes it when asked."""
    import importlib
    import inspect

    module = importlib.import_module  # torch.optim's package namespace hides these submodules' names
    functional = {"adamw": module("torch.optim.adam").adam, "sgd": module("torch.optim.sgd").sgd,
                  "adafactor": module("torch.optim._adafactor").adafactor}
    for name, fn in functional.items():
        assert ("_default_to_fused_or_foreach" in inspect.getsource(fn)) == OPTIMIZERS[name].multi_tensor_on_cuda
    # and gcbench leaves torch's default in place for them
    params = [nn.Parameter(torch.zeros(2))]
    assert all(OPTIMIZERS[name].build(params).defaults["foreach"] is None for name in functional)


@pytest.mark.parametrize("model,optimizer,policy", [("tiny-llama", "adamw", "none"), ("tiny-gpt2", "sgd", "full")])
def test_optimizer_in_backward_changes_the_weights_as_the_plain_step_and_lowers_the_peak(model, optimizer, policy):
    """Two steps; GPT-2's embedding is tied to its head (one parameter, two uses), under a checkpoint policy."""
    def stepped(in_backward: bool) -> tuple[TrainingStep, list[torch.Tensor]]:
        spec = tiny_spec(model, policy, seq_len=32, precision="fp32", optimizer=optimizer,
                         optim_in_backward=in_backward)
        step = built_step(spec)
        spec.policy.apply(find_blocks(step.model))
        before = [p.detach().clone() for p in step.model.parameters()]
        for seed in (7, 8):
            torch.manual_seed(seed)  # the same dropout masks in both
            step()
        return step, [p.detach() - b for p, b in zip(step.model.parameters(), before)]

    (plain, plain_change), (fused, fused_change) = stepped(False), stepped(True)
    assert isinstance(fused.optimizer, OptimizerInBackward) and fused.grads() == []
    # most parameters moved (at lr 1e-5 an SGD step can vanish below fp32's resolution of a weight near 1)
    assert sum(bool(a.abs().max() > 0) for a in plain_change) > len(plain_change) // 2
    for a, b in zip(plain_change, fused_change):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-9)  # by the same amount (the step is ~1e-5)
    peaks = [CpuInstrument("cpu").peak_fields(s, lambda _: None) for s in (plain, fused)]
    assert peaks[1]["peak_tracked_bytes"] < peaks[0]["peak_tracked_bytes"]
    assert peaks[1]["optimizer_peak_bytes"] is None  # no step after backward


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch():
    """2 micro-batches of 2 rows = one batch of 4 rows (mean-reduced loss), dropout off."""
    def grads(batch: int, accum: int) -> list[torch.Tensor]:
        spec = tiny_spec(seq_len=32, precision="fp32", optimizer="none", batch_size=batch, grad_accum=accum)
        step = built_step(spec)
        step.model.eval()  # no dropout: masks would differ between one batch and two
        step.forward_backward()
        return [p.grad.clone() for p in step.model.parameters()]

    for a, b in zip(grads(4, 1), grads(2, 2)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_accumulation_counts_every_micro_batch_in_tokens_and_flops():
    one, accum = [run(tiny_spec(policy="full", seq_len=32, batch_size=2, grad_accum=n)) for n in (1, 3)]
    assert accum["model_flops"] == 3 * one["model_flops"] and accum["flops"] == 3 * one["flops"]
    assert one["recompute_flops_ratio"] > 0
    assert accum["recompute_flops_ratio"] == pytest.approx(one["recompute_flops_ratio"])
    # what one micro-batch keeps; its token ids are a view of the whole batch's, so their storage counts whole
    assert accum["saved_activation_bytes"] - one["saved_activation_bytes"] == 2 * 2 * 32 * 8
    assert accum["tokens_per_s"] == pytest.approx(3 * 2 * 32 / (accum["step_ms_median"] / 1e3))
    # the memory of one micro-batch: the peak grows by the two more micro-batches' token ids only
    assert accum["peak_tracked_bytes"] - one["peak_tracked_bytes"] == 2 * 2 * 32 * 8


# --------------------------------------------------------------------------------------------------- peak phase


class PhaseModel(nn.Module):
    """A model whose forward, backward and optimizer step each allocate a temporary of a chosen size (elements)."""

    def __init__(self, forward: int, backward: int, optimizer: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(optimizer))  # AdamW's multi-tensor step makes one temporary its size
        self.sizes = forward, backward

    def forward(self, input_ids, labels):
        forward, backward = self.sizes
        temporary = torch.ones(forward)  # freed before forward returns
        loss = (self.weight.sum() + temporary.sum() * 0).reshape(())
        return SimpleNamespace(loss=_BackwardTemporary.apply(loss, backward))


class _BackwardTemporary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size):
        ctx.size = size
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        temporary = torch.ones(ctx.size)
        return grad + temporary.sum() * 0, None


@pytest.mark.parametrize("phase,sizes", [("forward", (400_000, 10, 1_000)), ("backward", (10, 400_000, 1_000)),
                                         ("optimizer", (10, 10, 100_000))])
def test_peak_phase_names_the_phase_that_holds_the_peak(phase, sizes):
    spec = tiny_spec(seq_len=4, precision="fp32")
    model = PhaseModel(*sizes)
    ids = torch.zeros((1, 4), dtype=torch.long)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters(), foreach=True), {"input_ids": ids,
                                                                                     "labels": ids}, spec)
    step()
    fields = CpuInstrument("cpu").peak_fields(step, lambda _: None)
    assert fields["peak_phase"] == phase
    assert fields[f"{phase}_peak_bytes"] == fields["peak_tracked_bytes"]
    assert all(fields[f"{p}_peak_bytes"] < fields["peak_tracked_bytes"] for p in ("forward", "backward", "optimizer")
               if p != phase)


# --------------------------------------------------------------------------------------------------- predictions


@pytest.mark.slow  # five measured runs
@pytest.mark.parametrize("fields", [dict(optimizer="adafactor"), dict(optimizer="adamw8bit"),
                                    dict(optimizer="sgd", optim_in_backward=True), dict(grad_accum=2),
                                    dict(precision="bf16", optimizer="adamw-fused")])
def test_the_simulation_predicts_each_lever_exactly_on_cpu(fields):
    """A CPU run's record carries the simulation's prediction: equal to the measured peak, and so is its phase."""
    record = run_as_simulated(seq_len=32, **fields)
    assert record["predicted_peak_phase"] == record["peak_phase"]


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.parametrize("fields", [dict(optimizer="adamw-loop"), dict(optimizer="adafactor", seq_len=8),
                                    dict(optimizer="adamw8bit"), dict(optim_in_backward=True),
                                    dict(grad_accum=4, precision="amp-bf16")])
@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_the_analytic_model_holds_each_lever_within_10_percent(target, fields):
    spec = tiny_spec(**({"seq_len": 64} | fields))
    analytic, simulated = estimate(spec, "analytic", target), estimate(spec, "simulate", target)
    assert analytic.peak_bytes == pytest.approx(simulated.peak_bytes, rel=0.10)
    assert analytic.peak_phase == simulated.peak_phase
    assert analytic.optimizer_bytes == pytest.approx(simulated.optimizer_bytes, rel=0.10)


def test_estimate_crosses_optimizers_and_shows_where_the_peak_is():
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "8", "--optimizer",
                                 "adamw,adamw-loop", "--method", "analytic", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["optimizer"] for r in rows] == ["adamw", "adamw-loop"]
    # at seq 8 the multi-tensor step's temporary holds the peak on CUDA; the loop moves it to the backward
    assert [r["peak_phase"] for r in rows] == ["optimizer", "backward"]
    assert rows[1]["peak_bytes"] < rows[0]["peak_bytes"]


# --------------------------------------------------------------------------------------------------- the command line


@pytest.mark.slow  # a run and a two-config sweep
def test_run_and_sweep_take_the_levers(tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["--model", "tiny-llama", "--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "1", "--out", str(out)]
    result = runner.invoke(app, ["run", *args, "--optimizer", "adafactor", "--grad-accum", "2"])
    assert result.exit_code == 0, result.output
    assert "peak reached in" in result.output and "B/param" in result.output
    result = runner.invoke(app, ["sweep", *args, "--policy", "none", "--optimizer", "sgd,adamw-loop",
                                 *with_bare_switches(["--optim-in-backward"]), "--isolation", "none", "--no-paired"])
    assert result.exit_code == 0, result.output
    records = read_records(out)
    assert [(r["optimizer"], r["grad_accum"], r["optim_in_backward"]) for r in records] == [
        ("adafactor", 2, False), ("sgd", 1, True), ("adamw-loop", 1, True)]
    assert all(r["status"] == "ok" and r["peak_phase"] in ("forward", "backward", "optimizer") for r in records)


def test_a_grid_crossing_the_optimizer_in_backward_with_accumulation_leaves_those_configs_out():
    from gcbench.grid import SweepSpec

    grid = SweepSpec({"model": ("tiny-llama",), "seq_len": (8,), "batch_size": (1,), "policy": ("none",),
                      "optim_in_backward": (False, True), "grad_accum": (1, 2)})
    assert [(s.optim_in_backward, s.grad_accum) for s in grid.expand()] == [(False, 1), (False, 2), (True, 1)]
    assert grid.left_out().startswith("1 config left out: --optim-in-backward on cannot accumulate")
    alone = SweepSpec({"model": ("tiny-llama",), "seq_len": (8,), "batch_size": (1,), "optim_in_backward": (True,),
                       "grad_accum": (2,)})
    with pytest.raises(GcbenchError, match="cannot accumulate"):
        alone.expand()


def test_a_bare_switch_reaches_the_command_through_the_entry_point(tmp_path, monkeypatch):
    from gcbench import cli

    out = tmp_path / "r.jsonl"
    monkeypatch.setattr("sys.argv", ["gcbench", "run", "--model", "tiny-llama", "--seq", "8", "--warmup", "1",
                                     "--optim-in-backward", "--steps", "1", "--out", str(out)])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 0
    [record] = read_records(out)
    assert record["optim_in_backward"] is True and record["grad_bytes"] == 0


def test_a_bare_switch_means_on():
    assert with_bare_switches(["run", "--optim-in-backward"]) == ["run", "--optim-in-backward", "on"]
    assert with_bare_switches(["--optim-in-backward", "--seq", "8"]) == ["--optim-in-backward", "on", "--seq", "8"]
    assert with_bare_switches(["--optim-in-backward", "off"]) == ["--optim-in-backward", "off"]
    assert with_bare_switches(["sweep", "--predict", "--seq", "8"]) == ["sweep", "--predict", "on", "--seq", "8"]
    # a command's own flag of a run field's name is its own: validate --predict makes the plan's predictions
    assert with_bare_switches(["validate", "--predict"]) == ["validate", "--predict"]


@pytest.mark.parametrize("args,message", [
    (["--optim-in-backward", "on", "--grad-accum", "2"], "cannot accumulate"),
    (["--optim-in-backward", "on", "--optimizer", "none"], "needs an optimizer"),
    (["--optim-in-backward", "maybe"], "expected on or off"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--grad-accum", "0"], "--grad-accum: must be an integer from 1"),
])
def test_bad_lever_input_is_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", "tiny-llama", "--seq", "8", "--out", str(out), *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_adamw8bit_without_bitsandbytes_is_one_clear_line_and_still_predicted(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    out = tmp_path / "r.jsonl"
    for command in (["run"], ["sweep", "--batch", "1"]):
        result = runner.invoke(app, [*command, "--model", "tiny-llama", "--seq", "8", "--optimizer", "adamw8bit",
                                     "--out", str(out)])
        assert result.exit_code == 2 and not out.exists()
        assert "needs bitsandbytes, which is not installed: pip install 'gcbench[bnb]'" in result.output
    # a prediction needs no bitsandbytes for the formulas; the simulation, which runs it, says why it cannot
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "8", "--optimizer", "adamw8bit",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in map(json.loads, result.output.splitlines())}
    assert rows["analytic"]["peak_bytes"] > 0
    assert rows["simulate"]["peak_bytes"] is None and "needs bitsandbytes" in rows["simulate"]["not_available"]
    table = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "8", "--optimizer", "adamw8bit"])
    assert "pip install 'gcbench[bnb]'" in " ".join(table.output.split())  # not eaten as rich markup


def test_version_1_records_read_as_the_defaults_of_the_new_fields(tmp_path):
    record = run(tiny_spec(seq_len=8))
    assert record["schema_version"] == SCHEMA_VERSION
    for name in ("grad_accum", "optim_in_backward", "shard", "nproc"):
        del record[name]
    record["schema_version"] = 1
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(record, default=str) + "\n")
    [read] = read_records(path)
    assert read["grad_accum"] == 1 and read["optim_in_backward"] is False
