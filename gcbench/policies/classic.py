"""The classic policies: which contiguous groups of blocks become one checkpoint (a group stores its input and
recomputes its internals during backward). N is the number of blocks.

    none      no group
    full      every block its own group                           (Megatron/torchtitan "full", HF)
    every-k   every k-th block its own group, the others keep all (torchtitan selective_ac_option=k)
    segments  contiguous groups of k blocks, each ONE checkpoint  (Chen et al. 2016, Megatron "uniform")
    sqrtn     segments with k = ceil(sqrt(N))

Checkpoints are non-reentrant and preserve the RNG state, so gradients equal those of `none`, dropout included.
"""

from __future__ import annotations

import math

from gcbench.policies.base import Policy, option, register


@register("none")
class NoCheckpoint(Policy):
    summary = "nothing recomputed: every block keeps its activations for backward"


@register("full")
class Full(Policy):
    summary = "every block is its own checkpoint: only each block's input is stored (HF, Megatron/torchtitan 'full')"

    def groups(self, n_blocks: int) -> list[range]:
        return [range(i, i + 1) for i in range(n_blocks)]


@register("every-k")
class EveryK(Policy):
    summary = "every k-th block (k-1, 2k-1, ...) is its own checkpoint, the others keep activations; k=1 is full"
    k: int = option(2, "checkpoint one block in every k (1..N)", blocks=True)


    def groups(self, n_blocks: int) -> list[range]:
        # torchtitan counts blocks from 1 and wraps those where count % k == 0.
        return [range(i, i + 1) for i in range(n_blocks) if (i + 1) % self.k == 0]


@register("segments")
class Segments(Policy):
    summary = "contiguous groups of k blocks, each group one checkpoint (Chen et al. 2016; Megatron 'uniform')"
    k: int = option(2, "blocks per checkpointed segment (1..N)", blocks=True)


    def groups(self, n_blocks: int) -> list[range]:
        return [range(i, min(i + self.k, n_blocks)) for i in range(0, n_blocks, self.k)]


@register("sqrtn")
class SqrtN(Policy):
    summary = "segments with k = ceil(sqrt(N)): O(sqrt N) stored inputs, one extra forward (Chen et al. 2016)"

    def groups(self, n_blocks: int) -> list[range]:
        return Segments(k=math.ceil(math.sqrt(n_blocks))).groups(n_blocks)
