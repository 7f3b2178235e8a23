"""The `simulate` predictor: run the worker's real TrainingStep (the policy applied, warm-up step, forward,
backward, optimizer step) on fake tensors, where every op computes shapes only, and count what would be allocated.

The fakes are CPU tensors even for a CUDA target, because a CPU-only torch build cannot run fake CUDA tensors
through autograd; what CUDA does differently is put back (cuda_target.py): the attention kernel CUDA would pick,
its backward workspace, the multi-tensor optimizer path and the allocator's 512-byte blocks; `replay_allocator`
replays the caching allocator itself on the step (caching_allocator.py: reserved memory). See docs/methodology.md,
"Predicting memory". Runs any policy that runs on fake tensors; takes about a second for tiny models, seconds for
7B ones (each op costs the fake mode tens of microseconds whatever its size: the time is the number of ops). The
warm-up's state is made directly and the FLOPs counted on the tracked step where that is exact (shortcuts.py);
sharing.py keeps each simulation for the process and runs independent ones side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gcbench.adapters import apply_adapter, compute_dtype, param_count, parse_adapter
from gcbench.nf4 import quantise_fakes
from gcbench.errors import GcbenchError, quiet_logger
from gcbench.estimators.caching_allocator import AllocationReplay, CachingAllocator, OutOfMemory
from gcbench.estimators.cuda_target import AllocatorModel, cuda_kernels, kernel_workspace_bytes
from gcbench.estimators.sharing import kept, shared
from gcbench.estimators.estimates import Estimate
from gcbench.estimators.fake_ranks import fake_world, shard_as_fakes
from gcbench.estimators.layer_scaling import SHORT, StepTrace, blocks_to_scale, scaled, scaled_flops
from gcbench.estimators.fake_reads import scaler_finds_no_inf, steps_read_no_values
from gcbench.estimators.shape import attention_kernel
from gcbench.estimators.shortcuts import FlopTally, prime
from gcbench.estimators.step_clock import StepClock
from gcbench.losses import CPU_TARGET
from gcbench.heap import collect_garbage
from gcbench.measure import PhasePeaks, counting_flops, listening_to_host_moves, storage_bytes
from gcbench.models import block_lists, build_model, experts_implementation, total_blocks
from gcbench.optimizers import optimizer_kind
from gcbench.policies import Plan, Policy, apply_to_stacks
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec
from gcbench.modality import batch_of, inputs_of
from gcbench.step import TrainingStep, make_optimizer


def simulate(spec: RunSpec | ResolvedRun, target: str = "cuda", flops: bool = False, *,
             shortcut: bool = True, timed: bool = True) -> Estimate:
    """Run one tracked step of `spec` on fake tensors, after the state a warm-up step leaves; nothing is allocated
    for real. `flops`: also the FLOPs of one forward and backward with recompute (Estimate.flops); `timed`: also
    the step's work for the time model on a CUDA target (Estimate.work; a tenth of the simulation's time, which
    a caller naming no card can spare).

    `shortcut` (tests turn it off to hold the rest to it): the warm-up's state made directly and the FLOPs counted
    on the tracked step (shortcuts.py), each where it is proven equal, and a simulation this process ran before
    reused (sharing.py); else a warm-up step before the tracked one and a FLOPs pass after it, as the simulation
    always did."""
    if not shortcut:
        return _simulate(resolve(spec), target, flops, False, timed=timed)
    found = begin(spec, target, flops, timed).result()
    return found if flops or found.flops is None else dataclasses.replace(found, flops=None)


def begin(spec: RunSpec | ResolvedRun, target: str = "cuda", flops: bool = False, timed: bool = True) -> Future:
    """simulate(spec, target, flops, timed=timed), begun: the future of its Estimate (which may hold FLOPs or work
    it was not asked for), run in a worker inside sharing.sharing_cores, else at once."""
    spec = _as_one_kind(resolve(spec))
    holds = frozenset(name for name, asked in (("flops", flops), ("work", timed)) if asked)
    return shared(_kept_as(spec, target), holds, functools.partial(_simulate, timed=timed), spec, target, flops, True)


def _as_one_kind(spec: ResolvedRun) -> ResolvedRun:
    """An unsharded plan whose mix is one kind (Plan.one_kind) as that kind's policy: the same step, whose
    simulation is the one the plan's choice ran for that kind, and, in a long model, made from two short ones
    (layer_scaling.py), where a plan is simulated whole. tests/test_estimate_speed.py holds each kind to the plan's
    own whole simulation."""
    policy = spec.policy
    one = policy.one_kind(total_blocks(spec.config)) if isinstance(policy, Plan) and spec.shard == "none" \
        else None
    return spec if one is None else spec.replace(policy=one)


def blocks_simulated(spec: ResolvedRun) -> int:
    """How many blocks simulate(spec) runs, which its time follows (tens of microseconds per op, whatever its
    size): both short models' where it is made from them (layer_scaling.py), else the model's own."""
    return sum(SHORT) if blocks_to_scale(spec) is not None else total_blocks(spec.model_config()[0])


def simulate_each(specs: list[ResolvedRun], target: str = "cuda", flops: bool = False
                  ) -> list[Estimate | GcbenchError]:
    """simulate() of each spec, side by side where cores are shared; in a spec's place the GcbenchError it
    raised."""
    futures = [begin(spec, target, flops) for spec in specs]
    return [f.exception() if isinstance(f.exception(), GcbenchError) else f.result() for f in futures]


def count_flops(spec: RunSpec | ResolvedRun, target: str = "cuda") -> int:
    """The FLOPs simulate(flops=True) counts for `spec` (one forward and backward, recompute included): a kept
    simulation's, else by that forward and backward alone (no warm-up, no tracking, no optimizer phase: a third of
    a simulation), where only the FLOPs are wanted (the step time of a size the analytic model found)."""
    spec = _as_one_kind(resolve(spec))
    key = _kept_as(spec, target)
    simulated = kept(key)
    if simulated is not None and simulated.exception() is None:
        return simulated.result().flops
    return shared(("flops", key), frozenset({"flops"}), _count_flops, spec, target).result()


def _kept_as(spec: ResolvedRun, target: str) -> tuple:
    """What a simulation reads of its run: not how the run would measure (steps, time, seed), nor its device or
    memory cap (the fakes are CPU tensors, never capped), as plan.choose; and every field of the policy, those its
    equality leaves out too (a plan's chosen mix)."""
    same = spec.replace(device="cpu", memory_cap_bytes=None, warmup_steps=1, measure_steps=1, max_steps=1,
                        max_time_s=1.0, seed=0)
    policy = spec.policy
    return same, type(policy), tuple(getattr(policy, f.name) for f in dataclasses.fields(policy)), target


def replay_allocator(spec: RunSpec | ResolvedRun, capacity: int | None = None, warm_up: bool = True
                     ) -> tuple[Estimate, CachingAllocator]:
    """simulate's CUDA prediction of `spec`, with PyTorch's caching allocator replayed on the same allocations
    (caching_allocator.py): the parameters and batch as the run allocates them, a warm-up step, then the tracked
    one. The allocator's `peak_reserved` is what max_memory_reserved would read over the run; with `capacity` (the
    bytes cudaMalloc can hand out), it raises caching_allocator.OutOfMemory where the run would run out."""
    spec = resolve(spec)
    if optimizer_kind(spec.optimizer).paged is not None:
        raise GcbenchError(f"the caching allocator is not replayed with --optimizer {spec.optimizer}: its state "
                           "lives in CUDA managed memory, which the warm-up step would take from the allocator")
    allocator = CachingAllocator(capacity)
    return _simulate(spec, "cuda", False, not warm_up, allocator), allocator


def _simulate(spec: ResolvedRun, target: str, flops: bool, shortcut: bool,
              allocator: CachingAllocator | None = None, trace: StepTrace | None = None, timed: bool = True) -> Estimate:
    """The simulation itself (simulate's docstring), in this process; `allocator`: replayed on it too; `trace`:
    filled with what layer_scaling.py needs besides the peaks. With `shortcut`, a model of many alike blocks is
    simulated from two short ones where that is exact (layer_scaling.py)."""
    if shortcut and allocator is None and trace is None and (n := blocks_to_scale(spec)) is not None:
        try:
            short = [(_simulate(spec.replace(layers=k), target, flops, True, trace=t, timed=timed), t)
                     for k, t in zip(SHORT, (StepTrace(), StepTrace()))]
        except GcbenchError:  # a short model this run cannot be: the whole one answers, or says why not
            short = None
        found = scaled(n, short) if short else None
        if found is not None:
            return found
    start = time.perf_counter()
    # Reference cycles an earlier simulation left (SAC's caches make some) would otherwise be collected at a moment
    # of the garbage collector's choosing inside this one's tracked step: the same spec would give another peak.
    collect_garbage()
    # The fakes are CPU tensors whatever the target (autocast, too, must act on CPU tensors); see the module docstring.
    spec = resolve(spec).replace(device="cpu", memory_cap_bytes=None)
    cuda = target == "cuda"
    if spec.loss == "fused-linear" and not cuda:  # its fakes stand for liger's CUDA allocations (liger_model.py)
        raise GcbenchError(CPU_TARGET)
    config, _ = spec.model_config()
    tracker = AllocatorModel(cuda)
    phases = PhasePeaks(lambda: tracker.peak, tracker.reset_peak)
    mark = trace.marking(phases, tracker) if trace is not None else phases
    ran: set[str] = set()  # the SDPA kernels the model's calls were routed to (cuda_target.cuda_kernels)
    experts: set[str] = set()  # the grouped matmuls the experts ran (GroupedMmShapes)
    with _fake_step(spec, cuda, ran, experts) as (step, tokens):
        # the warm-up's state made directly (shortcuts.prime) knows no DTensor shards: a sharded rank warms up
        check = prime(step, spec.optimizer) if shortcut and spec.shard == "none" else None
        replay = AllocationReplay(allocator, kernel_workspace_bytes) if allocator is not None else \
            contextlib.nullcontext()
        if allocator is not None:  # what the run has allocated before its first step: the model, then the batch
            replay.track([*step.model.parameters(), *step.model.buffers(), *tokens, *step.scaler_state()])
        clock = StepClock() if cuda and timed else None  # the step's work for the time model (step_time.py)
        moves = [f for f in (replay.host_move if allocator is not None else None,
                             clock.host_move if clock is not None else None) if f is not None]
        if moves:  # the tracked step's host moves (the tracker listens then)
            tracker.also = moves[0] if len(moves) == 1 else lambda t, back: [f(t, back) for f in moves]
        if check is None:
            with replay, listening_to_host_moves(replay.host_move) if allocator is not None else \
                    contextlib.nullcontext():
                step()  # warm-up: gradients and optimizer state exist from here on, as in the measured steps
        state = _device_state(step, cuda)
        paged = _paged_state(step, spec.optimizer, cuda)  # CUDA managed memory: outside max_memory_allocated
        state = [t for t in state if all(t is not q for q in paged)]
        tracker.outside(paged)
        tracker.track(step.params() + step.grads() + state + step.scaler_state() + tokens)
        if clock is not None:  # what a CUDA run keeps on the host: AdamW's step counts, unless fused
            on_device = {id(t.untyped_storage()) for t in state + paged}
            clock.host_resident = {id(t.untyped_storage()) for t in step.optimizer_state()} - on_device
            mark = clock.marking(mark)
        if allocator is not None and check is not None:  # primed: the state as the warm-up leaves it, at once
            replay.track(step.grads() + state)
        if allocator is not None:  # what the target keeps off the device (AdamW's step counts, paged state)
            on_device = {id(t.untyped_storage()) for t in step.params() + step.grads() + state + tokens}
            replay.forget([t for t in step.optimizer_state() if id(t.untyped_storage()) not in on_device])
            allocator.reset_peaks()  # as the run reads its peaks over the measured steps
        tally = FlopTally() if flops and shortcut else None
        with replay, tracker, check or contextlib.nullcontext(), tally or contextlib.nullcontext(), \
                clock or contextlib.nullcontext():
            step(tally.marking(mark) if tally else mark)
        unproven = check is not None and not check.proven
        counted = tally.total if tally is not None and tally.exact else None
        if flops and counted is None and not unproven:
            # Apart from the tracked step: the counter runs some ops as their decompositions (shortcuts.FlopTally)
            with counting_flops() as counter:
                step.forward_backward()
            counted = counter.get_total_flops()
        parts = [storage_bytes(tensors, tracker.granularity_bytes) for tensors in (step.params(), step.grads(), state)]
        paged_bytes = storage_bytes(paged) if optimizer_kind(spec.optimizer).paged else None
        n_params = param_count(step.model)
        experts_kernel = "+".join(sorted(experts)) or experts_implementation(step.model)
    if unproven:  # a warm-up might have left other gradients than prime's: the full path, out of this fake mode
        if trace is not None:
            trace.clear()
        return _simulate(spec, target, flops, False, trace=trace, timed=timed)
    peaks, peak = phases.fields(), max(phases.peaks.values())
    return Estimate(
        method="simulate", target=target, peak_bytes=peak, param_bytes=parts[0], grad_bytes=parts[1],
        optimizer_bytes=parts[2], activation_bytes=peak - sum(parts), peak_phase=peaks["peak_phase"],
        forward_peak_bytes=peaks["forward_peak_bytes"], backward_peak_bytes=peaks["backward_peak_bytes"],
        optimizer_peak_bytes=peaks["optimizer_peak_bytes"], n_params=n_params,
        attention_kernel="+".join(sorted(ran)) or attention_kernel(spec, config, target), flops=counted,
        experts_kernel=experts_kernel,
        seconds=time.perf_counter() - start, optimizer_paged_bytes=paged_bytes,
        work=clock.work() if clock is not None else None)


def _count_flops(spec: ResolvedRun, target: str) -> int:
    if (n := blocks_to_scale(spec)) is not None:  # the same ops in every block (layer_scaling.py)
        with contextlib.suppress(GcbenchError):  # else counted whole, as _simulate does
            return scaled_flops(n, [_count_flops(spec.replace(layers=k), target) for k in SHORT])
    spec = spec.replace(device="cpu", memory_cap_bytes=None)
    with _fake_step(spec, target == "cuda") as (step, _):
        with counting_flops() as counter:
            step.forward_backward()
    return counter.get_total_flops()


@contextlib.contextmanager
def _fake_step(spec: ResolvedRun, cuda: bool, ran: set[str] | None = None,
               experts: set[str] | None = None) -> Iterator[tuple[TrainingStep, list[torch.Tensor]]]:
    """The run's TrainingStep on fake tensors (its policy applied and prepared, its optimizer made), and its batch's
    token ids (an encoder-decoder's: its input's and its targets'); inside, the fake mode and what makes CPU fakes
    act as the target would (`ran`, `experts`: where given, filled with the SDPA kernels and the experts' grouped
    matmuls the step runs). Any failure in here is the user's answer: a GcbenchError of one line."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config, _ = spec.model_config()
    sharded = spec.shard != "none"  # one rank of it, FSDP2 itself over a fake world (fake_ranks.py)
    adapter = parse_adapter(spec.adapter)
    # real tensors the fakes meet: bitsandbytes' quantisation maps (made with its optimizer, and qlora's 8-bit map
    # of the absmax values), and the meta tensors FSDP2's to_empty reads
    fake = FakeTensorMode(allow_non_fake_inputs=optimizer_kind(spec.optimizer).module is not None
                          or adapter.quantised or sharded)
    # peft on the meta model, so that its adapters become fakes with the rest (a 4-bit base: quantised as fakes)
    model = apply_adapter(build_model(config, "meta", spec.param_dtype), adapter, compute_dtype(spec), "meta")
    world = contextlib.ExitStack()
    if not sharded:
        materialise_as_fakes(model, fake)
    if adapter.quantised:
        with fake:
            quantise_fakes(model)
    stacks = block_lists(model)
    apply_to_stacks(spec.policy, stacks)
    _refuse_compiled(model, spec.policy)
    try:
        if sharded:  # as a rank does it: the policy first, then FSDP2 (runner._measure)
            world.enter_context(fake_world(spec.nproc))
            shard_as_fakes(model, stacks[0], spec.precision, fake)  # one stack (resolve)
        # made outside the fake mode: bitsandbytes computes its quantisation map from real values
        optimizer = make_optimizer(spec, model, multi_tensor=optimizer_kind(spec.optimizer).multi_tensor_on_cuda
                                   if cuda else None)
        steps_read_no_values(optimizer)
        # a dense model calls no grouped matmul: one dispatch mode less on every op (8% of a 7B simulation)
        grouped = GroupedMmShapes(experts) if experts_implementation(model) else contextlib.nullcontext()
        with fake, grouped, _unpacked_batch(), \
                (cuda_kernels(ran) if cuda else contextlib.nullcontext()), \
                quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL):
            inputs = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype)
                      in inputs_of(spec, config, spec.batch_size * spec.grad_accum).items()}
            step = TrainingStep(model, optimizer, batch_of(inputs, config), spec)
            # the whole batch, as the run holds it before its steps: a classifier's labels are a tensor of their own
            tokens = list({id(t.untyped_storage()): t for t in step.batch.values()}.values())
            scaler_finds_no_inf(step)  # --precision amp-fp16: its gradient scaler reads found_inf
            spec.policy.prepare(step)
            yield step, tokens
    except (GcbenchError, OutOfMemory):  # the replayed allocator's answer, not a failure of the simulation
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a policy on fake tensors is the user's answer
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise GcbenchError(f"simulate cannot run {spec.model} with policy {spec.policy} on fake tensors: "
                           f"{first_line}") from None
    finally:
        world.close()


def _device_state(step: TrainingStep, cuda: bool) -> list[torch.Tensor]:
    """The optimizer state a device holds: on CUDA, torch.optim keeps each parameter's 0-dim `step` count on the
    host unless the step is fused (optimizers.OptimizerKind.state says the same)."""
    if not cuda or step.optimizer is None:
        return step.optimizer_state()
    fused = any(group.get("fused") for opt in getattr(step.optimizer, "optimizers", {0: step.optimizer}).values()
                for group in opt.param_groups)
    return [v for state in step.optimizer.state.values() for k, v in state.items()
            if isinstance(v, torch.Tensor) and (fused or k != "step" or v.dim() > 0)]


def _paged_state(step: TrainingStep, optimizer: str, cuda: bool) -> list[torch.Tensor]:
    """The state tensors a paged optimizer would keep in CUDA managed memory: on the CPU fakes every state is an
    ordinary tensor, so those bitsandbytes' get_state_buffer pages on CUDA (`state1`/`state2` of a parameter that
    optimizers.OptimizerKind.paged names) are picked out by the same rule. None on a CPU target (an empty list)."""
    kind = optimizer_kind(optimizer)
    if not cuda or kind.paged is None or step.optimizer is None:
        return []
    return [state[key] for p, state in step.optimizer.state.items() if kind.paged(tuple(p.shape), 0, cuda)
            for key in ("state1", "state2") if key in state]


def _refuse_compiled(model: nn.Module, policy: Policy) -> None:
    # torch.compile on fake tensors crashes the whole process (segmentation fault, torch 2.13 CPU): refuse instead
    from torch._dynamo.eval_frame import OptimizedModule

    if any(isinstance(m, OptimizedModule) for m in model.modules()):
        raise GcbenchError(f"simulate cannot run policy {policy}: it compiles blocks with torch.compile, which does "
                           "not run on fake tensors")


def materialise_as_fakes(model: nn.Module, fake) -> None:
    """Replace every meta parameter and buffer by a CPU fake tensor of the same shape, dtype and strides.

    Tied weights stay tied (one fake per original tensor). Values are never read: a fake has none."""
    fakes: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with fake:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fakes[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        return fakes[id(t)]

    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    slots[name] = fake_of(t)


@contextlib.contextmanager
def _unpacked_batch() -> Iterator[None]:
    """Tell transformers' mask code that the batch holds one sequence per row and no padding, as the real run finds
    out.

    transformers reads position ids to detect packed sequences, and a padding mask (BART's decoder makes one of
    ones) to skip the mask for SDPA's `is_causal`, but refuses to read a fake tensor and then builds a full 4-D mask
    — a different (and larger) step than the real one, which runs without a mask. gcbench batches are never packed
    nor padded, so the answer the real run computes is known: no packing, and a padding mask that masks nothing,
    which reads as none. A VLM's check that its image placeholders number its features reads a count: batch_of
    places as many, so transformers' switch TRANSFORMERS_DISABLE_TORCH_CHECK skips it in the fake step."""
    import os
    from unittest import mock

    import transformers.masking_utils as masking

    unpadded = lambda check: lambda padding_mask, *args, **kwargs: check(None, *args, **kwargs)  # noqa: E731
    patches = {"find_packed_sequence_indices": lambda original: lambda position_ids: None,
               "_ignore_causal_mask_sdpa": unpadded, "_ignore_bidirectional_mask_sdpa": unpadded}
    originals = {name: getattr(masking, name) for name in patches if hasattr(masking, name)}
    for name, original in originals.items():
        setattr(masking, name, patches[name](original))
    try:
        with mock.patch.dict(os.environ, {"TRANSFORMERS_DISABLE_TORCH_CHECK": "1"}):
            yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


class GroupedMmShapes(TorchDispatchMode):
    """Mixture-of-experts layers multiply each expert's tokens with aten._grouped_mm. Its fake (meta) kernel takes
    bf16 only, while the CPU kernel, and CUDA's under amp, run fp32 as well: this computes the shape on bf16
    copies and returns a fake of the real dtype. Entered inside the fake mode and below the tracker, which sees
    the op and its output only, as in a real run. `ran`, where given, collects which grouped matmul the experts
    ran: grouped_mm (torch's), grouped_mm_fallback (transformers' loop over the experts, where torch's is not
    taken: cuda_target.cuda_grouped_mm)."""

    def __init__(self, ran: set[str] | None = None) -> None:
        super().__init__()
        self.ran = ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ran is not None and func.namespace in ("aten", "transformers") \
                and func.__name__ in ("_grouped_mm.default", "grouped_mm_fallback.default"):
            self.ran.add(func.__name__.removesuffix(".default").lstrip("_"))
        if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        dtype = kwargs.get("out_dtype") or args[0].dtype
        low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out = func(*low, **{**kwargs, "out_dtype": None})
        return torch.empty_strided(out.shape, out.stride(), dtype=dtype)
