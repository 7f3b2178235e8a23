"""`sac`: op-level selective checkpointing of every block (PyTorch SAC, torchtitan "op"): the forward caches matmul
and attention outputs, the backward recomputes pointwise ops and norms. Semantics and sources: docs/policies.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from gcbench.host_work import note_python_dispatch
from gcbench.measure import checkpoint, note_saved
from gcbench.policies.base import Policy, StandsFor, option, register
from gcbench.policies.classic import Full


def _aten_ops(*names: str) -> frozenset:
    # An op missing from this build (e.g. a CUDA-only kernel on an old wheel) is simply not in the set.
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# nn.Linear / GPT-2's Conv1D on a 3-D input dispatch a view to 2-D, then mm (no bias) or addmm (bias).
SAC_MATMULS = _aten_ops("mm", "addmm")
# The attention kernels: fused SDPA kernels (CPU flash, CUDA flash / memory-efficient / cuDNN) and, for eager
# attention or SDPA's math fallback (what CPU runs with attention dropout), the batched matmuls QK^T and PV.
SAC_ATTENTION = _aten_ops(
    "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
)


def _draws_random_numbers(func, args: tuple, kwargs: dict) -> bool:
    """True for an attention kernel running with dropout: it advances the RNG."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return False


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def sac_policy_fn(mm: str) -> Callable[..., CheckpointPolicy]:
    """A fresh policy function for one checkpointed forward: save matmul and attention outputs, recompute the rest.

    mm="alternate" saves only the odd-numbered matmuls of the block (1st, 3rd, ...), as torchtitan's `_custom_policy`.
    An attention kernel with dropout is recomputed, not saved: a cached kernel is skipped during recompute, so the
    RNG would not advance and every later dropout mask in the block would differ from the forward's.
    """
    matmuls = {False: 0, True: 0}  # counted apart for forward and recompute (older torch asks in both)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        note_python_dispatch()  # SAC's dispatch mode and this call, in Python, for every op: host time
        recompute = bool(getattr(ctx, "is_recompute", False))
        if func in SAC_MATMULS:
            matmuls[recompute] += 1
            save = mm == "all" or matmuls[recompute] % 2 == 1
        else:
            save = func in SAC_ATTENTION and not _draws_random_numbers(func, args, kwargs)
        if save and not recompute:
            # SAC's cache bypasses saved_tensors_hooks: without this the saved-bytes recording would not see it.
            note_saved(_tensors(getattr(ctx, "op_output", None)))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class SelectiveCheckpointedBlock(StandsFor):
    """One block as a non-reentrant checkpoint whose forward caches matmul/attention outputs (op-level SAC)."""

    def __init__(self, block: nn.Module, mm: str):
        super().__init__(block)
        self.block, self.mm = block, mm

    def forward(self, hidden_states, *args, **kwargs):
        return checkpoint(self.block, hidden_states, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _contexts(self):
        return create_selective_checkpoint_contexts(sac_policy_fn(self.mm))


@register("sac")
class SelectiveOps(Policy):
    summary = ("op-level selective checkpoint of every block: keep matmul and attention outputs, recompute pointwise "
               "ops and norms (PyTorch SAC, torchtitan 'op')")
    mm: str = option("all", choices=("all", "alternate"),
                     help="all: save every matmul output | alternate: every second one (torchtitan)")


    def groups(self, n_blocks: int) -> list[range]:
        return Full().groups(n_blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return SelectiveCheckpointedBlock(group[0], self.mm)
