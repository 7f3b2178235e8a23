"""What a CUDA target does differently from the CPU fakes the simulation runs (simulate.py), put back: the
allocator's 512-byte blocks and the workspaces kernels allocate inside their ops (AllocatorModel), and the
attention kernel CUDA would pick, with its outputs' shapes (cuda_kernels)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from gcbench.nf4 import gemm_4bit_workspace_bytes
from gcbench.estimators.shape import CUDA_BLOCK_BYTES, cuda_kernel
from gcbench.measure import Listening, LiveTensorTracker, listening_to_host_moves
from gcbench.units import round_up


class AllocatorModel(LiveTensorTracker, Listening):
    """The live-tensor tracker, counting as the target device would: on CUDA, 512-byte blocks plus the workspace
    a kernel allocates internally (invisible to a dispatch mode, but part of max_memory_allocated)."""

    def __init__(self, cuda: bool):
        super().__init__(granularity_bytes=CUDA_BLOCK_BYTES if cuda else 1)
        self.cuda = cuda
        self.also: Callable[[torch.Tensor, bool], None] | None = None  # told of each host move too (a replay)
        # given a list: (op, its high-water mark) appended for each op that allocates (layer_scaling.py)
        self.highs: list[tuple[str, int]] | None = None

    def _listener(self):
        return listening_to_host_moves(self._host_move) if self.cuda else contextlib.nullcontext()

    def outside(self, tensors: list[torch.Tensor]) -> None:
        """Storages that live outside the allocator (bitsandbytes' paged state, CUDA managed memory): known, so that
        an op returning one does not count it, and never counted."""
        for t in tensors:
            self._live.setdefault(id(t.untyped_storage()), 0)

    def _host_move(self, t: torch.Tensor, back: bool) -> None:
        """An offloaded activation leaves the GPU (its bytes stop counting) or comes back (they count again): on
        the CPU fakes the tensor itself stands for both copies."""
        if self.also is not None:
            self.also(t, back)
        key = id(t.untyped_storage())
        if key not in self._live:
            return
        nbytes = round_up(t.untyped_storage().nbytes(), self.granularity_bytes)
        if back and self._live[key] == 0:
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        elif not back and self._live[key]:
            self.current -= self._live[key]
            self._live[key] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before, live = self.peak, self.current
        if self.highs is not None:
            self.peak = live  # this op's own high, then the running peak again
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.cuda:
            self.peak = max(self.peak, self.current + kernel_workspace_bytes(func, args, kwargs))
        if self.highs is not None:
            if self.peak > live:
                self.highs.append((str(func), self.peak))
            self.peak = max(before, self.peak)
        return out


def kernel_workspace_bytes(func, args, kwargs) -> int:
    """What a CUDA kernel allocates inside the op `func`, where no dispatch mode sees it, freed when it returns:
    FlashAttention's backward scratch and bitsandbytes' 4-bit matmul fallback; 0 for any other op."""
    if func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
        return flash_backward_workspace_bytes(args[1], args[2])
    if func.namespace == "bitsandbytes" and func.__name__ == "gemm_4bit.default":
        return gemm_4bit_workspace_bytes(CUDA_BLOCK_BYTES, *args, **(kwargs or {}))
    return 0


def flash_backward_workspace_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """Scratch of FlashAttention-2's backward (flash_api.cpp, mha_bwd): softmax_d and the fp32 dq accumulator,
    plus dk/dv at full head count when K/V have fewer heads (GQA). query/key: (batch, heads, seq, head_dim)."""
    b, h, s, d = query.shape
    s_rounded, d_rounded = round_up(s, 128), round_up(d, 32 if d <= 128 else 64)
    softmax_d = round_up(b * h * s_rounded * 4, CUDA_BLOCK_BYTES)
    dq_accumulator = round_up(b * s_rounded * h * d_rounded * 4, CUDA_BLOCK_BYTES)
    total = softmax_d + dq_accumulator
    if key.shape[1] != h:
        total += 2 * round_up(b * key.shape[2] * h * d * key.element_size(), CUDA_BLOCK_BYTES)
    return total


@contextlib.contextmanager
def cuda_kernels(ran: set[str] | None = None) -> Iterator[None]:
    """Route attention and dropout to the aten kernels CUDA would run, on CPU fake tensors; `ran`, where given,
    collects the names of the SDPA kernels chosen (what the prediction assumes, as the model's code called them).

    CPU and CUDA keep different tensors for backward. SDPA: CPU falls back to the math path (seq x seq
    probabilities kept) whenever dropout is on, CUDA flash never keeps them; the CUDA kernels' meta functions give
    their exact outputs and saved tensors without a GPU. Autocast lists SDPA as a lower-precision op on CUDA, so
    under amp its inputs are cast first (calling the kernel directly would skip that). Dropout: CPU keeps a noise
    tensor of the input's dtype, CUDA's fused kernel a bool mask. Softmax: CUDA autocast runs it in fp32
    (autocast_mode.cpp: softmax is an fp32_set_opt_dtype op), CPU autocast in the input's 16-bit dtype; and a
    16-bit CUDA input asked for in fp32 is read as it is (at::softmax calls _softmax(x, dim, half_to_float=True)),
    where CPU first makes an fp32 copy of it. Only calls through torch.nn.functional.softmax are routed (eager
    attention's); Tensor.softmax and the losses' log_softmax are not. Mixture-of-experts layers take the grouped
    matmul CUDA would (cuda_grouped_mm)."""
    import torch.nn.functional as F

    original_sdpa, original_dropout, original_softmax = F.scaled_dot_product_attention, F.dropout, F.softmax

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        kernel = cuda_kernel(query.dtype, attn_mask is not None, query.shape[-1], (query.shape[1], key.shape[1]),
                             enable_gqa, value.shape[-1])
        if ran is not None:
            ran.add(kernel)
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # CUDA turns a bool mask into an additive one
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(bias.logical_not(), -math.inf)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
        return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0 or inplace:
            return original_dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            return original_softmax(input, dim, _stacklevel, dtype)
        sixteen = input.dtype in (torch.float16, torch.bfloat16)
        if dtype is None and sixteen and torch.is_autocast_enabled("cpu"):
            dtype = torch.float32  # CUDA autocast's fp32_set_opt_dtype
        if dtype == torch.float32 and sixteen:
            return torch._softmax(input, dim, True)  # half_to_float: no fp32 copy of the input
        if dtype is not None:
            input = input.to(dtype)
        return torch._softmax(input, dim, False)

    F.scaled_dot_product_attention, F.dropout, F.softmax = sdpa, dropout, softmax
    try:
        with cuda_grouped_mm():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout, F.softmax = original_sdpa, original_dropout, original_softmax


@contextlib.contextmanager
def cuda_grouped_mm() -> Iterator[None]:
    """transformers' experts (integrations/moe.py, grouped_mm_experts_forward, the default experts_implementation)
    multiply through torch's grouped matmul where _can_use_grouped_mm says so, else through transformers' own op
    (grouped_mm_fallback: a loop of torch.mm over the experts). That answer depends on the weights' device: on CUDA,
    torch.nn.functional.grouped_mm or torch._grouped_mm on sm80 and newer (torch._grouped_mm before torch 2.9:
    sm90 only); on CPU, whether torch has a CPU kernel (from torch 2.9) and, up to torch 2.10, the pointers'
    alignment, which a fake tensor has none of. On the CPU fakes it is answered as on the card the CUDA target
    stands for (sm80 or newer, as its attention kernels; sm90 where torch is older than 2.9). What else in the
    experts reads the device, the dtype histc counts tokens in (float32 on CPU, int32 on CUDA), has the same bytes."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without its experts integration (before 5)
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    torch_has = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    moe._can_use_grouped_mm = lambda input, weight, offs: torch_has
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA's math kernel as CUDA runs it: torch's _scaled_dot_product_attention_math (attention.cpp) op for op,
    save where the CPU fakes would take another path than CUDA. Its dropout is at::dropout, which on CUDA is
    native_dropout (a bool mask kept) and on CPU keeps a noise tensor of the scores' dtype; and it adds the mask in
    place (attn.add_), where on fakes, tensor subclasses, it adds out of place (one more s x s transient)."""
    origin = query.dtype
    upcast = not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def acc(t: torch.Tensor) -> torch.Tensor:  # "Keep query, key, value in high precision for accuracy"
        return t.to(torch.float32) if upcast and t.dtype in (torch.float16, torch.bfloat16) else t

    query, key, value = acc(query), acc(key), acc(value)
    factor = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(query.shape[-1]))
    query = query * (-factor if scale is not None and scale < 0 else factor)
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask
        attn_mask = torch.where(attn_mask.logical_not(), -math.inf, torch.zeros((), dtype=query.dtype))
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # pre_process_group_query_attention_input
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.ops.aten.native_dropout(attn, dropout_p, True)[0]
    out = torch.matmul(attn, value).to(origin)
    attn.to(origin)  # the kernel's second output, made and dropped
    return out
