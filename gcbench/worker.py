"""Measure one RunSpec in this process and return its Record (a flat dict, one JSON line in the results file).

The fixed sequence (DESIGN.md, "Measurement protocol"); what differs between devices is the instrument's
(measure.CpuInstrument, measure.CudaInstrument):
  build on the device -> wrap blocks with the policy -> warm-up steps (optimizer state exists after step 1)
  -> timed steps (CUDA: synchronize, reset peaks, baseline, events around the step; CPU: perf_counter)
  -> CPU only: one untimed step under the live-tensor tracker
  -> one untimed forward+backward counting saved-activation bytes and FLOPs with recompute
  -> one untimed forward+backward without the policy: model FLOPs (the MFU numerator).
Gradients are zeroed in place (set_to_none=False): they are static memory like parameters and optimizer state,
so everything above the step's starting baseline is activations and temporaries.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from gcbench.env import capture_env
from gcbench.errors import GcbenchError
from gcbench.measure import (CpuInstrument, CudaInstrument, Progress, SavedActivations, counting_flops, instrument_for,
                             storage_bytes)
from gcbench.models import build_meta_model, build_model, count_params, find_blocks
from gcbench.results import SCHEMA_VERSION
from gcbench.spec import RunSpec

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per parameter
GiB = 2**30


class TrainingStep:
    """One training step on a fixed random batch, split in the two phases whose memory is reported apart."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: dict, spec: RunSpec):
        self.model, self.optimizer, self.batch = model, optimizer, batch
        self.device = torch.device(spec.device)
        dtype, device_type = spec.autocast_dtype, self.device.type
        self._autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else contextlib.nullcontext

    def forward(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=False)
        with self._autocast():
            return self.model(**self.batch).loss

    def forward_backward(self) -> None:
        self.forward().backward()

    def optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def __call__(self) -> None:
        self.forward_backward()
        self.optimizer_step()

    def static_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer state: the step's starting baseline."""
        return self.params() + self.grads() + self.optimizer_state()

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters()] + [b for b in self.model.buffers()]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def make_optimizer(name: str, model: nn.Module, foreach: bool | None = None) -> torch.optim.Optimizer | None:
    """`foreach` None = torch's default (the multi-tensor path on CUDA: one parameter-sized temporary in the step);
    the memory estimator forces it on to simulate a CUDA step with CPU tensors."""
    params = list(model.parameters())
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=foreach)
    return None


def make_batch(spec: RunSpec, config, device: str) -> dict[str, torch.Tensor]:
    """Random token ids of the requested shape; labels = inputs (causal LM shifts them, MLM predicts them)."""
    gen = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(0, config.vocab_size, (spec.batch_size, spec.seq_len), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def model_state_bytes(spec: RunSpec, n_params: int) -> int:
    """Parameters + gradients + optimizer state, in bytes, before anything is allocated."""
    per_param = torch.tensor([], dtype=spec.param_dtype).element_size()
    return n_params * per_param * (2 + OPTIMIZER_STATES[spec.optimizer])


def check_fits(spec: RunSpec, meta_model: nn.Module, available: int) -> None:
    """Refuse at once (GcbenchError) when model state alone cannot fit in `available` bytes (or the memory cap);
    suggest a --layers that would."""
    n_params = count_params(meta_model)
    need = model_state_bytes(spec, n_params)
    if spec.memory_cap_bytes is not None:
        available = min(available, spec.memory_cap_bytes)
    if need <= 0.9 * available:
        return
    blocks = find_blocks(meta_model)
    per_block = model_state_bytes(spec, count_params(blocks[0]))
    rest = need - per_block * len(blocks)
    fit_layers = math.floor((0.5 * available - rest) / per_block)
    hint = f"try --layers {fit_layers}" if fit_layers >= 1 else "even one block does not fit; choose a smaller model"
    raise GcbenchError(
        f"{spec.model} needs {need / GiB:.1f} GiB for parameters, gradients and {spec.optimizer} state "
        f"({spec.precision}) but {spec.device} has {available / GiB:.1f} GiB available; {hint}")


def run(spec: RunSpec, progress: Progress | None = None) -> dict[str, Any]:
    """Measure `spec` in this process. An out-of-memory is a result (status 'oom'), not an exception."""
    from gcbench.estimate import predict_for_run  # estimate imports this module

    record: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **spec.as_record(), "status": "ok", "error": None}
    # Predicted before anything is allocated, so that an OOM record carries it too: what max_memory_allocated
    # (CUDA) or peak_tracked_bytes (CPU) should read.
    record.update(predict_for_run(spec))
    instrument = instrument_for(spec.device, spec.memory_cap_bytes)
    try:
        with instrument.session():
            record.update(_measure(spec, instrument, progress or (lambda _: None)))
    except torch.OutOfMemoryError as e:
        record.update(status="oom", error=str(e).strip().splitlines()[0][:500])
    record["env"] = capture_env(spec.device)
    return record


def _measure(spec: RunSpec, instrument: CpuInstrument | CudaInstrument, progress: Progress) -> dict[str, Any]:
    config, family = spec.model_config()
    meta = build_meta_model(config, family)
    check_fits(spec, meta, instrument.available_bytes())
    out: dict[str, Any] = {
        "family": family,
        "n_layers": config.num_hidden_layers,
        "n_params": count_params(meta),
        "attn_implementation": config._attn_implementation or "sdpa",
    }
    del meta

    progress("building model")
    torch.manual_seed(spec.seed)
    model = build_model(config, family, spec.device, spec.param_dtype)
    undo_policy = spec.policy.apply(find_blocks(model))
    step = TrainingStep(model, make_optimizer(spec.optimizer, model), make_batch(spec, config, spec.device), spec)
    policy_fields = spec.policy.prepare(step)  # compiling, host-offload bytes: see Policy.prepare
    instrument.warm_up(step, spec.warmup_steps, progress)

    out["param_bytes"] = storage_bytes(step.params())
    out["grad_bytes"] = storage_bytes(step.grads())
    out["optimizer_bytes"] = storage_bytes(step.optimizer_state())
    out.update(instrument.time_steps(step, spec.measure_steps, progress))
    out.update(instrument.peak_fields(step, progress))

    progress("counting saved bytes and FLOPs")
    saved = SavedActivations(exclude=step.params())
    with counting_flops() as flops:
        with saved.recording():
            loss = step.forward()
        loss.backward()
    del loss
    undo_policy()
    progress("counting model FLOPs")
    with counting_flops() as model_flops:
        step.forward_backward()

    median_s = out["step_ms_median"] / 1e3
    out["saved_activation_bytes"] = saved.bytes
    out["flops"] = flops.get_total_flops()
    out["model_flops"] = model_flops.get_total_flops()
    out["recompute_flops_ratio"] = out["flops"] / out["model_flops"] - 1 if out["model_flops"] else None
    out["tokens_per_s"] = spec.batch_size * spec.seq_len / median_s
    peak = instrument.peak_flops() if spec.precision != "fp32" else None
    out["mfu"] = out["model_flops"] / median_s / peak if peak else None
    out.update(policy_fields)
    return out
