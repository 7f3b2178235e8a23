"""Values a step reads, which fake tensors do not have: the simulation answers them as a real step would go on.

- The gradient scaler of --precision amp-fp16 (step.TrainingStep.scaler, torch.amp.GradScaler): before the
  optimizer steps, GradScaler.step reads whether any gradient was inf/NaN (torch/amp/grad_scaler.py,
  _maybe_opt_step: `found_inf.item()` per device). The simulation answers 0 (none was), so the optimizer steps, as
  in a real step that finds none. Everything else the scaler does runs on the fakes as it is: the scaled loss, the
  in-place unscale (_amp_foreach_non_finite_check_and_unscale_) and its 0-dim temporaries, the scale's update
  (_amp_update_scale_).
- An optimizer that reads a value (Adafactor's step count and norms through .item()): every read answered 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from gcbench.step import TrainingStep


class AnswerReads(TorchDispatchMode):
    """Answer every read of a value (.item(), aten._local_scalar_dense) with `value`, as the tensor's dtype reads it.
    Modes entered later answer first: the optimizer's own reads inside the scaler's step (1) before the scaler's (0)."""

    def __init__(self, value: int):
        super().__init__()
        self.value = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return bool(self.value) if t.dtype == torch.bool else float(self.value) if t.is_floating_point() \
                else self.value
        return func(*args, **(kwargs or {}))


def _stepping_with_reads(owner, value: int) -> None:
    """`owner.step` (a GradScaler's, an optimizer's) run under AnswerReads(value), and only it: elsewhere a read of a
    value stays an error, as a model's data-dependent shapes must."""
    original = owner.step

    def step(*args, **kwargs):
        with AnswerReads(value):
            return original(*args, **kwargs)

    owner.step = step


def scaler_finds_no_inf(step: TrainingStep) -> None:
    """The step's gradient scaler finds no inf/NaN (every read answered 0); nothing where the step has no scaler."""
    if step.scaler is not None:
        _stepping_with_reads(step.scaler, 0)


def steps_read_no_values(optimizer) -> None:
    """The optimizer's step (or each per-parameter one, stepped in backward) reads 1 wherever it reads a value:
    values never change what the step allocates."""
    inner = getattr(optimizer, "optimizers", {optimizer: optimizer} if optimizer is not None else {}).values()
    for opt in inner:
        _stepping_with_reads(opt, 1)
