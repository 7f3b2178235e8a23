"""`budget` (experimental): torch.compile every block under torch._functorch's activation_memory_budget, so that
the min-cut partitioner picks what to recompute. Semantics, sources and known issues: docs/policies.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gcbench.policies.base import Policy, StandsFor, option, register
from gcbench.policies.classic import Full


class CompiledBlock(StandsFor):
    """One block under torch.compile, compiled with a given activation memory budget."""

    def __init__(self, block: nn.Module, budget: float):
        super().__init__(block)
        self.budget = budget
        self.compiled = torch.compile(block)

    def forward(self, *args, **kwargs):
        # Read when a graph is compiled (first call or a recompile), so it is set around every call.
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.compiled(*args, **kwargs)


@register("budget")
class CompileBudget(Policy):
    summary = ("EXPERIMENTAL: torch.compile every block with activation_memory_budget=b; the min-cut partitioner "
               "picks what to recompute (b=1: its default, b=0: recompute all it can)")
    b: float = option(0.5, "activation memory budget, 0..1 (fraction of the saved bytes of the default partition)",
                      within=(0.0, 1.0))
    compiles = True
    # Dynamo runs the blocks eagerly under any TorchDispatchMode (FLOP counter, CPU live-tensor tracker).
    hidden_from_dispatch_modes = True


    def groups(self, n_blocks: int) -> list[range]:
        return Full().groups(n_blocks)

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        import torch._dynamo

        # Dynamo caches compiled code per code object and does not guard on the budget: forget earlier compiles.
        torch._dynamo.reset()
        return super().apply(blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return CompiledBlock(group[0], self.b)
