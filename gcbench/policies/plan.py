"""`plan`: per block, one of none / attn / sac / full (and, with allow_offload=true, offload of a checkpointed
block's input), chosen so that the predicted peak fits `memory` at the least recompute. The choice is made per run
shape by gcbench.estimators.plan (one fake-tensor pass per kind of block) and handed to the policy as `chosen`;
this module only applies a chosen mix. Semantics and sources: docs/policies.md.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from gcbench.errors import GcbenchError
from gcbench.policies.attn import AttentionCore
from gcbench.policies.base import CheckpointedGroup, Policy, option, register
from gcbench.policies.classic import Full, NoCheckpoint
from gcbench.policies.offload import Offload, OffloadedBlock
from gcbench.policies.sac import SelectiveCheckpointedBlock, SelectiveOps
from gcbench.results.schema import PLAN_KINDS
from gcbench.units import parse_bytes

if TYPE_CHECKING:
    from gcbench.step import TrainingStep

# What a block may be, least recompute first (the order ties are broken in, and the order blocks are filled in:
# the first blocks, whose activations live longest, get the most saving kinds).
KINDS = PLAN_KINDS
# Each kind as the policy that gives every block that kind: the choice costs a kind on it (estimators/plan.py), and a
# mix of one kind runs its step (Plan.one_kind)
UNIFORM = {"none": NoCheckpoint(), "attn": AttentionCore(), "sac": SelectiveOps(), "full": Full(),
           "offload": Offload(what="inputs")}


def canonical_size(text: str) -> str:
    """A size as the plan's label writes it: the largest binary unit that divides it ("24GiB", "1536MiB")."""
    n = parse_bytes(text)
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


@register("plan")
class Plan(Policy):
    summary = ("per block none / attn / sac / full (offload with allow_offload=true), chosen so that the predicted "
               "peak fits memory=SIZE at the least recompute FLOPs (one fake-tensor pass per kind of block)")
    example = "plan:memory=64MiB"
    memory: str = option("", "the peak memory to fit, e.g. 24GiB (required; in `gcbench fit`, the fit's budget)")
    allow_offload: str = option("false", "true: a block may also be checkpointed with its input offloaded to host "
                                "memory", choices=("true", "false"))
    # Filled in for one run shape by estimators.plan.with_mix: one kind per block, in block order.
    chosen: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False, metadata={"chosen": True})

    def __post_init__(self) -> None:
        if self.memory:
            try:
                object.__setattr__(self, "memory", canonical_size(self.memory))
            except GcbenchError as e:
                raise GcbenchError(f"plan:memory={self.memory}: {e}") from None

    def validate(self, n_blocks: int, stack: str = "model") -> None:
        super().validate(n_blocks, stack)
        if not self.memory:
            raise GcbenchError("plan needs the memory to fit: plan:memory=SIZE (e.g. plan:memory=24GiB)")

    @property
    def memory_bytes(self) -> int:
        return parse_bytes(self.memory)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of block this plan may choose from."""
        return KINDS if self.allow_offload == "true" else KINDS[:-1]

    def with_mix(self, counts: dict[str, int]) -> Plan:
        """This plan with `counts` (kind -> blocks) chosen, the most saving kinds on the first blocks."""
        chosen = tuple(kind for kind in reversed(KINDS) for _ in range(counts.get(kind, 0)))
        return dataclasses.replace(self, chosen=chosen)

    def one_kind(self, n_blocks: int) -> Policy | None:
        """The policy (UNIFORM) whose step is this plan's, op for op, where the chosen mix gives each of the
        `n_blocks` blocks one kind: `apply` wraps such a block as that policy does (CheckpointedGroup,
        SelectiveCheckpointedBlock with "all", OffloadedBlock checkpointed, AttentionCore), and `prepare` pins
        nothing where nothing is offloaded. None for a mix of kinds, or a mix chosen for another number of blocks."""
        kinds = set(self.chosen)
        return UNIFORM[kinds.pop()] if len(kinds) == 1 and len(self.chosen) == n_blocks else None

    @property
    def mix(self) -> dict[str, int]:
        return dict(Counter(self.chosen))

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        if len(self.chosen) != len(blocks):
            raise GcbenchError(f"plan:memory={self.memory} has no mix chosen for this run's {len(blocks)} blocks "
                               "(gcbench.estimators.plan.with_mix chooses it)")
        originals = list(blocks)
        undo_attn = AttentionCore().apply([b for b, kind in zip(originals, self.chosen) if kind == "attn"])
        wrap = {"full": lambda b: CheckpointedGroup([b]), "sac": lambda b: SelectiveCheckpointedBlock(b, "all"),
                "offload": lambda b: OffloadedBlock(b, checkpointed=True)}
        for i, (block, kind) in enumerate(zip(originals, self.chosen)):
            if kind in wrap:
                blocks[i] = wrap[kind](block)

        def undo() -> None:
            undo_attn()
            for i, block in enumerate(originals):
                blocks[i] = block

        return undo

    def prepare(self, step: TrainingStep) -> None:
        Offload().prepare(step)

    def offloaded_bytes(self, model: nn.Module) -> int | None:
        return Offload().offloaded_bytes(model) if "offload" in self.chosen else None
