"""Measure one RunSpec in this process and return its Record (a flat dict, one JSON line in the results file).

The fixed sequence (DESIGN.md, "Measurement protocol"); what differs between devices is the instrument's
(instruments.CpuInstrument, instruments.CudaInstrument):
  build on the device -> wrap blocks with the policy -> warm-up steps (optimizer state exists after step 1)
  -> timed steps (CUDA: synchronize, reset peaks, baseline, events around the step; CPU: perf_counter)
  -> CPU only: one untimed step under the live-tensor tracker
  -> one untimed forward+backward counting saved-activation bytes and FLOPs with recompute
  -> one untimed forward+backward without the policy: model FLOPs (the MFU numerator).
The step itself (model, optimizer, batch) is step.TrainingStep.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gcbench.env import capture_env
from gcbench.errors import GcbenchError
from gcbench.estimators import predict_for_run
from gcbench.instruments import CpuInstrument, CudaInstrument, Progress, instrument_for
from gcbench.measure import SavedActivations, counting_flops, storage_bytes
from gcbench.models import build_meta_model, build_model, count_params, find_blocks
from gcbench.results.schema import new_record
from gcbench.spec import RunSpec
from gcbench.step import TrainingStep, make_batch, make_optimizer, model_state_bytes

GiB = 2**30


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
    record = new_record(spec.as_record())
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
