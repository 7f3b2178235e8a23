"""Measure one RunSpec in this process and return its Record (a flat dict, one JSON line in the results file).

The fixed sequence (DESIGN.md, "Measurement protocol"):
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
import gc
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gcbench.env import available_memory_bytes, capture_env
from gcbench.errors import GcbenchError
from gcbench.measure import LiveTensorTracker, SavedActivations, Stats, counting_flops, peak_flops, storage_bytes
from gcbench.models import build_meta_model, build_model, count_params, find_blocks
from gcbench.results import SCHEMA_VERSION
from gcbench.spec import RunSpec

Progress = Callable[[str], None]  # called once per step with a short description of what runs next
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per parameter
GiB = 2**30


class TrainingStep:
    """One training step on a fixed random batch, split in the two phases whose memory is reported apart."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: dict, spec: RunSpec):
        self.model, self.optimizer, self.batch = model, optimizer, batch
        dtype = spec.autocast_dtype
        device_type = torch.device(spec.device).type
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


def check_fits(spec: RunSpec, meta_model: nn.Module) -> None:
    """Refuse at once (GcbenchError) when model state alone cannot fit; suggest a --layers that would."""
    n_params = count_params(meta_model)
    need = model_state_bytes(spec, n_params)
    available = available_memory_bytes(spec.device)
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
    # (CUDA) or peak_tracked_bytes (CPU) should read; None when no method can predict this policy.
    record["predicted_peak_bytes"], record["prediction_method"] = predict_for_run(spec)
    try:
        record.update(_measure(spec, progress or (lambda _: None)))
    except torch.OutOfMemoryError as e:
        record.update(status="oom", error=str(e).strip().splitlines()[0][:500])
    finally:
        gc.collect()
        if spec.device.startswith("cuda"):
            torch.cuda.empty_cache()
            if spec.memory_cap_bytes is not None:  # the cap is process-wide: lift it for the next in-process run
                torch.cuda.set_per_process_memory_fraction(1.0, spec.device)
    record["env"] = capture_env(spec.device)
    return record


def _measure(spec: RunSpec, progress: Progress) -> dict[str, Any]:
    config, family = spec.model_config()
    meta = build_meta_model(config, family)
    check_fits(spec, meta)
    out: dict[str, Any] = {
        "family": family,
        "n_layers": config.num_hidden_layers,
        "n_params": count_params(meta),
        "attn_implementation": config._attn_implementation or "sdpa",
    }
    del meta
    cuda = spec.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(spec.device)
        if spec.memory_cap_bytes is not None:
            total = torch.cuda.get_device_properties(spec.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory_cap_bytes / total), spec.device)

    progress("building model")
    torch.manual_seed(spec.seed)
    model = build_model(config, family, spec.device, spec.param_dtype)
    undo_policy = spec.policy.apply(find_blocks(model))
    step = TrainingStep(model, make_optimizer(spec.optimizer, model), make_batch(spec, config, spec.device), spec)
    policy_fields = spec.policy.prepare(step)  # compiling, host-offload bytes: see Policy.prepare

    # A CPU memory cap must bite from the first step, as a GPU's memory would.
    capped = LiveTensorTracker(spec.memory_cap_bytes) if spec.memory_cap_bytes and not cuda else None
    if capped is not None:
        capped.track(step.static_tensors() + list(step.batch.values()))
    with capped or contextlib.nullcontext():
        for i in range(spec.warmup_steps):
            progress(f"warm-up {i + 1}/{spec.warmup_steps}")
            step()

    out["param_bytes"] = storage_bytes(step.params())
    out["grad_bytes"] = storage_bytes(step.grads())
    out["optimizer_bytes"] = storage_bytes(step.optimizer_state())
    out.update(_time_cuda(step, spec, progress) if cuda else _time_cpu(step, spec, progress))
    if not cuda:
        out.update(_track_cpu(step, spec, progress))

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
    peak = peak_flops(torch.cuda.get_device_name(spec.device)) if cuda and spec.precision != "fp32" else None
    out["mfu"] = out["model_flops"] / median_s / peak if peak else None
    out.update(policy_fields)
    return out


def _time_cuda(step: TrainingStep, spec: RunSpec, progress: Progress) -> dict[str, Any]:
    step_ms, wall_ms, peaks, fwd_bwd_peaks, baselines = [], [], [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(spec.measure_steps):
        progress(f"measuring {i + 1}/{spec.measure_steps}")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baselines.append(torch.cuda.memory_allocated())
        t0 = time.perf_counter()
        start.record()
        step.forward_backward()
        # Allocator statistics live on the host: reading them here does not synchronize with the GPU.
        fwd_bwd_peaks.append(torch.cuda.max_memory_allocated())
        step.optimizer_step()
        end.record()
        torch.cuda.synchronize()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        step_ms.append(start.elapsed_time(end))
        peaks.append(torch.cuda.max_memory_allocated())
    stats = torch.cuda.memory_stats()
    baseline = max(baselines)
    return {
        **_time_fields(step_ms),
        "wall_ms": wall_ms,
        "peak_allocated_bytes": max(peaks),
        "fwd_bwd_peak_bytes": max(fwd_bwd_peaks),
        "static_bytes": baseline,
        "activation_peak_bytes": max(fwd_bwd_peaks) - baseline,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
    }


def _time_cpu(step: TrainingStep, spec: RunSpec, progress: Progress) -> dict[str, Any]:
    step_ms = []
    for i in range(spec.measure_steps):
        progress(f"measuring {i + 1}/{spec.measure_steps}")
        t0 = time.perf_counter()
        step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return _time_fields(step_ms)


def _time_fields(step_ms: list[float]) -> dict[str, Any]:
    stats = Stats.of(step_ms)
    return {"step_ms": step_ms, "step_ms_median": stats.median, "step_ms_iqr": stats.iqr}


def _track_cpu(step: TrainingStep, spec: RunSpec, progress: Progress) -> dict[str, Any]:
    """One untimed step under the live-tensor tracker: peak of live tensor bytes, whole step and fwd+bwd."""
    progress("tracking live tensors")
    tracker = LiveTensorTracker(spec.memory_cap_bytes)
    tracker.track(step.static_tensors() + list(step.batch.values()))
    baseline = tracker.current
    with tracker:
        step.forward_backward()
        fwd_bwd_peak = tracker.peak
        step.optimizer_step()
    return {
        "peak_tracked_bytes": tracker.peak,
        "fwd_bwd_peak_bytes": fwd_bwd_peak,
        "static_bytes": baseline,
        "activation_peak_bytes": fwd_bwd_peak - baseline,
    }
