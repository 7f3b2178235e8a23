"""The gradient scaler of --precision amp-fp16 (step.TrainingStep.scaler, torch.amp.GradScaler) on fake tensors.

Before the optimizer steps, GradScaler.step reads whether any gradient was inf/NaN (torch/amp/grad_scaler.py,
_maybe_opt_step: `found_inf.item()` per device), which a fake tensor cannot answer: it has no value. The simulation
answers 0 (none was), so the optimizer steps, as in a real step that finds none. Everything else the scaler does
runs on the fakes as it is: the scaled loss, the in-place unscale (_amp_foreach_non_finite_check_and_unscale_) and
its 0-dim temporaries, the scale's update (_amp_update_scale_).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from gcbench.step import TrainingStep


class NoInfFound(TorchDispatchMode):
    """Answer every read of a value with 0. Entered around the scaler's step only: the optimizer's own reads inside
    it (simulate.ScalarReads, entered later) are answered first by that mode."""

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
