"""Activation-checkpointing policies: small registered classes that wrap a model's list of transformer blocks.

N is the number of blocks. The classic policies differ only in which contiguous groups of blocks become one
checkpoint (a group stores its input and recomputes its internals during backward):

    none      no group
    full      every block its own group                           (Megatron/torchtitan "full", HF)
    every-k   every k-th block its own group, the others keep all (torchtitan selective_ac_option=k)
    segments  contiguous groups of k blocks, each ONE checkpoint  (Chen et al. 2016, Megatron "uniform")
    sqrtn     segments with k = ceil(sqrt(N))

Checkpoints are non-reentrant and preserve the RNG state, so gradients equal those of `none`, dropout included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn
from torch.utils.checkpoint import checkpoint

from gcbench.errors import GcbenchError

POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: add a policy to POLICIES under `name`."""

    def add(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


def option(default: Any, help: str) -> Any:
    """A policy option: a dataclass field whose help text `gcbench policies` shows."""
    return dataclasses.field(default=default, metadata={"help": help})


class CheckpointedGroup(nn.Module):
    """Runs a contiguous group of blocks as one non-reentrant checkpoint: only the group's inputs are kept."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden_states, *args, **kwargs):
        return checkpoint(self._run_blocks, hidden_states, *args, use_reentrant=False, **kwargs)

    def _run_blocks(self, hidden_states, *args, **kwargs):
        for block in self.blocks:
            hidden_states = block(hidden_states, *args, **kwargs)
        return hidden_states


class Passthrough(nn.Module):
    """Stands in the block list for a block that a preceding CheckpointedGroup already ran."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@dataclass(frozen=True)
class Policy:
    """Base class. A classic policy only says which block groups to checkpoint (`groups`)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def validate(self, n_blocks: int) -> None:
        """Raise GcbenchError when the options make no sense for a model of `n_blocks` blocks."""

    def groups(self, n_blocks: int) -> list[range]:
        """Contiguous ranges of block indices, each to become one checkpoint."""
        return []

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        """Wrap `blocks` in place; return a function that restores the original blocks."""
        originals = list(blocks)
        for group in self.groups(len(blocks)):
            blocks[group.start] = CheckpointedGroup([originals[i] for i in group])
            for i in group[1:]:
                blocks[i] = Passthrough()

        def undo() -> None:
            for i, block in enumerate(originals):
                blocks[i] = block

        return undo

    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options().items())
        return f"{self.name}:{opts}" if opts else self.name


def _check_k(policy_name: str, k: int, n_blocks: int) -> None:
    # Refused, not clamped: a k beyond N would silently measure a different policy than the one asked for.
    if not 1 <= k <= n_blocks:
        raise GcbenchError(f"{policy_name}:k={k} is out of range: the model has {n_blocks} blocks, so k must be 1..{n_blocks}")


@register("none")
@dataclass(frozen=True)
class NoCheckpoint(Policy):
    summary = "nothing recomputed: every block keeps its activations for backward"


@register("full")
@dataclass(frozen=True)
class Full(Policy):
    summary = "every block is its own checkpoint: only each block's input is stored (HF, Megatron/torchtitan 'full')"

    def groups(self, n_blocks: int) -> list[range]:
        return [range(i, i + 1) for i in range(n_blocks)]


@register("every-k")
@dataclass(frozen=True)
class EveryK(Policy):
    summary = "every k-th block (k-1, 2k-1, ...) is its own checkpoint, the others keep activations; k=1 is full"
    k: int = option(2, "checkpoint one block in every k (1..N)")

    def validate(self, n_blocks: int) -> None:
        _check_k(self.name, self.k, n_blocks)

    def groups(self, n_blocks: int) -> list[range]:
        # torchtitan counts blocks from 1 and wraps those where count % k == 0.
        return [range(i, i + 1) for i in range(n_blocks) if (i + 1) % self.k == 0]


@register("segments")
@dataclass(frozen=True)
class Segments(Policy):
    summary = "contiguous groups of k blocks, each group one checkpoint (Chen et al. 2016; Megatron 'uniform')"
    k: int = option(2, "blocks per checkpointed segment (1..N)")

    def validate(self, n_blocks: int) -> None:
        _check_k(self.name, self.k, n_blocks)

    def groups(self, n_blocks: int) -> list[range]:
        return [range(i, min(i + self.k, n_blocks)) for i in range(0, n_blocks, self.k)]


@register("sqrtn")
@dataclass(frozen=True)
class SqrtN(Policy):
    summary = "segments with k = ceil(sqrt(N)): O(sqrt N) stored inputs, one extra forward (Chen et al. 2016)"

    def groups(self, n_blocks: int) -> list[range]:
        return Segments(k=math.ceil(math.sqrt(n_blocks))).groups(n_blocks)


def parse_policy(text: str) -> Policy:
    """Parse `name` or `name:key=value[,key=value]` into a Policy; GcbenchError on anything unknown or malformed."""
    name, _, rest = text.strip().partition(":")
    cls = POLICIES.get(name)
    if cls is None:
        raise GcbenchError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            known = ", ".join(fields) or "none"
            raise GcbenchError(f"policy {name!r}: bad option {item!r} (options: {known})")
        values[key] = _parse_value(name, key, raw, fields[key].type)
    return cls(**values)


def _parse_value(policy: str, key: str, raw: str, type_name: Any) -> Any:
    kind = {"int": int, "float": float, "str": str}.get(str(type_name), str)
    try:
        return kind(raw)
    except ValueError:
        raise GcbenchError(f"policy {policy!r}: option {key}={raw!r} is not a {kind.__name__}") from None
