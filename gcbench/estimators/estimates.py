"""What a predictor returns: `Estimate`, one predicted peak and its parts, and its row for `gcbench estimate`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gcbench.fields import ESTIMATE_FIELDS, POLICY_OPTIONS
from gcbench.resolved import ResolvedRun

if TYPE_CHECKING:
    from gcbench.estimators.step_time import StepWork

# The spec fields an estimate row carries, stored as in every record: those `gcbench estimate` takes (fields.py),
# `policy` the name and `policy_options` its options. The rest of a spec (device, steps, seed) does not change a
# prediction; the spec's device is always "cpu" here anyway, and the row's `target` says what was predicted.
ROW_SPEC_FIELDS = (*ESTIMATE_FIELDS, POLICY_OPTIONS)

# Told of each prediction done, from any thread: (done, total, what was just predicted). A fit's total grows
# while it searches (its sizes are chosen one by one).
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Estimate:
    """One prediction: the step's peak and what it is made of, in bytes."""

    method: str  # analytic | simulate
    target: str  # cuda (max_memory_allocated) | cpu (peak_tracked_bytes)
    peak_bytes: int  # whole step: forward, backward and optimizer step
    param_bytes: int  # parameters and buffers
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # the rest at the peak: saved activations, temporaries, recompute, the batch
    peak_phase: str  # forward | backward | optimizer: the phase that reaches the step's peak
    forward_peak_bytes: int  # the peak of each phase (results.schema.PHASES), as a measured record has them
    backward_peak_bytes: int
    optimizer_peak_bytes: int | None  # None: no step after backward (optimizer none, or stepped in backward)
    n_params: int  # parameters (tied weights once): model state per parameter = (params + grads + optim.) / this
    # the SDPA kernel the prediction assumes (flash, efficient, math, cpu-flash, eager; kernels joined by + where a
    # simulated step's attention calls ran several)
    attention_kernel: str
    seconds: float  # how long the prediction took
    flops: int | None = None  # of one step's forward and backward, recompute included (simulate; analytic: None)
    # Set when this prediction stands in for another method's, which could not make it: why that one could not
    # (the analytic model for a policy or family it has no formulas for, predicted by the simulation instead).
    stands_in: str | None = None
    # Optimizer state in CUDA managed memory (bitsandbytes' paged optimizers): outside torch's allocator, so neither
    # in optimizer_bytes nor in the peak; 0 on a CPU target. None: the optimizer pages nothing.
    optimizer_paged_bytes: int | None = None
    # With a card's memory to fit (estimate --gpu/--gpu-memory, simulate on a CUDA target): PyTorch's caching
    # allocator replayed on the step (caching_allocator.py): what max_memory_reserved would read, and whether
    # cudaMalloc runs out on that card even after the cached segments go back. None: not replayed.
    reserved_bytes: int | None = None
    runs_out: bool | None = None
    # What the step makes a CUDA card do, op by op (step_time.StepWork): its time on a card is work.time(rates).
    # None: not simulated for a CUDA target (the analytic formulas, a CPU target, the per-rank model).
    work: StepWork | None = field(default=None, repr=False, compare=False)
    # How the mixture-of-experts layers multiply: the grouped matmul the simulated step's experts ran (grouped_mm:
    # torch's; grouped_mm_fallback: transformers' loop over the experts), else transformers' experts_implementation
    # (models.experts_implementation). None: a dense model, or a prediction that did not run the step (analytic).
    experts_kernel: str | None = None

    def fits(self, memory_bytes: int) -> bool | None:
        """Whether the step fits in `memory_bytes`: the replayed allocator's answer where it ran on that memory,
        else the predicted peak against it (None where there is no prediction)."""
        return not self.runs_out if self.runs_out is not None else self.peak_bytes <= memory_bytes

    @property
    def state_bytes_per_param(self) -> float:
        """Parameters, gradients and optimizer state per parameter: the precision and optimizer's layout (AdamW:
        16 under amp-bf16, 8 in pure bf16)."""
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes) / self.n_params

    def as_record(self, spec: ResolvedRun) -> dict[str, Any]:
        """Flat, JSON-ready: the spec's shape fields as a record stores them, then the prediction.

        Show the policy with results.schema.policy_label(row), as for any record."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "work"}
        return _paged_only({**_spec_fields(spec), **own, "not_available": None})


@dataclass(frozen=True)
class Unavailable:
    """A config a method cannot predict, and why: one cell of an estimate grid shown as n/a, not an abort."""

    method: str
    target: str
    reason: str

    def fits(self, memory_bytes: int) -> bool | None:
        return None

    def as_record(self, spec: ResolvedRun) -> dict[str, Any]:
        # every key an Estimate row has, None where there is no prediction, so that JSON rows share one shape
        empty = {f.name: None for f in dataclasses.fields(Estimate) if f.name != "work"}
        return _paged_only({**_spec_fields(spec), **empty, "method": self.method, "target": self.target,
                            "not_available": self.reason})


def _spec_fields(spec: ResolvedRun) -> dict[str, Any]:
    """The spec's fields a row carries (ROW_SPEC_FIELDS), and the model's stacks where it has several, as a run's
    record names them ("encoder:2,decoder:2": --layers keeps that many blocks of each)."""
    from gcbench.blocks import stack_text

    fields = spec.as_record()
    return {**{name: fields[name] for name in ROW_SPEC_FIELDS}, "stacks": stack_text(spec.model_config()[0])}


def _paged_only(row: dict[str, Any]) -> dict[str, Any]:
    """A row without `optimizer_paged_bytes` where it is None (an optimizer that pages nothing, an unavailable
    cell), nor the replayed allocator's fields where it did not run, nor `experts_kernel` without experts, nor
    `stacks` for a model of one stack: other rows keep the keys they had before."""
    for key in ("optimizer_paged_bytes", "reserved_bytes", "runs_out", "experts_kernel", "stacks"):
        if row.get(key) is None:
            row.pop(key, None)
    return row
