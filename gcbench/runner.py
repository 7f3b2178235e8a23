"""Measure one RunSpec in this process and return its Record (a flat dict, one JSON line in the results file).

The fixed sequence (DESIGN.md, "Measurement protocol"); what differs between devices is the instrument's
(instruments.CpuInstrument, instruments.CudaInstrument):
  build on the device -> wrap blocks with the policy -> a compiling policy: its first step timed against the next
  -> a policy hidden from dispatch modes: one untimed forward+backward counting its saved-activation bytes
  -> warm-up steps (optimizer state exists after step 1)
  -> timed steps (CUDA: synchronize, reset peaks, baseline, events around the step; CPU: perf_counter)
  -> CPU only: one untimed step under the live-tensor tracker
  -> one untimed forward+backward counting saved-activation bytes and FLOPs with recompute (both kept only for a
     policy not hidden from dispatch modes) and the bytes an offloading policy moved to the host
  -> one untimed forward+backward without the policy: model FLOPs (the MFU numerator).
The step itself (model, optimizer, batch) is step.TrainingStep.
"""

from __future__ import annotations

import math
import time
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
from gcbench.units import fmt_bytes

# What the CPU instrument reads under its live-tensor tracker, a dispatch mode (Policy.hidden_from_dispatch_modes).
TRACKED_PEAK_FIELDS = ("peak_tracked_bytes", "fwd_bwd_peak_bytes", "activation_peak_bytes")


def check_fits(spec: RunSpec, meta_model: nn.Module, available: int) -> None:
    """Refuse at once (GcbenchError) when model state alone cannot fit in `available` bytes (the instrument's:
    free memory, or the memory cap when smaller); suggest a --layers that would."""
    n_params = count_params(meta_model)
    need = model_state_bytes(spec, n_params)
    if need <= 0.9 * available:
        return
    blocks = find_blocks(meta_model)
    per_block = model_state_bytes(spec, count_params(blocks[0]))
    rest = need - per_block * len(blocks)
    fit_layers = math.floor((0.5 * available - rest) / per_block)
    hint = f"try --layers {fit_layers}" if fit_layers >= 1 else "even one block does not fit; choose a smaller model"
    capped = spec.memory_cap_bytes is not None and available == spec.memory_cap_bytes
    room = f"--memory-cap allows {fmt_bytes(available)}" if capped else \
        f"{spec.device} has {fmt_bytes(available)} available"
    raise GcbenchError(f"{spec.model} needs {fmt_bytes(need)} for parameters, gradients and {spec.optimizer} state "
                       f"({spec.precision}) but {room}; {hint}")


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
    spec.policy.prepare(step)
    compile_ms = _compile_ms(step) if spec.policy.compiles else None
    hidden = spec.policy.hidden_from_dispatch_modes
    # Once a dispatch mode has run such a policy's blocks, Dynamo keeps running them eagerly: count what they save
    # before any instrument uses one (a CPU memory cap puts even the warm-up under the live-tensor tracker).
    hidden_saved_bytes = _saved_bytes(step) if hidden else None
    instrument.warm_up(step, spec.warmup_steps, progress)

    out["param_bytes"] = storage_bytes(step.params())
    out["grad_bytes"] = storage_bytes(step.grads())
    out["optimizer_bytes"] = storage_bytes(step.optimizer_state())
    out.update(instrument.time_steps(step, spec.measure_steps, progress))
    out.update(instrument.peak_fields(step, progress))
    if hidden and instrument.kind == "cpu":
        out.update(dict.fromkeys(TRACKED_PEAK_FIELDS, None))

    progress("counting saved bytes and FLOPs")
    with counting_flops() as flops:
        saved_bytes = _saved_bytes(step)
    offloaded = spec.policy.offloaded_bytes(step.model)  # what the policy's blocks moved in the forward just run
    undo_policy()
    progress("counting model FLOPs")
    with counting_flops() as model_flops:
        step.forward_backward()

    median_s = out["step_ms_median"] / 1e3
    out["saved_activation_bytes"] = hidden_saved_bytes if hidden else saved_bytes
    out["flops"] = None if hidden else flops.get_total_flops()
    out["model_flops"] = model_flops.get_total_flops()
    known = out["flops"] is not None and out["model_flops"]
    out["recompute_flops_ratio"] = out["flops"] / out["model_flops"] - 1 if known else None
    out["tokens_per_s"] = spec.batch_size * spec.seq_len / median_s
    peak = instrument.peak_flops() if spec.precision != "fp32" else None
    out["mfu"] = out["model_flops"] / median_s / peak if peak else None
    if compile_ms is not None:
        out["compile_ms"] = compile_ms
    if offloaded is not None:
        out["offloaded_bytes"] = offloaded
    return out


def _saved_bytes(step: TrainingStep) -> int:
    """Bytes one untimed forward saves for backward (saved_tensors_hooks; parameters excluded), then its backward."""
    saved = SavedActivations(exclude=step.params())
    with saved.recording():
        loss = step.forward()
    loss.backward()
    return saved.bytes


def _compile_ms(step: TrainingStep) -> float:
    """Compile time of a compiling policy: its first forward+backward (compiling forward and backward) minus the next,
    already compiled one. Run before warm-up, so that no timed step compiles."""
    t0 = time.perf_counter()
    step.forward_backward()
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    step.forward_backward()
    second_ms = (time.perf_counter() - t0) * 1e3
    return max(first_ms - second_ms, 0.0)
