"""Measure one RunSpec in this process and return its Record (a flat dict, one JSON line in the results file).

The fixed sequence (docs/methodology.md, "The fixed sequence"); what differs between devices is the instrument's
(instruments.CpuInstrument, instruments.CudaInstrument):
  build on the device -> wrap blocks with the policy -> a compiling policy: its first step timed against the next
  -> a policy hidden from dispatch modes: one untimed forward+backward counting its saved-activation bytes
  -> warm-up steps (optimizer state exists after step 1)
  -> timed steps, as many as the spec's budget says (CUDA: synchronize, reset peaks, baseline, events around the
     step; CPU: perf_counter), with the host's load around them and the stability rule applied (timing.py)
  -> CPU only: one untimed step under the live-tensor tracker
  -> one untimed forward+backward counting saved-activation bytes and FLOPs with recompute (both kept only for a
     policy not hidden from dispatch modes) and the bytes an offloading policy moved to the host
  -> one untimed forward+backward without the policy: model FLOPs (the MFU numerator).
The step itself (model, optimizer, batch) is step.TrainingStep. Every run sets torch's threads to the spec's
(--threads) for its duration. Timing several policies interleaved is paired.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gcbench.adapters import adapter_params, apply_adapter, compute_dtype, frozen_bytes, parse_adapter, \
    trainable_params
from gcbench.compiled import BLOCKS, compile_blocks
from gcbench.fields import DeviceKind
from gcbench.env import capture_env
from gcbench.errors import GcbenchError, WontFit
from gcbench.estimators import predict_for_run, resolve_plan
from gcbench.estimators.stored import stored_prediction
from gcbench.instruments import CpuInstrument, CudaInstrument, Progress, instrument_for
from gcbench.measure import RecomputeFlops, SavedActivations, counting_flops, storage_bytes
from gcbench.optimizers import optimizer_kind
from gcbench.models import block_lists, build_meta_model, build_model, count_params, stack_text, total_blocks
from gcbench.policies import Plan, apply_to_stacks
from gcbench.results.schema import Status, mix_text, new_record, timing_note_fields
from gcbench.fsdp import AgreedBudget, in_rank, shard_model
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec
from gcbench.step import TrainingStep, make_batch, make_optimizer, model_state_bytes, param_shapes
from gcbench.timing import timing_verdict
from gcbench.units import fmt_bytes

# What the CPU instrument reads under its live-tensor tracker, a dispatch mode (Policy.hidden_from_dispatch_modes).
TRACKED_PEAK_FIELDS = ("peak_tracked_bytes", "fwd_bwd_peak_bytes", "activation_peak_bytes", "forward_peak_bytes",
                       "backward_peak_bytes", "optimizer_peak_bytes", "peak_phase")


# A config is not run when its predicted peak exceeds the device's free memory by more than this margin. The CPU
# simulation predicts the tracked peak exactly and the process needs more than that, so past the free memory it
# never fits (it would swap, or the kernel would kill a process). CUDA predictions, and the analytic ones, are
# within a few percent: a config up to 10% above the free memory runs, and the allocator decides.
EXACT_MARGIN, MARGIN = 1.0, 1.10
# Under --memory-cap the real out-of-memory (the allocator's, or on CPU the tracker's) is the measurement: a config
# is recorded as oom without running only when its prediction is this far past the cap.
CAP_MARGIN = 2.0


@dataclass(frozen=True)
class ModelSize:
    """Parameter shapes read off a meta-device model: enough to know the model state of any precision/optimizer."""

    n_params: int
    shapes: list[tuple[int, ...]]  # of every distinct trainable parameter
    block_shapes: list[tuple[int, ...]]  # of the largest transformer block (MoE models may keep dense blocks too)
    n_blocks: int
    frozen_bytes: int = 0  # of the frozen parameters (an adapter's base): no gradients, no optimizer state
    block_frozen_bytes: int = 0  # of the largest block's

    @classmethod
    def of(cls, meta_model: nn.Module, elem: int = 4) -> ModelSize:
        """`elem`: bytes per element of a frozen parameter (the run's precision)."""
        blocks = [block for stack in block_lists(meta_model) for block in stack]
        largest = max(blocks, key=count_params)
        trainable = lambda module: [s for p, s in zip(module.parameters(), param_shapes(module))  # noqa: E731
                                    if p.requires_grad]
        return cls(count_params(meta_model), trainable(meta_model), trainable(largest), len(blocks),
                   frozen_bytes(meta_model, elem), frozen_bytes(largest, elem))


_MODEL_SIZES: dict[str, ModelSize] = {}  # by config: a sweep asks once per config, a meta build takes ~0.1-1 s


def model_size(spec: ResolvedRun) -> ModelSize:
    """The ModelSize of a spec's model, from a meta-device build (no memory, no init)."""
    config, family = spec.model_config()
    adapter = parse_adapter(spec.adapter)
    key = f"{family}:{adapter}:{spec.param_dtype}:{config.to_json_string(use_diff=False)}"
    if key not in _MODEL_SIZES:
        meta = apply_adapter(build_meta_model(config), adapter, compute_dtype(spec), "meta")
        _MODEL_SIZES[key] = ModelSize.of(meta, spec.param_dtype.itemsize)
    return _MODEL_SIZES[key]


def check_fits(spec: ResolvedRun, size: ModelSize, free: int | None, predicted_peak: int | None = None,
               prediction_method: str | None = None, cap_name: str = "--memory-cap") -> None:
    """Raise WontFit, before anything is allocated, when the config cannot fit: its model state (parameters,
    gradients, optimizer state) takes more than 90% of the device's `free` bytes (None: unknown) or of the memory
    cap, or its predicted peak is past the free memory (by MARGIN; exactly, for the CPU simulation) or past the cap
    by CAP_MARGIN. The device is checked before the cap: a config the device cannot hold is refused as such.
    `cap_name`: the cap as the user gave it (`gcbench fit`'s is its --memory budget)."""
    cap = spec.memory_cap_bytes
    cpu_exact = spec.device_kind is DeviceKind.CPU and prediction_method == "simulate"
    limits = ((free, False), (cap, True))

    def room(by_cap: bool) -> str:
        return f"{cap_name} allows {fmt_bytes(cap)}" if by_cap else f"{spec.device} has {fmt_bytes(free)} free"

    cuda = spec.device_kind is DeviceKind.CUDA
    # a sharded run's ranks hold 1/nproc each
    need = model_state_bytes(spec, size.shapes, cuda, size.frozen_bytes) // spec.nproc
    for limit, by_cap in limits:
        if limit is not None and need > 0.9 * limit:
            per_block = model_state_bytes(spec, size.block_shapes, cuda, size.block_frozen_bytes)
            rest = need - per_block * size.n_blocks  # the embeddings, the head and the last norm
            # half the memory for the model state leaves the rest to activations; 90% is the most this check takes
            roomy, most = (math.floor((share * limit - rest) / per_block) for share in (0.5, 0.9))
            hint = f"try --layers {roomy}" if roomy >= 1 else \
                f"try --layers {most} (its model state then within 90%, little left for activations)" \
                if most >= 1 else f"its embeddings and head alone need {fmt_bytes(rest)}; choose a smaller model" \
                if rest > 0.9 * limit else f"one block with its embeddings and head needs " \
                f"{fmt_bytes(rest + per_block)}; choose a smaller model"
            if spec.param_dtype.itemsize > 2:
                hint += ", or --precision bf16"
            grads = "" if spec.optim_in_backward else "gradients and "
            raise WontFit(f"{spec.model} needs {fmt_bytes(need)} for parameters, {grads}{spec.optimizer} state "
                          f"({spec.precision}) but {room(by_cap)}; {hint}", by_cap=by_cap)
    if predicted_peak is None:
        return
    for limit, by_cap in limits:
        margin = CAP_MARGIN if by_cap else EXACT_MARGIN if cpu_exact else MARGIN
        if limit is not None and predicted_peak > limit * margin:
            hint = "a smaller --seq or --batch" + ("" if spec.policy.name == "full" else ", or a checkpoint policy")
            raise WontFit(f"the predicted peak of seq {spec.seq_len} x batch {spec.batch_size} under {spec.policy} "
                          f"is {fmt_bytes(predicted_peak)} but {room(by_cap)}; try {hint}", by_cap=by_cap)


def run(spec: RunSpec | ResolvedRun, progress: Progress | None = None, *, refuse_unfit: bool = False) -> dict[str, Any]:
    """Measure `spec` in this process. An out-of-memory is a result (status 'oom'), not an exception; so is a config
    that cannot fit at all (check_fits), which is then recorded without allocating anything. `refuse_unfit`: raise
    WontFit instead when the device itself is too small (a memory cap stands for a smaller device: that is still an
    `oom` result)."""
    spec = resolve(spec)  # a RunSpec from Python is looked up here; a sweep's child hands over a ResolvedRun
    spec.check_runnable()
    if spec.shard != "none" and not in_rank():
        raise GcbenchError("a sharded config runs on its ranks: gcbench.launch.run starts them under torchrun")
    record = new_record(spec.as_record())
    config, family = spec.model_config()
    # what the model is, in every record, one that is not run included: an encoder-decoder's blocks are both stacks'
    record.update(family=family, n_layers=total_blocks(config), stacks=stack_text(config))
    spec = resolve_plan(spec)  # a plan's mix, chosen for this shape before anything is allocated
    if isinstance(spec.policy, Plan):
        record["plan_mix"] = spec.policy.mix
    # Predicted before anything is allocated, so that an OOM record carries it too: what max_memory_allocated
    # (CUDA) or peak_tracked_bytes (CPU) should read. Made beforehand where GCBENCH_PREDICTIONS holds it; else the
    # analytic model (instant), and the simulation (about a second for a tiny model) only when asked (--predict).
    card = _card(spec)
    record.update(stored_prediction(record, spec.device_kind)
                  or predict_for_run(spec, methods=("simulate", "analytic") if spec.predict else ("analytic",),
                                     cards=(card.name,) if card else ()))
    # the step time on this card (estimators/step_time.py), where the simulation ran and the card has rates
    by_card = record.pop("predicted_step_ms_by_card", None) or {}
    record["predicted_step_ms"] = by_card.get(card.name) if card else None
    if (missed := plan_missed(spec)) is not None:  # it would run a mix past the budget it was asked to keep
        if refuse_unfit:
            raise GcbenchError(missed)
        record.update(status=Status.OOM, error=f"not run: {missed}", oom_predicted=True, oom_limit="plan",
                      env=capture_env(spec.device, spec.threads))
        return record
    instrument = instrument_for(spec.device, spec.memory_cap_bytes)
    try:
        with torch_threads(spec.threads), instrument.session():
            check_fits(spec, model_size(spec), instrument.free_bytes(), record["predicted_peak_bytes"],
                       record["prediction_method"])
            record.update(_measure(spec, instrument, progress or (lambda _: None)))
    except WontFit as e:
        if refuse_unfit and not e.by_cap:
            raise
        record.update(status=Status.OOM, error=f"not run: {e}", oom_predicted=True, oom_limit=e.limit)
    except torch.OutOfMemoryError as e:
        record.update(status=Status.OOM, error=str(e).strip().splitlines()[0][:500])
    record["env"] = capture_env(spec.device, spec.threads)
    return record


def plan_missed(spec: ResolvedRun) -> str | None:
    """Why a `plan` run cannot keep its promise, in one line: no mix's predicted peak is within its memory. None for
    any other policy, or under a --memory-cap at or below the plan's memory (the run itself then says: ok or oom)."""
    if not isinstance(spec.policy, Plan):
        return None
    from gcbench.estimators.plan import choose

    budget, cap = spec.policy.memory_bytes, spec.memory_cap_bytes
    if cap is not None and cap <= budget:
        return None
    choice = choose(spec, spec.device_kind)  # kept from the choice of the mix: no simulation again
    if choice.fits:
        return None
    if choice.predicted_peak <= budget:
        return (f"no plan fits {spec.policy.memory}: the optimizer step alone peaks above it (no checkpointing "
                "lowers that)")
    mix = choice.counts
    return (f"no plan fits {spec.policy.memory}: the smallest predicted peak is {fmt_bytes(choice.predicted_peak)} "
            f"({next(iter(mix)) if len(mix) == 1 else mix_text(mix)})")


def _measure(spec: ResolvedRun, instrument: CpuInstrument | CudaInstrument, progress: Progress) -> dict[str, Any]:
    config, _ = spec.model_config()
    out: dict[str, Any] = {
        "n_params": model_size(spec).n_params,
        "attn_implementation": config._attn_implementation or "sdpa",
    }

    progress("building model")
    torch.manual_seed(spec.seed)
    adapter = parse_adapter(spec.adapter)
    model = build_model(config, adapter.build_device(spec.device), spec.param_dtype)
    # the adapter before the policy: the policy wraps blocks that already hold the adapted layers
    model = apply_adapter(model, adapter, compute_dtype(spec), spec.device)
    stacks = block_lists(model)  # ModuleLists: the policy puts its wrappers back into them
    apply_to_stacks(spec.policy, stacks)
    compiled = spec.compile == BLOCKS
    if compiled:  # after the policy, as torchtitan does (apply_ac, then apply_compile)
        for blocks in stacks:
            compile_blocks(blocks)
    sharded = spec.shard != "none"
    if sharded:  # after the policy, as torchtitan does: FSDP gathers a block, the checkpoint runs inside it
        shard_model(model, stacks[0], spec.precision)  # a model of one stack (resolve refuses the others)
    step = TrainingStep(model, make_optimizer(spec, model), make_batch(spec, config, spec.device), spec)
    spec.policy.prepare(step)
    compile_ms = _compile_ms(step) if spec.policy.compiles or compiled else None
    hidden = spec.policy.hidden_from_dispatch_modes or compiled  # Dynamo runs compiled blocks eagerly under them
    # Once a dispatch mode has run such a policy's blocks, Dynamo keeps running them eagerly: count what they save
    # before any instrument uses one (a CPU memory cap puts even the warm-up under the live-tensor tracker).
    hidden_saved_bytes = _saved_bytes(step) if hidden else None
    instrument.warm_up(step, spec.warmup_steps, progress)

    out["param_bytes"] = storage_bytes(step.params())
    out["grad_bytes"] = storage_bytes(step.grads())
    out["adapter_param_bytes"] = storage_bytes(adapter_params(step.model))  # part of param_bytes
    out["trainable_params"] = trainable_params(step.model)
    # bitsandbytes marks the state buffers it put in CUDA managed memory (functional.get_paged: `is_paged`): outside
    # torch's allocator, so apart from optimizer_bytes, which the peak's static part holds
    state = step.optimizer_state()
    out["optimizer_bytes"] = storage_bytes([t for t in state if not getattr(t, "is_paged", False)])
    if optimizer_kind(spec.optimizer).paged:
        out["optimizer_paged_bytes"] = storage_bytes([t for t in state if getattr(t, "is_paged", False)])
    out.update(instrument.time_steps(step, AgreedBudget(spec.budget) if sharded else spec.budget, progress))
    out["timing_stable"], notes = timing_verdict(out, instrument.kind)
    out.update(timing_note_fields(notes))
    out.update(instrument.peak_fields(step, progress))
    if hidden and instrument.kind == "cpu":
        out.update(dict.fromkeys(TRACKED_PEAK_FIELDS, None))

    progress("counting saved bytes and FLOPs")
    recompute = RecomputeFlops()
    with recompute, counting_flops() as flops:
        saved_bytes = _saved_bytes(step, recompute)
    offloaded = spec.policy.offloaded_bytes(step.model)  # what the policy's blocks moved in the forward just run

    median_s = out["step_ms_median"] / 1e3
    out["saved_activation_bytes"] = hidden_saved_bytes if hidden else saved_bytes
    out["flops"] = None if hidden else flops.get_total_flops()
    # Without the recompute: the FLOPs without the policy (a hidden policy's pass ran eagerly: budget recomputes
    # nothing there, compiled blocks recompute through their eager checkpoints)
    out["model_flops"] = flops.get_total_flops() - recompute.flops
    known = out["flops"] is not None and out["model_flops"]
    out["recompute_flops_ratio"] = out["flops"] / out["model_flops"] - 1 if known else None
    out["tokens_per_s"] = spec.batch_size * spec.grad_accum * spec.seq_len / median_s  # every micro-batch
    peak = instrument.peak_flops() if spec.precision != "fp32" else None
    out["mfu"] = out["model_flops"] / median_s / peak if peak and out["model_flops"] else None
    if compile_ms is not None:
        out["compile_ms"] = compile_ms
    if offloaded is not None:
        out["offloaded_bytes"] = offloaded
    return out


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (a run's --threads), then back: in-process runs follow."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _card(spec: ResolvedRun):
    """The gpus.py entry of the CUDA device the run is on (its step time is predicted for it), or None."""
    if spec.device_kind != "cuda":
        return None
    from gcbench.gpus import matching

    return matching(torch.cuda.get_device_name(torch.device(spec.device)))


def _saved_bytes(step: TrainingStep, recompute: RecomputeFlops | None = None) -> int:
    """Bytes the first micro-batch's forward saves for backward (saved_tensors_hooks; parameters excluded), then a
    whole step's forward and backward passes, so that FLOPs counted around it are the step's (`recompute` told
    when each backward runs)."""
    # In a rank, FSDP2 gathers each block's parameters for its forward: what autograd saves of them is not activation.
    saved = SavedActivations(exclude=step.params(), exclude_now=step.model.parameters if in_rank() else None)
    for i, micro_batch in enumerate(step.micro_batches):
        with saved.recording() if i == 0 else nullcontext():
            loss = step.forward(micro_batch)
        with recompute.backward() if recompute is not None else nullcontext():
            loss.backward()
        step.held = []  # what the loss kept until its backward (losses.loss_of), as forward_backward drops it
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
