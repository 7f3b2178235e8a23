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


class NoInfFound(TorchDispatchMode):
    """Answer every read of a value with 0. Entered around the scaler's step only: the optimizer's own reads inside
    it (ScalarReads, entered later) are answered first by that mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0 if not args[0].is_floating_point() else 0.0
        return func(*args, **(kwargs or {}))


def scaler_finds_no_inf(step: TrainingStep) -> None:
    """Run the step's gradient scaler's step under NoInfFound (nothing where the step has no scaler)."""
    if step.scaler is None:
        return
    original = step.scaler.step

    def scaler_step(*args, **kwargs):
        with NoInfFound():
            return original(*args, **kwargs)

    step.scaler.step = scaler_step


class ScalarReads(TorchDispatchMode):
    """An optimizer step that reads a value (Adafactor's step count and norms through .item()) cannot run on fake
    tensors, which have none. Values never change what the step allocates: answer every read with 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        return func(*args, **(kwargs or {}))


def steps_read_no_values(optimizer) -> None:
    """Run the optimizer's step (or each per-parameter one, stepped in backward) under ScalarReads, and only the
    step: elsewhere a read of a value stays an error, as a model's data-dependent shapes must."""
    inner = getattr(optimizer, "optimizers", {optimizer: optimizer} if optimizer is not None else {}).values()
    for opt in inner:
        original = opt.step

        def step(*args, _original=original, **kwargs):
            with ScalarReads():
                return _original(*args, **kwargs)

        opt.step = step
