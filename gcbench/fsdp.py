"""FSDP2 for a sharded run (--shard fsdp2): what one rank does to its model, and which rows of the batch are its.

As torchtitan does it: the checkpoint policy wraps the blocks first, then `fully_shard` each block (the unit FSDP
gathers before its forward and frees after) and last the root (the embeddings, the final norm and the head, kept
gathered through forward and backward). Mixed precision as --precision says: pure bf16 shards bf16 parameters and
needs no policy; amp-bf16 keeps fp32 shards and gathers bf16 copies for compute, reducing gradients in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


def in_rank() -> bool:
    """Whether this process is a rank of a sharded run (its world may be one process: --nproc 1)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of ranks); (0, 1) outside a sharded run."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if in_rank() else (0, 1)


def shard_model(model: nn.Module, blocks: nn.ModuleList, precision: str) -> None:
    """`fully_shard` every block, then the root: parameters, gradients and (built after this) optimizer state of
    each are this rank's 1/world share (DTensors)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "amp-bf16" else MixedPrecisionPolicy()
    for block in blocks:
        # A group policy's stand-ins hold no parameters (the group, at its last block, holds them all): the group
        # is the unit FSDP gathers, as the checkpoint is.
        if any(True for _ in block.parameters()):
            fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)



class AgreedBudget:
    """A step budget every rank follows: they stop timing together, when rank 0's budget says so (an `auto` budget
    decides from each rank's own samples, and a rank that stopped alone would leave the others waiting in a
    collective)."""

    def __init__(self, budget):
        self.budget = budget

    def __getattr__(self, name: str):
        return getattr(self.budget, name)

    def stop_reason(self, samples, elapsed_s: float) -> str | None:
        import torch.distributed as dist

        decision = [self.budget.stop_reason(samples, elapsed_s)]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]
