"""The optimizers a run can step with, each in one place: how it is made, what state it keeps per parameter, and
what its step allocates on top (the runner builds them, the estimators count them, the spec lists them).

Imports nothing heavy: the command line reads the names. The byte counts follow the optimizers'
own code (torch.optim, bitsandbytes.optim); tests/test_levers.py holds them against the state a real step creates.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError, quiet_logger

LR = 1e-5

# bitsandbytes: parameters with fewer elements keep 32-bit state (Optimizer8bit's min_8bit_size); larger ones keep
# two uint8 states, quantised in blocks of 256 elements, each block with an fp32 absolute maximum, and two 256-entry
# fp32 quantisation maps per optimizer.
BNB_MIN_8BIT_SIZE, BNB_BLOCK, BNB_QMAP_BYTES = 4096, 256, 2 * 256 * 4
# bitsandbytes' paged optimizers (optim/optimizer.py, Optimizer8bit.get_state_buffer): on CUDA a state buffer
# (state1/state2) of a parameter with at least this many elements comes from functional.get_paged, i.e.
# cudaMallocManaged: unified memory outside torch's caching allocator, which the driver pages to host memory under
# pressure. Smaller parameters' buffers, the absmax vectors and the quantisation maps are ordinary torch tensors. On
# CPU every buffer is an ordinary tensor (get_state_buffer returns zeros_like there).
BNB_PAGED_MIN_SIZE = 100_000  # `p.numel() < 1e5` -> torch.zeros_like


@dataclass(frozen=True)
class OptimizerKind:
    """One `--optimizer` value."""

    name: str
    make: Callable[[list[Any], bool | None], Any]  # (params, multi_tensor) -> a torch.optim.Optimizer;
    # multi_tensor None = torch's default for the device (the multi-tensor `foreach` path on CUDA, a loop on CPU)
    state: Callable[[Sequence[int], int, bool], list[int]]  # (param shape, bytes per element, cuda) -> bytes of
    # each state tensor it keeps in device memory for that parameter, inside torch's allocator (counted in the peak)
    temporaries: Callable[[list[int], bool], int]  # (bytes of each parameter, multi_tensor) -> the most its step
    # allocates at once above the state
    multi_tensor_on_cuda: bool = False  # torch's default path on CUDA is the multi-tensor (foreach) one
    # (param shape, bytes per element, cuda) -> bytes of each state tensor it keeps in CUDA managed memory
    # (bitsandbytes' paged buffers): outside torch's allocator, so not in max_memory_allocated, nor in `state`
    paged: Callable[[Sequence[int], int, bool], list[int]] | None = None  # None: it pages nothing
    shared_state: Callable[[list[tuple[int, ...]]], int] = lambda shapes: 0  # bytes kept once per optimizer
    # object over parameters of these shapes (with the optimizer in backward: one object per parameter)
    module: str | None = None  # the package it needs beyond torch
    extra: str | None = None  # the gcbench extra that installs that package

    @property
    def steps(self) -> bool:
        return self.name != "none"

    def shared_bytes(self, shapes: list[tuple[int, ...]], in_backward: bool) -> int:
        """State kept per optimizer object rather than per parameter, over all of `shapes`."""
        return sum(self.shared_state([s]) for s in shapes) if in_backward else self.shared_state(shapes)

    def paged_bytes(self, shapes: list[tuple[int, ...]], cuda: bool) -> int:
        """Bytes of state over parameters of `shapes` that live in CUDA managed memory (0 on CPU, and for every
        optimizer but the paged ones)."""
        return sum(sum(self.paged(s, 0, cuda)) for s in shapes) if self.paged else 0

    def check_installed(self) -> None:
        """GcbenchError in one line when the package this optimizer needs cannot be imported."""
        if self.module is None:
            return
        if importlib.util.find_spec(self.module) is None:
            raise GcbenchError(f"--optimizer {self.name} needs {self.module}, which is not installed: "
                               f"pip install 'gcbench[{self.extra}]'")

    def build(self, params: list[Any], multi_tensor: bool | None = None) -> Any:
        """The optimizer over `params` (None for `none`); a package that fails to load is one GcbenchError line."""
        self.check_installed()
        try:
            return self.make(params, multi_tensor)
        except (ImportError, OSError, RuntimeError) as e:
            if self.module is None:
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise GcbenchError(f"--optimizer {self.name}: {self.module} cannot run here: {first}") from None


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _host_step(cuda: bool) -> list[int]:
    # torch.optim keeps its 0-dim fp32 `step` on the host unless fused or capturable: device memory only on CPU
    return [] if cuda else [4]


def _adam_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    return [_numel(shape) * elem] * 2 + _host_step(cuda)  # exp_avg, exp_avg_sq


def _fused_adam_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    return [_numel(shape) * elem] * 2 + [4]  # the fused kernel keeps `step` on the device


def _adafactor_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    """Factored second moment: a row and a column vector for a matrix, a full one for a vector; no momentum."""
    if len(shape) > 1:
        rows, cols = _numel(shape[:-1]), _numel(shape[:-2]) * shape[-1]
        return [rows * elem, cols * elem] + _host_step(cuda)
    return [_numel(shape) * elem] + _host_step(cuda)


def _adamw8bit_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    n = _numel(shape)
    if n < BNB_MIN_8BIT_SIZE:
        return [n * 4] * 2  # 32-bit state for small tensors, fp32 whatever the parameter's dtype
    return [n, n] + [math.ceil(n / BNB_BLOCK) * 4] * 2  # two uint8 states, two absmax vectors


def _paged_on(shape: Sequence[int], cuda: bool) -> bool:
    return cuda and _numel(shape) >= BNB_PAGED_MIN_SIZE


def _paged_adamw8bit_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    # the two uint8 states are paged on CUDA; the absmax vectors never are (torch.zeros in init_state)
    state = _adamw8bit_state(shape, elem, cuda)
    return state[2:] if _paged_on(shape, cuda) else state


def _paged_adamw8bit_paged(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    return [_numel(shape)] * 2 if _paged_on(shape, cuda) else []


def _paged_adamw32bit_state(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    # two fp32 states whatever the parameter's dtype (Optimizer2State.init_state, optim_bits 32)
    return [] if _paged_on(shape, cuda) else [_numel(shape) * 4] * 2


def _paged_adamw32bit_paged(shape: Sequence[int], elem: int, cuda: bool) -> list[int]:
    return [_numel(shape) * 4] * 2 if _paged_on(shape, cuda) else []


def _bnb_qmaps(shapes: list[tuple[int, ...]]) -> int:
    # the quantisation maps exist once an optimizer holds a parameter with 8-bit state
    return BNB_QMAP_BYTES if any(_numel(s) >= BNB_MIN_8BIT_SIZE for s in shapes) else 0


def _adamw_temporaries(sizes: list[int], multi_tensor: bool) -> int:
    # multi-tensor: sqrt(exp_avg_sq) of every parameter at once (_multi_tensor_adamw); one at a time: the square
    # root and its bias-corrected copy of the largest parameter
    return sum(sizes) if multi_tensor else 2 * max(sizes, default=0)


def _adafactor_temporaries(sizes: list[int], multi_tensor: bool) -> int:
    # the full variance estimate (row @ col), for every parameter at once or for the largest one
    return sum(sizes) if multi_tensor else max(sizes, default=0)


def _none(sizes: list[int], multi_tensor: bool) -> int:
    return 0


def _make_adamw(foreach: bool | None = None, fused: bool | None = None) -> Callable[[list[Any], bool | None], Any]:
    def make(params: list[Any], multi_tensor: bool | None) -> Any:
        import torch

        if fused:
            return torch.optim.AdamW(params, lr=LR, fused=True)
        return torch.optim.AdamW(params, lr=LR, foreach=multi_tensor if foreach is None else foreach)
    return make


def _make_sgd(params: list[Any], multi_tensor: bool | None) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=multi_tensor)


def _make_adafactor(params: list[Any], multi_tensor: bool | None) -> Any:
    import torch

    return torch.optim.Adafactor(params, lr=LR, foreach=multi_tensor)


def _make_bnb(name: str) -> Callable[[list[Any], bool | None], Any]:
    def make(params: list[Any], multi_tensor: bool | None) -> Any:
        with quiet_logger("bitsandbytes"):  # its CPU backend warns at import of 4-bit kernels it does not use
            bnb = importlib.import_module("bitsandbytes.optim")
        # A paged optimizer on CPU warns at its first step that it falls back to ordinary tensors: what
        # BNB_PAGED_MIN_SIZE's comment and the record's optimizer_paged_bytes (0 on CPU) say already.
        warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU", UserWarning)
        return getattr(bnb, name)(params, lr=LR)
    return make


OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in (
    # AdamW as torch runs it by default: on CUDA the multi-tensor path (a temporary the size of all parameters in
    # the step), on CPU one parameter at a time; 2 states per parameter
    OptimizerKind("adamw", _make_adamw(), _adam_state, _adamw_temporaries, multi_tensor_on_cuda=True),
    # AdamW one parameter at a time (foreach=False): the step's temporaries are the largest parameter's
    OptimizerKind("adamw-loop", _make_adamw(foreach=False), _adam_state,
                  lambda sizes, multi_tensor: _adamw_temporaries(sizes, False)),
    # AdamW in one fused kernel (fused=True): no temporaries
    OptimizerKind("adamw-fused", _make_adamw(fused=True), _fused_adam_state, _none),
    # SGD with momentum 0.9, in place (multi-tensor on CUDA, no temporaries either way); 1 state per parameter
    OptimizerKind("sgd", _make_sgd, lambda shape, elem, cuda: [_numel(shape) * elem], _none,
                  multi_tensor_on_cuda=True),
    # torch.optim.Adafactor: factored second moment, no momentum; one parameter at a time on every device (torch
    # takes its multi-tensor path only when asked: foreach=True)
    OptimizerKind("adafactor", _make_adafactor, _adafactor_state, _adafactor_temporaries),
    # bitsandbytes AdamW8bit: 2 one-byte states per element (blockwise quantised); the extra gcbench[bnb]
    OptimizerKind("adamw8bit", _make_bnb("AdamW8bit"), _adamw8bit_state, _none, shared_state=_bnb_qmaps,
                  module="bitsandbytes", extra="bnb"),
    # bitsandbytes PagedAdamW8bit: adamw8bit's state, its uint8 states of parameters of >= 100k elements in CUDA
    # managed memory (paged: outside max_memory_allocated)
    OptimizerKind("paged_adamw8bit", _make_bnb("PagedAdamW8bit"), _paged_adamw8bit_state, _none,
                  shared_state=_bnb_qmaps, paged=_paged_adamw8bit_paged, module="bitsandbytes", extra="bnb"),
    # bitsandbytes PagedAdamW32bit: two fp32 states per element, those of parameters of >= 100k elements paged
    OptimizerKind("paged_adamw32bit", _make_bnb("PagedAdamW32bit"), _paged_adamw32bit_state, _none,
                  paged=_paged_adamw32bit_paged, module="bitsandbytes", extra="bnb"),
    # no optimizer step: forward and backward only
    OptimizerKind("none", lambda params, multi_tensor: None, lambda shape, elem, cuda: [], _none),
)}


def optimizer_kind(name: str) -> OptimizerKind:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise GcbenchError(f"unknown optimizer {name!r} ({', '.join(OPTIMIZERS)})") from None
