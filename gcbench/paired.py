"""Policies timed paired: the step times of several policies of one configuration (same model, seq, batch, and every
other option) measured interleaved in one process, so that their ratio is not the ratio of two runs minutes apart
on a drifting machine.

One model is built (the same weights, optimizer and batch for every policy); a round runs one step of every
policy, each applied to the blocks before its step and removed after it, the order rotated by one each round
(timing.paired_rounds), each step timed inside its policy. On CUDA a round's steps run back to back
(CudaInstrument.timed_round): applying and removing a policy is the host's work, done while the GPU still runs the
step before. Memory is not measured here: each policy's own run did that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from gcbench.estimators import resolve_plan
from gcbench.instruments import CudaInstrument, Progress, instrument_for
from gcbench.adapters import apply_adapter, compute_dtype, parse_adapter
from gcbench.models import block_lists, build_model
from gcbench.policies import apply_to_stacks
from gcbench.results.schema import policy_label
from gcbench.runner import torch_threads
from gcbench.resolved import ResolvedRun, resolve
from gcbench.step import TrainingStep, make_batch, make_optimizer
from gcbench.timing import paired_fields, paired_rounds


def pairable(spec: ResolvedRun) -> bool:
    """Whether a policy can be timed paired. A compiling policy cannot: applying it resets Dynamo (which does not
    guard on its options), so every round would compile again; nor a sharded run, whose step is its ranks'; nor
    compiled blocks (--compile blocks), which the rounds here would run uncompiled. Their ratio stays the unpaired
    one."""
    return not spec.policy.compiles and spec.shard == "none" and spec.compile == "none"


def choose_baseline(records: Sequence[dict[str, Any]]) -> str:
    """The policy the others' times are relative to: `none` when it ran, else the cheapest that ran (the fewest
    FLOPs with recompute, then the fastest step), so that a ratio still reads as "what the extra recompute costs"."""
    labels = {policy_label(r): r for r in records}
    if "none" in labels:
        return "none"
    inf = float("inf")
    return min(labels, key=lambda label: (labels[label].get("flops") or inf, labels[label]["step_ms_median"]))


def run_paired(specs: Sequence[ResolvedRun], baseline: str, progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Time `specs` (one configuration under several policies; each may have its own seq and batch) interleaved;
    per policy label its paired fields
    (timing.paired_fields: time_ratio to `baseline`, its interval, the step times) and how the rounds stopped.
    torch.OutOfMemoryError propagates: the caller records why nothing was paired."""
    progress = progress or (lambda _: None)
    specs = [resolve_plan(resolve(s)) for s in specs]
    first = specs[0]
    labels = [policy_label(s.as_record()) for s in specs]
    if baseline not in labels or len(set(labels)) < 2:
        raise ValueError(f"paired timing needs two policies or more, the baseline {baseline!r} among them")
    # The model of the longest sequence (its position tables hold every other); each spec its own batch, so that
    # the largest batch of each policy (gcbench fit) is timed paired too.
    config, _ = max(specs, key=lambda s: s.seq_len).model_config()
    instrument = instrument_for(first.device, first.memory_cap_bytes)
    with torch_threads(first.threads), instrument.session():
        progress("building model")
        torch.manual_seed(first.seed)
        adapter = parse_adapter(first.adapter)
        model = build_model(config, adapter.build_device(first.device), first.param_dtype)
        # the specs differ in their policy and batch only: one adapter, applied before any policy (as runner.py)
        model = apply_adapter(model, adapter, compute_dtype(first), first.device)
        stacks = block_lists(model)
        optimizer = make_optimizer(first, model)
        steps = {label: TrainingStep(model, optimizer, make_batch(spec, spec.model_config()[0], first.device), spec)
                 for label, spec in zip(labels, specs)}
        by_label = dict(zip(labels, specs))

        @contextmanager
        def policy(label: str) -> Iterator[None]:
            # Applied and removed around every step, outside its timing: a policy may change more than the block
            # list (`attn` switches the attention modules' config), and removing it restores everything.
            spec = by_label[label]
            undo = apply_to_stacks(spec.policy, stacks)
            spec.policy.prepare(steps[label])
            try:
                yield
            finally:
                undo()

        def timed(label: str) -> float:  # CPU: the step alone, its policy applied and removed outside the timing
            with policy(label):
                return instrument.timed(steps[label])

        for label in labels:
            with policy(label):
                instrument.warm_up(steps[label], first.warmup_steps,
                                   lambda text, label=label: progress(f"{label}: {text}"))
        # CUDA: a round's steps back to back, each timed inside its policy (CudaInstrument.timed_round)
        back_to_back = (lambda order: instrument.timed_round([(partial(policy, label), steps[label])
                                                              for label in order])) \
            if isinstance(instrument, CudaInstrument) else None
        times, stop = paired_rounds({label: (lambda label=label: timed(label)) for label in labels}, baseline,
                                    first.budget, instrument.clock, progress, run_round=back_to_back)
    return {label: {**paired_fields(times, label, baseline), "paired_rounds": len(times[label]), "paired_stop": stop}
            for label in labels}
