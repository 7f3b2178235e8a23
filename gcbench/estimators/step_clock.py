"""StepClock: the dispatch mode that watches the simulated step (simulate.py) and writes down, op by op, the work each
op would make a CUDA card do (step_time.WORK items). What an op does, and how its time follows: step_time.py."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from gcbench.estimators.step_time import (
    _PHASE, ATTENTION, COLLECTIVE, CUDNN, DEQUANT, EFFICIENT, FLASH, FP32, GEMM, HOST_COPY, LOW, MEMORY, OPTIMIZER_8BIT,
    SYNC, WORK, StepWork)
from gcbench.host_work import PYTHON_ISSUING, WATCHING, listening_to_python_dispatch
from gcbench.measure import Listening

aten = torch.ops.aten

# Ops that launch nothing: metadata queries (what FlopCounterMode passes on undecomposed; they are answered on the
# host), profiler marks, allocations.
_METADATA = frozenset({
    aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
    aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
    aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default})
_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                          aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default,
                          aten.detach.default, aten.alias.default, aten._unsafe_view.default,
                          aten.set_.source_Storage_storage_offset, aten.resize_.default})
_GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
_GROUPED_GEMM_OP = getattr(aten, "_grouped_mm", None)  # the experts' grouped matmul (torch 2.8 on)
# SDPA's kernels: (kernel, backward, index of is_causal in the arguments)
_ATTENTION = {
    aten._scaled_dot_product_flash_attention.default: (FLASH, False, 4),
    aten._scaled_dot_product_flash_attention_backward.default: (FLASH, True, 11),
    aten._scaled_dot_product_efficient_attention.default: (EFFICIENT, False, 6),
    aten._scaled_dot_product_efficient_attention_backward.default: (EFFICIENT, True, 11),
}
for _name, _backward, _at in (("_scaled_dot_product_cudnn_attention", False, 6),
                              ("_scaled_dot_product_cudnn_attention_backward", True, 11)):
    if hasattr(aten, _name):
        _ATTENTION[getattr(aten, _name).default] = (CUDNN, _backward, _at)
_PURE_WRITES = frozenset({aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default,
                          aten.normal_.default, aten.uniform_.default})
# multi_tensor_apply's packing on CUDA 12 and newer (aten/src/ATen/native/cuda/MultiTensorApply.cuh,
# DepthToMaxConfig<true>, "large kernel arguments"): tensors and blocks per launch by list depth, chunk elements
CHUNK = 65536
MAX_TENSORS = 256
MAX_BLOCKS = (5272, 4863, 4453, 4044, 3634)


class StepClock(Listening):
    """Writes down the work of each op of the tracked step (module docstring); entered above the fake mode, beside
    the tracker. `host_resident`: ids of the storages a CUDA run keeps on the host (AdamW's step counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = 0
        self.host_resident: set[int] = set()
        self._rows: list[tuple] = []
        self._host_ops = [0, 0, 0]  # ops issued since the last item, by issuer (step_time.HOST)
        self._modes = 0  # Python dispatch-mode calls since the last item

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never under torch.compile (simulate refuses it)

    def _listener(self):
        return listening_to_python_dispatch(self._python_dispatch)

    def __enter__(self):
        WATCHING.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            WATCHING.remove(self)

    def marking(self, mark):
        """The step's `mark`, telling the clock each phase too (the zeroing of gradients before the forward's mark
        counts as forward)."""

        def marked(phase: str) -> None:
            if phase in _PHASE:
                self.phase = _PHASE[phase]
            mark(phase)

        return marked

    def work(self) -> StepWork:
        return StepWork(np.array(self._rows, dtype=WORK))

    def _python_dispatch(self) -> None:
        self._modes += 1

    def host_move(self, t: torch.Tensor, back: bool) -> None:
        """An offloaded activation's copy to the host or back (measure.moved_to_host)."""
        self._emit(HOST_COPY, bytes_=t.untyped_storage().nbytes())

    def _emit(self, kind: int, flops: float = 0.0, bytes_: float = 0.0, launches: int = 1, dtype: int = LOW,
              variant: int = 0, m: int = 0, n: int = 0, k: int = 0, batch: int = 0, waits: int = 0) -> None:
        self._rows.append((kind, self.phase, self._issuer(), dtype, variant, flops, bytes_, launches, m, n, k, batch,
                           *self._host_ops, self._modes, waits))
        self._host_ops, self._modes = [0, 0, 0], 0

    def _issuer(self) -> int:
        """Who issues the op now running: Python forward code (the forward, a recompute inside the backward),
        autograd's engine (the backward's own ops), the optimizer (its phase, or stepped in backward by a hook)."""
        return _PHASE[PYTHON_ISSUING[-1]] if self.phase == 1 and PYTHON_ISSUING else self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        role = _ROLES.get(func)
        if role is None:
            role = _ROLES[func] = _role(func)
        if role == _IGNORED:
            return out
        self._host_ops[self._issuer()] += 1
        if role == _NO_KERNEL:
            return out
        if role == _READ_BACK:
            if id(args[0].untyped_storage()) not in self.host_resident:
                self._emit(SYNC, launches=0)
            return out
        if self.host_resident and self.phase == 2:  # the optimizer's step counts may live on the host
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and all(id(t.untyped_storage()) in self.host_resident for t in tensors):
                return out  # computed on the host: nothing launched
        self._see(role, func, args, kwargs, out)
        return out

    def _see(self, role: int, func, args, kwargs, out) -> None:
        if role == _GEMM:
            a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            self._emit(GEMM, flops=2.0 * batch * m * n * k, bytes_=_bytes(func, args, kwargs, out),
                       dtype=LOW if a.dtype in (torch.bfloat16, torch.float16) else FP32, m=m, n=n, k=k, batch=batch)
        elif role == _ATTENTION_KERNEL:
            kernel, backward, at = _ATTENTION[func]
            query = args[1] if backward else args[0]
            key = args[2] if backward else args[1]
            causal = bool(args[at]) if len(args) > at else bool(kwargs.get("is_causal", False))
            b, h, sq, d = query.shape
            sk = key.shape[-2]
            flops = 4.0 * b * h * sq * sk * d * (0.5 if causal and sq == sk else 1.0) * (2.5 if backward else 1.0)
            self._emit(ATTENTION, flops=flops, variant=2 * kernel + backward)
        elif role == _GROUPED_GEMM:
            self._grouped_gemm(args, kwargs, out)
        elif role == _GEMM_4BIT:
            self._gemm_4bit(*args, **kwargs)
        elif role == _COLLECTIVE:
            gathered = args[0] if func.__name__.startswith("_allgather") else args[1]  # the larger of the two
            ranks = max(gathered.numel() // max(min(args[0].numel(), args[1].numel()), 1), 1)
            moved = _tensor_bytes(gathered) * (ranks - 1) / ranks
            self._emit(COLLECTIVE, bytes_=moved if ranks > 1 else 2 * _tensor_bytes(gathered))
        elif role == _DEQUANT:
            self._emit(DEQUANT, bytes_=_bytes(func, args, kwargs, out))
        elif role == _OPTIMIZER_8BIT:
            self._emit(OPTIMIZER_8BIT, bytes_=_bytes(func, args, kwargs, out))
        elif role == _COPY_OUT:
            self._emit(MEMORY, bytes_=_bytes(func, args, kwargs, out), waits=1)  # the all-gather's copy-out
        elif role == _MULTI_TENSOR:
            self._emit(MEMORY, bytes_=_bytes(func, args, kwargs, out), launches=_multi_tensor_launches(args, out))
        else:
            self._emit(MEMORY, bytes_=_bytes(func, args, kwargs, out))

    def _grouped_gemm(self, args, kwargs, out) -> None:
        """torch's grouped matmul of the experts: one matmul per group (expert) of an even share of the rows, the
        simulated router's load being balanced (docs/models.md). Forward and input gradient: a 2-D A's rows split
        among the groups, each times its own 3-D B; weight gradient: A and B (2-D) split along the summed size.
        bf16 runs one CUTLASS kernel on sm90 and sm100; any other dtype (fp32: amp's fp32 weights) runs torch's
        fallback (GroupedMMUtils.h, _grouped_mm_fallback): the offsets read back to the host, then one mm per group.
        On an sm80 card bf16 takes that fallback too, which is not charged here."""
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        groups = offs.shape[0] if offs is not None else a.shape[0]
        if a.dim() == 2 and b.dim() == 3:
            m, k, n = math.ceil(a.shape[0] / groups), a.shape[1], b.shape[-1]
        elif a.dim() == 2:
            m, k, n = a.shape[0], math.ceil(a.shape[1] / groups), b.shape[1]
        elif b.dim() == 2:
            m, k, n = a.shape[1], a.shape[2], math.ceil(b.shape[1] / groups)
        else:
            m, k, n = a.shape[1], a.shape[2], b.shape[2]
        one_kernel = a.dtype == torch.bfloat16
        if not one_kernel:
            self._emit(SYNC, launches=0)
        rows = a.shape[1:] if a.dim() == 3 and b.dim() == 2 else a.shape
        self._emit(GEMM, flops=2.0 * math.prod(rows) * b.shape[-1], bytes_=_bytes(aten._grouped_mm.default, args,
                   kwargs, out), launches=1 if one_kernel else groups,
                   dtype=LOW if a.dtype in (torch.bfloat16, torch.float16) else FP32, m=m, n=n, k=k, batch=groups)

    def _gemm_4bit(self, a, b, shape_b, absmax, *rest, **kwargs) -> None:
        """bitsandbytes' 4-bit matmul on CUDA past its fused-kernel rows: the weight dequantised whole (the packed
        weight and its absmax read, the weight written in A's dtype), then an ordinary matmul."""
        from gcbench.nf4 import GEMM_4BIT_FUSED_MAX_ROWS

        rows = math.prod(a.shape[:-1])
        n, k = shape_b[0], shape_b[1]
        if rows > GEMM_4BIT_FUSED_MAX_ROWS:
            self._emit(DEQUANT, bytes_=_tensor_bytes(b) + _tensor_bytes(absmax) + n * k * a.element_size())
            self._emit(GEMM, flops=2.0 * rows * n * k, bytes_=(rows * k + n * k + rows * n) * a.element_size(),
                       m=rows, n=n, k=k, batch=1)
        else:  # the fused kernel: bound by reading the packed weight
            self._emit(DEQUANT, bytes_=_tensor_bytes(b) + _tensor_bytes(absmax) + (rows * (k + n)) * a.element_size())


# What an op is to the clock, decided once per op (_role) and kept: the dispatch runs once per op of the step.
(_IGNORED, _NO_KERNEL, _READ_BACK, _GEMM, _ATTENTION_KERNEL, _GEMM_4BIT, _COLLECTIVE, _DEQUANT, _OPTIMIZER_8BIT,
 _COPY_OUT, _MULTI_TENSOR, _STREAMING, _GROUPED_GEMM) = range(13)
_ROLES: dict = {}


def _role(func) -> int:
    namespace, name = func.namespace, func.__name__
    if namespace in ("prim", "profiler") or func in _METADATA:
        return _IGNORED  # answered on the host, no dispatch cost of note
    if func in _ALLOCATIONS or func.is_view:
        return _NO_KERNEL
    if func is aten._local_scalar_dense.default:
        return _READ_BACK
    if func in _GEMMS:
        return _GEMM
    if _GROUPED_GEMM_OP is not None and func is _GROUPED_GEMM_OP.default:
        return _GROUPED_GEMM
    if func in _ATTENTION:
        return _ATTENTION_KERNEL
    if namespace == "bitsandbytes":
        return _GEMM_4BIT if name == "gemm_4bit.default" else _DEQUANT if name.startswith("dequantize") \
            else _OPTIMIZER_8BIT if name.startswith("optimizer_update_8bit") else _STREAMING
    if namespace == "c10d" and name in ("_allgather_base_.default", "_reduce_scatter_base_.default"):
        return _COLLECTIVE
    if namespace == "fsdp" and name == "split_with_sizes_copy.default":
        return _COPY_OUT
    if func.name().startswith(("aten::_foreach_", "aten::_fused_")):
        return _MULTI_TENSOR
    return _STREAMING


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes of `t`: its elements, a stride-0 (broadcast) dimension once
    (torch/utils/_runtime_estimation.py, get_num_bytes)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _bytes(func, args, kwargs, out) -> float:
    """Bytes an op moves: each input tensor read once, each output and written argument written once; a pure write
    (zero_, fill_, copy_'s destination) not read. Tensors are told apart by identity, not storage (an in-place op's
    output is its input)."""
    writes = _WRITES.get(func)
    if writes is None:
        writes = _WRITES[func] = tuple(a.alias_info is not None and a.alias_info.is_write
                                       for a in func._schema.arguments)
    pure = func in _PURE_WRITES
    total, written = 0, set()
    for i, value in enumerate(args):
        is_write = i < len(writes) and writes[i]
        for t in (value,) if isinstance(value, torch.Tensor) else tree_leaves(value) \
                if isinstance(value, (list, tuple)) else ():
            if isinstance(t, torch.Tensor):
                size = _tensor_bytes(t)
                if is_write:
                    written.add(id(t))
                    total += size if pure else 2 * size
                else:
                    total += size
    for t in tree_leaves(kwargs) if kwargs else ():
        if isinstance(t, torch.Tensor):
            total += _tensor_bytes(t)
    for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
        if isinstance(t, torch.Tensor) and id(t) not in written:
            total += _tensor_bytes(t)
    return float(total)


_WRITES: dict = {}  # per op: which of its schema's arguments it writes


def _multi_tensor_launches(args, out) -> int:
    """Kernel launches of one multi_tensor_apply over the op's tensor lists (MultiTensorApply.cuh): a launch per
    MAX_TENSORS tensors or MAX_BLOCKS chunks of CHUNK elements, whichever fills first. Depth: the lists it walks."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        lists.append(out)
    if not lists:
        return 1
    depth = min(len(lists), len(MAX_BLOCKS))
    launches, tensors, blocks = 0, 0, 0
    for t in lists[0]:
        if t.numel() == 0:
            continue
        chunks = -(-t.numel() // CHUNK)
        tensors += 1
        while chunks:
            take = min(chunks, MAX_BLOCKS[depth - 1] - blocks)
            blocks += take
            chunks -= take
            if blocks == MAX_BLOCKS[depth - 1] or (tensors == MAX_TENSORS and not chunks):
                launches += 1
                blocks = 0
                tensors = 0 if not chunks else 1
    return launches + (1 if blocks else 0) or 1
