"""Two exact shortcuts of the fake-tensor simulation (simulate.py), each held against the full path by
tests/test_estimate_speed.py and falling back to it wherever its proof does not hold.

- `prime`: the state a warm-up step leaves (a gradient per trainable parameter, the optimizer's state after one
  step) made directly instead of by a whole fake forward and backward: that pass is about half a simulation. A
  warm-up's gradient is what AccumulateGrad makes of the first gradient that reaches the parameter: a new tensor
  with the parameter's sizes and strides (torch/csrc/autograd/functions/accumulate_grad.h, clone_obey_contract), or
  the incoming gradient itself where it already has that layout ("stealing", obeys_layout_contract). The two
  differ in bytes only where the incoming gradient is a view into a larger storage, and a parameter no backward
  reaches has no gradient at all (nor optimizer state): `GradientCheck` watches the tracked step's backward for
  both, and the simulation runs again with a real warm-up if it sees either.
- `FlopTally`: FlopCounterMode's total counted on the tracked step itself instead of on a third pass. The counter
  (torch/utils/flop_counter.py, _FlopCounterMode) adds `flop_registry[op](args, out)` for every op, after trying
  to decompose any op that has a CompositeImplicitAutograd kernel; the tally cannot decompose (that would change
  the tracked step), so it marks itself inexact when such an op comes and the simulation counts in a pass of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from gcbench.optimizers import optimizer_kind
from gcbench.step import OptimizerInBackward

if TYPE_CHECKING:
    from gcbench.measure import PhasePeaks
    from gcbench.step import TrainingStep


def prime(step: TrainingStep, optimizer: str) -> GradientCheck | None:
    """Give `step` the gradients and optimizer state its warm-up step would leave, without running one; None where
    that is not proven for this optimizer (bitsandbytes keeps state torch.optim does not: its warm-up runs).

    Call inside the fake mode. The gradients are new tensors of each trainable parameter's layout; the optimizer
    makes its state from them as its first step would (Adam and AdamW directly: first_state; any other by stepping
    once), per parameter and the gradient dropped with the optimizer in backward: state from the shapes alone, as
    the warm-up's step makes it. The returned check must watch the tracked step."""
    if optimizer_kind(optimizer).module is not None:
        return None
    trainable = [p for p in step.model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
    if isinstance(step.optimizer, OptimizerInBackward):
        for p in trainable:
            if first_state(step.optimizer.optimizers[p]):
                p.grad = None  # dropped after its step, as the hook in backward does
            else:
                step.optimizer._step(p)  # steps it, then drops its gradient, as the hook in backward does
    elif step.optimizer is not None and not first_state(step.optimizer):
        step.optimizer_step()
    return GradientCheck(trainable)


def first_state(optimizer: torch.optim.Optimizer) -> bool:
    """Make the state torch.optim's Adam or AdamW (the exact classes) makes in its first step, without the step's
    arithmetic (a quarter of a 7B simulation on fakes, in foreach ops over every parameter): Adam._init_group makes
    it, for every parameter with a gradient, from the parameter's layout (torch/optim/adam.py: the step count, on the
    host unless fused or capturable, exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad); the step's own arithmetic
    then updates those in place, and a GradScaler's step and update leave nothing behind but its scale and growth
    tracker, changed in place. False for any other optimizer: its step runs. tests/test_estimate_speed.py holds
    the state to a real step's, and each lever's simulation to the full path's."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for group in optimizer.param_groups:
        optimizer._init_group(group, [], [], [], [], [], [])
    return True


class GradientCheck:
    """Watches a backward (a context manager around the tracked step) for what would make `prime`'s gradients differ
    from a warm-up's: a trainable parameter no gradient reaches, or a gradient that arrives as a view into a larger
    storage (AccumulateGrad could keep it, storage and all). `proven` after the step: neither happened."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self._reached: set[int] = set()
        self._views = False
        self._hooks: list = []

    def __enter__(self) -> GradientCheck:
        for p in self.params:
            self._hooks.append(p.register_hook(lambda grad, p=p: self._see(p, grad)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _see(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._reached.add(id(param))
        if grad.storage_offset() != 0 or grad.untyped_storage().nbytes() != _dense_bytes(param):
            self._views = True

    @property
    def proven(self) -> bool:
        return not self._views and len(self._reached) == len(self.params)


def _dense_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage empty_strided makes for `t`'s sizes and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


class FlopTally(TorchDispatchMode):
    """FlopCounterMode's total (module hooks left out: they keep tensors alive, which the tracker would count), over
    the forward and backward phases of a step marked through `marking`. Entered above the tracker, where the counter
    would sit. `exact`: no op came that the counter would have decomposed."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.exact = True
        self._on = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never under torch.compile (simulate refuses it); the guard would cost every op a wrapper

    def marking(self, phases: PhasePeaks):
        """The step's `mark`: `phases`' own, and counting on in forward and backward only (the optimizer's ops are
        not in a FLOPs pass)."""

        def mark(phase: str) -> None:
            self._on = phase in ("forward", "backward")
            phases(phase)

        return mark

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._on:
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **kwargs, out_val=out)
            elif func not in _NOT_DECOMPOSED and func not in ELEMENTWISE_DECOMPOSITIONS and _decomposes(func):
                self.exact = False
        return out


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_aten = torch.ops.aten
# Ops the counter decomposes into elementwise math only (no matmul, convolution or attention: nothing it counts), so
# their decomposition adds 0: silu_backward (its CompositeImplicitAutograd kernel, math_silu_backward in
# aten/src/ATen/native/Activation.cpp: grad * sigmoid(x) * (1 + x * (1 - sigmoid(x)))). tests/test_estimate_speed.py
# counts each.
ELEMENTWISE_DECOMPOSITIONS = frozenset({_aten.silu_backward.default})
# What the counter passes on undecomposed: prim.device, and the metadata queries it answers NotImplemented to
# (torch/utils/flop_counter.py, _FlopCounterMode.__torch_dispatch__)
_NOT_DECOMPOSED = frozenset({
    torch.ops.prim.device.default, torch.ops.prim.layout.default, _aten.sym_is_contiguous.default,
    _aten.is_contiguous.default, _aten.is_contiguous.memory_format, _aten.is_strides_like_format.default,
    _aten.is_non_overlapping_and_dense.default, _aten.size.default, _aten.sym_size.default, _aten.stride.default,
    _aten.sym_stride.default, _aten.storage_offset.default, _aten.sym_storage_offset.default, _aten.numel.default,
    _aten.sym_numel.default, _aten.dim.default})
_DECOMPOSES: dict = {}


def _decomposes(func) -> bool:
    """Whether FlopCounterMode would run `func` as its decomposition (OpOverload.decompose's own test)."""
    if func not in _DECOMPOSES:
        _DECOMPOSES[func] = _COMPOSITE in func.py_kernels or \
            torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
    return _DECOMPOSES[func]
