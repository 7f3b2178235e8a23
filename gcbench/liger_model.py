"""What liger-kernel's fused linear cross-entropy allocates on CUDA, for the fake-tensor simulation (which cannot
run its Triton kernel): the same tensors, made in the same order, by the same torch calls where they allocate.

Followed: liger-kernel v0.8.2 (the newest release; main is the same), src/liger_kernel/ops/fused_linear_cross_entropy.py,
`fused_linear_cross_entropy_forward`, `fused_linear_cross_entropy_backward` and
`LigerFusedLinearCrossEntropyFunction`, as LigerFusedLinearCrossEntropyLoss calls them (reduction "mean", no class
weights, z-loss, label smoothing, softcap or token scaling; accum_dtype None). The forward computes the loss and,
chunk by chunk, the gradients of the hidden states and of the head's weight, and keeps those two for backward
(ctx.save_for_backward(grad_input, grad_weight, grad_bias)), not the logits. Assumed, as the rest of the CUDA
prediction: an sm80+ GPU (compute capability >= 8: the addmm accumulation paths) that is not ROCm, torch >= 2.8
(addmm's out_dtype), and the Triton kernel and cuBLAS allocating nothing through the caching allocator (the
cross-entropy kernel writes the loss and the logits' gradient in place). Older releases (0.5, 0.6) make a new logits
chunk per chunk instead of reusing one buffer: the same peak within one chunk of logits.
"""

from __future__ import annotations

import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows of one chunk: liger bounds the transient logits to about tokens x hidden elements (chunk_mem_const 1):
    inc_factor = cdiv(V, H), chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)."""
    inc_factor = _cdiv(vocab, hidden)
    return min(_next_power_of_2(_cdiv(tokens, inc_factor)), tokens)


class LigerAllocations(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction's allocations on CUDA, on fake tensors: the loss's value is not
    computed (the kernel's in-place writes allocate nothing), every tensor the forward and backward make is."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias=None):
        BT, H = _input.shape
        V = weight.shape[0]
        chunk_size = chunk_rows(BT, H, V)
        grad_input = torch.zeros_like(_input)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None  # accum_dtype None: param dtype
        grad_bias = torch.zeros_like(bias) if bias is not None else None
        loss_1d = torch.zeros(BT, dtype=torch.float32)
        target_mask = target != -100
        target_mask.sum()  # total_n_non_ignore (.item() on the GPU: its one-element result is freed at once)
        autocast = torch.get_autocast_dtype(_input.device.type) if torch.is_autocast_enabled(_input.device.type) \
            else None
        # _can_use_mm_out: a CUDA input (assumed), grad disabled (inside Function.forward), matching 16/32-bit dtypes,
        # and under autocast the autocast dtype itself
        use_mm_out = _input.dtype == weight.dtype and _input.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and (autocast is None or _input.dtype == autocast)
        logits_storage = torch.empty((chunk_size, V), dtype=_input.dtype) \
            if use_mm_out and (bias is None or bias.dtype == _input.dtype) else None
        for start in range(0, BT, chunk_size):
            end = min(start + chunk_size, BT)
            _input_chunk = _input[start:end]
            if logits_storage is not None:
                logits_chunk = logits_storage[: end - start]
                torch.mm(_input_chunk, weight.t(), out=logits_chunk)
                if bias is not None:
                    logits_chunk.add_(bias)
            else:
                logits_chunk = _input_chunk @ weight.t()
                if bias is not None:
                    logits_chunk = logits_chunk + bias
            logits_chunk = logits_chunk.contiguous()
            # liger_cross_entropy_kernel: loss_1d[start:end] and the logits' gradient, in place (nothing allocated)
            grad_logits_chunk = logits_chunk
            del logits_chunk
            if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = grad_logits_chunk @ weight
            if grad_weight is not None:
                _accumulate_weight_grad(grad_weight, grad_logits_chunk, _input_chunk)
            if bias is not None:
                torch.add(input=grad_bias, other=grad_logits_chunk.sum(dim=0), out=grad_bias, alpha=1.0)
            del grad_logits_chunk, _input_chunk
        del logits_storage
        loss = torch.sum(loss_1d)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None,
                              grad_bias.detach() if grad_bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: torch.equal(grad_output, torch.tensor(1.0)), then element_mul_kernel
        # in place where it is not 1 (a loss divided for gradient accumulation)
        torch.tensor(1.0)
        return grad_input, grad_weight, None, grad_bias


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, _input_chunk: torch.Tensor) -> None:
    """grad_weight += grad_logits^T @ input, by the path liger takes on an sm80+ GPU."""
    grad_logits_t = grad_logits.t()
    low = grad_logits_t.dtype in (torch.float16, torch.bfloat16)
    if low and grad_weight.dtype in (torch.float32, grad_logits_t.dtype):
        # addmm into grad_weight (fp32 through out_dtype, or the matching low precision): the input chunk cast to
        # the gradient's dtype where it differs (an fp32 input under autocast), nothing else
        input_chunk = _input_chunk.to(grad_logits_t.dtype) if _input_chunk.dtype != grad_logits_t.dtype \
            else _input_chunk
        if grad_weight.dtype == torch.float32:
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32, out=grad_weight)
        else:
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out=grad_weight)
        del input_chunk
    else:
        # the legacy path (fp32 logits): a parameter-sized product, then added
        grad_weight += torch.mm(grad_logits_t, _input_chunk).float()
