"""What every policy is made of: the POLICIES registry, typed options, the Policy base class and parse_policy.

A policy wraps a model's list of transformer blocks and declares facts about itself that the runner reads
(`compiles`, `hidden_from_dispatch_modes`, `offloaded_bytes`); it never measures. The policies themselves are in the
sibling modules (classic, sac, attn, offload, budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from gcbench.errors import GcbenchError
from gcbench.measure import checkpoint

if TYPE_CHECKING:
    from gcbench.step import TrainingStep

POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a policy a frozen dataclass (its options are the fields) and add it to POLICIES under
    `name`."""

    def add(cls: type[Policy]) -> type[Policy]:
        cls = dataclass(frozen=True)(cls)
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


def option(default: Any, help: str, *, choices: tuple[str, ...] = (), within: tuple[float, float] | None = None,
           blocks: bool = False) -> Any:
    """A policy option: a dataclass field whose help text `gcbench policies` shows, with the rule its value obeys
    (checked by Policy.validate): one of `choices`, a number `within` [lo, hi], or a count of `blocks` (1..N)."""
    rule = {"choices": choices, "within": within, "blocks": blocks}
    return dataclasses.field(default=default, metadata={"help": help, **rule})


def option_fields(policy: type[Policy] | Policy) -> list[dataclasses.Field]:
    """The options a user gives (`name:key=value`): the policy's fields but those it fills in itself (`chosen`)."""
    return [f for f in dataclasses.fields(policy) if not f.metadata.get("chosen")]


class StandsFor(nn.Module):
    """A module that stands in the block list for a block: an attribute it lacks is the block's. Block loops read
    them: ModernBERT picks each layer's mask by `layer.attention_type`."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.__dict__["_stands_for"] = block  # a plain reference: the block is registered where it belongs

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_stands_for" not in self.__dict__:
                raise
            return getattr(self.__dict__["_stands_for"], name)


class CheckpointedGroup(StandsFor):
    """Runs a contiguous group of blocks as one non-reentrant checkpoint: only the group's input is kept.

    It stands in the block list at the group's last block. The model calls every block with that block's own
    arguments (Gemma's local and global layers get different masks and position embeddings), so the blocks before
    the last are GroupArguments, which note their call's arguments and hand the hidden states on unchanged; the
    group then runs each block with the arguments the model gave it."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__(blocks[-1])
        self.blocks = nn.ModuleList(blocks)
        self.noted: list[tuple[tuple, dict]] = []  # this forward's arguments of the blocks before the last
        self.first_input: Any = None

    def forward(self, hidden_states, *args, **kwargs):
        calls, first = [*self.noted, (args, kwargs)], self.first_input
        self.noted, self.first_input = [], None
        if len(calls) != len(self.blocks) or (first is not None and not _passed_on(first, hidden_states)):
            raise GcbenchError(f"a checkpointed group of {len(self.blocks)} blocks was not called block after block "
                               "with the hidden states passed on: this model's blocks return tuples, or its block "
                               "loop does more between blocks, so group policies (segments, sqrtn) cannot run it; "
                               "use full or every-k")
        return checkpoint(self._run_blocks, hidden_states, calls, use_reentrant=False)

    def _run_blocks(self, hidden_states, calls):
        for block, (args, kwargs) in zip(self.blocks, calls):
            hidden_states = block(hidden_states, *args, **kwargs)
        return hidden_states


def _passed_on(first: Any, hidden_states: Any) -> bool:
    """Whether the group got the hidden states its first block was given: the same tensor, or (FSDP2 hooks a
    sharded group's inputs through an autograd function) an alias of the same memory: the same storage at the
    same offset (fake tensors, in the simulation, have no address to compare)."""
    if hidden_states is first:
        return True
    try:
        return (hidden_states.shape == first.shape and hidden_states.storage_offset() == first.storage_offset()
                and hidden_states.untyped_storage()._cdata == first.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return False


class GroupArguments(StandsFor):
    """Stands in the block list for a block of a CheckpointedGroup that runs later, at the group's last block:
    notes the arguments the model calls this block with and returns the hidden states unchanged."""

    def __init__(self, group: CheckpointedGroup, index: int):
        super().__init__(group.blocks[index])
        self._group = [group]  # in a list: the group, and its parameters, are registered once (at its own index)
        self.index = index

    def forward(self, hidden_states, *args, **kwargs):
        group = self._group[0]
        if self.index == 0:  # a new forward: forget what a forward that failed half-way noted
            group.noted, group.first_input = [], hidden_states
        group.noted.append((args, kwargs))
        return hidden_states


@dataclass(frozen=True)
class Policy:
    """Base class. A classic policy only says which block groups to checkpoint (`groups`).

    A policy sets things up and declares facts; the runner measures. The class facts below are False for the
    classic policies.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # The policy as one would give it, where the name alone is not a policy (a required option): docs and tests.
    example: ClassVar[str] = ""
    # The first step compiles: the runner times it against the next one before warm-up (compile_ms), so that
    # compiling never lands in the timed steps.
    compiles: ClassVar[bool] = False
    # Under a TorchDispatchMode the blocks run otherwise than in the timed steps (torch.compile falls back to eager,
    # and stays there), so what a dispatch-mode instrument counts (FLOPs; on CPU the live-tensor peaks) would
    # describe another model: the runner reports those fields as None and counts saved bytes before any such mode.
    hidden_from_dispatch_modes: ClassVar[bool] = False
    # A model of several stacks of blocks (an encoder-decoder's encoder and decoder): the one the policy applies to,
    # the others left as they are (none); "" applies it to every stack, each on its own (apply_to_stacks). Every
    # policy takes it; a policy names it only where it is given ("full:stack=decoder").
    stack: str = dataclasses.field(default="", kw_only=True, metadata={
        "help": "the stack of blocks it applies to, the others left as they are (default: every stack)",
        "every_policy": True})

    def alike_blocks(self, n_blocks: int) -> bool:
        """Whether every block of `n_blocks` is treated the same way (each its own checkpoint, or none), the same
        at any number of blocks: then a simulation of a long model can be made from two short ones
        (estimators/layer_scaling.py). A policy that wraps blocks otherwise than by `groups` says so itself."""
        each = [range(i, i + 1) for i in range(n_blocks)]
        return type(self).apply is Policy.apply and self.groups(n_blocks) in ([], each)

    def validate(self, n_blocks: int, stack: str = "model") -> None:
        """Raise GcbenchError when an option breaks its rule (see `option`) for a stack of `n_blocks` blocks (the
        model's, or an encoder-decoder's `stack`: encoder, decoder)."""
        for f in option_fields(self):
            value, rule = getattr(self, f.name), f.metadata
            if rule.get("choices") and value not in rule["choices"]:
                use = " or ".join(f"{f.name}={c}" for c in rule["choices"])
                raise GcbenchError(f"{self.name}:{f.name}={value} is not known: use {use}")
            if rule.get("within") and not rule["within"][0] <= value <= rule["within"][1]:
                lo, hi = rule["within"]
                raise GcbenchError(f"{self.name}:{f.name}={value} is out of range: {f.name} must be in "
                                   f"[{lo:g}, {hi:g}]")
            # Refused, not clamped: a k beyond N would silently measure a different policy than the one asked for.
            if rule.get("blocks") and not 1 <= value <= n_blocks:
                raise GcbenchError(f"{self.name}:{f.name}={value} is out of range: the {stack} has {n_blocks} "
                                   f"blocks, so {f.name} must be 1..{n_blocks}")

    def groups(self, n_blocks: int) -> list[range]:
        """Contiguous ranges of block indices, each to become one checkpoint."""
        return []

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        """Wrap `blocks` in place; return a function that restores the original blocks."""
        originals = list(blocks)
        groups = self.groups(len(blocks))
        if any(len(group) > 1 for group in groups) and (loop := getattr(blocks, "unpacked_by", None)):
            from gcbench.blocks import grouping_refused

            raise GcbenchError(f"{self}: {grouping_refused(loop)}")
        for group in groups:
            wrapped = self.wrap_group([originals[i] for i in group])
            for index, i in enumerate(group[:-1]):
                blocks[i] = GroupArguments(wrapped, index)
            blocks[group[-1]] = wrapped

        def undo() -> None:
            for i, block in enumerate(originals):
                blocks[i] = block

        return undo

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        """The module that stands for one group of blocks: by default one plain checkpoint around them. A policy
        whose groups have more than one block returns a CheckpointedGroup."""
        return CheckpointedGroup(group)

    def prepare(self, step: TrainingStep) -> None:
        """Set up what needs the built step (its device), once after `apply` and before any step runs.

        Runs nothing and measures nothing. The classic policies need nothing.
        """

    def offloaded_bytes(self, model: nn.Module) -> int | None:
        """Bytes the policy's blocks copied to host memory in `model`'s last forward; None when it moves nothing."""
        return None

    def options(self) -> dict[str, Any]:
        """The options given (`stack` where it is: every record before it applies to every stack)."""
        return {f.name: getattr(self, f.name) for f in option_fields(self) if f.name != "stack" or self.stack}

    def applies_to(self, stack: str) -> bool:
        """Whether the policy wraps the blocks of `stack` (blocks.find_stacks' name): every stack unless one is
        named."""
        return not self.stack or self.stack == stack

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options().items())
        return f"{self.name}:{opts}" if opts else self.name


def apply_to_stacks(policy: Policy, stacks: list[nn.ModuleList]) -> Callable[[], None]:
    """Apply `policy` to each stack of blocks (models.block_lists) on its own, its groups counted in that stack's
    blocks (an encoder-decoder's `sqrtn` is sqrt(N) of the encoder's and of the decoder's), or to the one stack it
    names (`stack=`); one undo for all."""
    undos: list[Callable[[], None]] = []

    def undo() -> None:
        for one in reversed(undos):
            one()

    try:
        for blocks in stacks:
            if policy.applies_to(getattr(blocks, "stack", "blocks")):
                undos.append(policy.apply(blocks))
    except BaseException:
        undo()  # no stack left half-wrapped
        raise
    return undo


def parse_policy(text: str) -> Policy:
    """Parse `name` or `name:key=value[,key=value]` into a Policy; GcbenchError on anything unknown or malformed."""
    if "+" in text:
        raise GcbenchError(
            f"policies do not compose ({text.strip()!r}): give one policy. Supported combinations are options of one "
            "policy: offload:what=inputs,k=K is every-k with the checkpointed blocks' inputs offloaded, "
            "offload:what=inputs is full with offload (see docs/policies.md, 'Composition')")
    name, colon, rest = text.strip().partition(":")
    cls = POLICIES.get(name)
    if cls is None:
        raise GcbenchError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    fields = {f.name: f for f in option_fields(cls)}
    known = ", ".join(fields) or "none"
    if colon and not rest.strip():
        raise GcbenchError(f"policy {text.strip()!r}: empty option list after ':' (give key=value options, or "
                           f"write {name!r} alone; options: {known})")
    values: dict[str, Any] = {}
    for item in (s.strip() for s in rest.split(",") if colon):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or key not in fields:
            raise GcbenchError(f"policy {name!r}: bad option {item!r} (options: {known})")
        if key in values:
            raise GcbenchError(f"policy {name!r}: option {key} given twice")
        values[key] = _parse_value(name, key, raw, fields[key].type)
    return cls(**values)


def _parse_value(policy: str, key: str, raw: str, type_name: Any) -> Any:
    kind, what = {"int": (int, "an integer"), "float": (float, "a number"), "str": (str, "a string")}.get(
        str(type_name), (str, "a string"))
    try:
        return kind(raw)
    except ValueError:
        raise GcbenchError(f"policy {policy!r}: option {key}={raw!r} is not {what}") from None
