"""What several test modules share: the tiny models, the classic policies, a small spec, and the gradient check.
Test modules import these from here, never from each other or from conftest."""

import torch

from gcbench.models import block_lists, build_model
from gcbench.policies import POLICIES, apply_to_stacks, classic
from gcbench.resolved import ResolvedRun, resolve
from gcbench.runner import run
from gcbench.spec import RunSpec
from gcbench.step import make_batch

TINY = ("tiny-llama", "tiny-gpt2", "tiny-bert")
# Every policy of policies/classic.py at its default options ("every-k:k=2"), in registry order: a new classic
# policy is tested without being listed here.
CLASSIC = tuple(str(cls()) for cls in POLICIES.values() if cls.__module__ == classic.__name__)


# conftest's classic_records and the tests that hold predictions against them: long enough that activations
# outweigh the weights (the analytic model's 10% is a claim about activations), short enough for a cheap CPU step
CLASSIC_SEQ = 128


def run_as_simulated(model="tiny-llama", policy="none", **overrides) -> dict:
    """The record of a real CPU run of tiny_spec(model, policy, **overrides), predicted beforehand by the
    simulation, asserted ok and predicted to the byte (the CPU's live-tensor peak, exact by construction): what a
    test of a family, policy or lever then asserts more of."""
    record = run(tiny_spec(model, policy, predict=True, **overrides))
    said = (model, policy, overrides, record.get("error"))
    assert record["status"] == "ok" and record["prediction_method"] == "simulate", said
    assert record["predicted_peak_bytes"] == record["peak_tracked_bytes"], said
    return record


def assert_refused(result, message: str, context: object = None) -> None:
    """A CLI result (typer's CliRunner) that refused its input as the quality bar asks: exit code 2, `message` in
    one line on stderr, no traceback. `context`: what a failure names beside what was said (the arguments)."""
    said = (result.stderr or result.output, context)
    assert result.exit_code == 2, said
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, said
    assert "Traceback" not in result.output, said


def estimate_rows(*args: str) -> list[dict]:
    """`gcbench estimate *args --format json`, in this process: asserted to succeed, its rows (one JSON line each)."""
    import json

    from typer.testing import CliRunner

    from gcbench.cli import app

    result = CliRunner().invoke(app, ["estimate", *args, "--format", "json"])
    assert result.exit_code == 0 and not result.stderr, result.output  # nothing but the rows
    return [json.loads(line) for line in result.stdout.splitlines()]


def policy_examples() -> list[str]:
    """Every registered policy as one would give it: its name, or its example where an option is required."""
    return [cls.example or name for name, cls in POLICIES.items()]


def tiny_spec(model="tiny-llama", policy="none", **overrides) -> ResolvedRun:
    """A small config, resolved (its policy parsed, its model config built)."""
    fields = dict(model=model, seq_len=128, batch_size=2, policy=policy, device="cpu", warmup_steps=1,
                  measure_steps=1)
    return resolve(RunSpec(**(fields | overrides)))


def gradients(model_name: str, policy, dropout_seed: int = 1, device: str = "cpu", **overrides):
    """(loss, gradients of the trainable parameters in order) of one fp32 forward+backward under `policy` (a string,
    or a Policy: a plan with its mix chosen)."""
    spec = tiny_spec(model_name, policy, device=device, precision="fp32", **overrides)
    config, _ = spec.model_config()
    torch.manual_seed(0)
    model = build_model(config, device, torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]  # Whisper's encoder positions are fixed
    apply_to_stacks(spec.policy, block_lists(model))  # an encoder-decoder's two
    torch.manual_seed(dropout_seed)
    loss = model(**make_batch(spec, config, device)).loss
    loss.backward()
    return loss.detach(), [p.grad for p in params]


def assert_gradients_equal_none(model_name: str, policy, device: str = "cpu", **overrides) -> None:
    """The policy's loss and every parameter's gradient equal those of `none` (same seeds, dropout on)."""
    loss_ref, ref = gradients(model_name, "none", device=device, **overrides)
    loss, got = gradients(model_name, policy, device=device, **overrides)
    torch.testing.assert_close(loss, loss_ref)
    assert len(got) == len(ref) and all(g is not None for g in got)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def estimate_axes(models, seq_lens, batch_sizes, policies) -> dict:
    """estimate_grid's axes for the four main ones."""
    return {"model": models, "seq_len": seq_lens, "batch_size": batch_sizes, "policy": policies}


class FakeClock:
    """perf_counter that moves only when told: a fake step advances it by its own duration (no real timing)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def spend(self, ms: float) -> float:
        self.now += ms / 1e3
        return ms


def load_script(path) -> object:
    """A script of the repository (benchmarks/...) imported as a module, by its path."""
    import importlib.util
    from pathlib import Path

    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem + "_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
