"""Activation-checkpointing policies: small registered classes that wrap a model's list of transformer blocks.

N is the number of blocks. The classic policies differ only in which contiguous groups of blocks become one
checkpoint (a group stores its input and recomputes its internals during backward):

    none      no group
    full      every block its own group                           (Megatron/torchtitan "full", HF)
    every-k   every k-th block its own group, the others keep all (torchtitan selective_ac_option=k)
    segments  contiguous groups of k blocks, each ONE checkpoint  (Chen et al. 2016, Megatron "uniform")
    sqrtn     segments with k = ceil(sqrt(N))

Checkpoints are non-reentrant and preserve the RNG state, so gradients equal those of `none`, dropout included.

Beyond them (second half of this file): sac (op-level selective), attn (attention-core recompute), offload (host
memory) and budget (torch.compile's activation memory budget); docs/policies.md has their semantics and sources.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gcbench.errors import GcbenchError
from gcbench.measure import SavedActivations, note_saved

if TYPE_CHECKING:
    from gcbench.step import TrainingStep

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
            blocks[group.start] = self.wrap_group([originals[i] for i in group])
            for i in group[1:]:
                blocks[i] = Passthrough()

        def undo() -> None:
            for i, block in enumerate(originals):
                blocks[i] = block

        return undo

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        """The module that stands for one group of blocks: by default one plain checkpoint around them."""
        return CheckpointedGroup(group)

    def prepare(self, step: TrainingStep) -> dict[str, Any]:
        """Called once by the worker after `apply`, before warm-up; returns policy-specific record fields.

        For work that must stay out of the timed steps (compiling) and for what only the policy can measure (bytes
        offloaded to the host). A returned field replaces the worker's own measurement of the same name, so a policy
        whose internals an instrument cannot see sets that field to None instead of letting a wrong number through.
        The classic policies need nothing.
        """
        return {}

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
    if "+" in text:
        raise GcbenchError(
            f"policies do not compose ({text.strip()!r}): give one policy. Supported combinations are options of one "
            "policy: offload:what=inputs,k=K is every-k with the checkpointed blocks' inputs offloaded, "
            "offload:what=inputs is full with offload (see docs/policies.md, 'Composition')")
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


# ---------------------------------------------------------------------------------------------------------------------
# Beyond the classic four: op-level selective (sac), attention-core recompute (attn), host offload (offload),
# torch.compile's activation memory budget (budget). Sources and measured numbers: docs/policies.md.


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
        recompute = bool(getattr(ctx, "is_recompute", False))
        if func in SAC_MATMULS:
            matmuls[recompute] += 1
            save = mm == "all" or matmuls[recompute] % 2 == 1
        else:
            save = func in SAC_ATTENTION and not _draws_random_numbers(func, args, kwargs)
        if save and not recompute:
            note_saved(_tensors(getattr(ctx, "op_output", None)))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class SelectiveCheckpointedBlock(nn.Module):
    """One block as a non-reentrant checkpoint whose forward caches matmul/attention outputs (op-level SAC)."""

    def __init__(self, block: nn.Module, mm: str):
        super().__init__()
        self.block, self.mm = block, mm

    def forward(self, hidden_states, *args, **kwargs):
        return checkpoint(self.block, hidden_states, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _contexts(self):
        return create_selective_checkpoint_contexts(sac_policy_fn(self.mm))


@register("sac")
@dataclass(frozen=True)
class SelectiveOps(Policy):
    summary = ("op-level selective checkpoint of every block: keep matmul and attention outputs, recompute pointwise "
               "ops and norms (PyTorch SAC, torchtitan 'op')")
    mm: str = option("all", "all: save every matmul output | alternate: every second one (torchtitan)")

    def validate(self, n_blocks: int) -> None:
        if self.mm not in ("all", "alternate"):
            raise GcbenchError(f"sac:mm={self.mm} is not known: use mm=all or mm=alternate")

    def groups(self, n_blocks: int) -> list[range]:
        return Full().groups(n_blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return SelectiveCheckpointedBlock(group[0], self.mm)


# `attn` reroutes one attention module's call of the transformers attention interface to a checkpointed version of
# the same function, registered under this prefix + the original implementation's name.
RECOMPUTE_CORE_PREFIX = "gcbench-recompute-core|"


def _attention_interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _eager_attention(module: nn.Module) -> Callable:
    """The model file's own eager attention function (transformers' fallback when the implementation is 'eager')."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _checkpointed_core(implementation: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        core = _attention_interface().get_interface(implementation, _eager_attention(module))
        return checkpoint(core, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)

    return attention


def attention_modules(block: nn.Module) -> list[nn.Module]:
    """The modules of `block` that call the transformers attention interface (innermost '*Attention' with a config)."""

    def dispatches(m: nn.Module) -> bool:
        file = sys.modules.get(type(m).__module__)
        return (type(m).__name__.endswith("Attention") and getattr(m, "config", None) is not None
                and hasattr(file, "ALL_ATTENTION_FUNCTIONS") and hasattr(file, "eager_attention_forward"))

    return [m for m in block.modules() if dispatches(m)]


@register("attn")
@dataclass(frozen=True)
class AttentionCore(Policy):
    summary = ("recompute only the attention core (QK^T, softmax, dropout, PV) of every block; projections and MLP "
               "keep their activations (Korthikanti et al. 2022, Megatron 'selective')")

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        interface = _attention_interface()
        rerouted: list[tuple[nn.Module, Any]] = []
        for i, block in enumerate(blocks):
            found = attention_modules(block)
            if len(found) != 1:
                raise GcbenchError(f"attn: expected one attention module in block {i} ({type(block).__name__}), "
                                   f"found {len(found)}")
            module = found[0]
            if getattr(module, "reorder_and_upcast_attn", False):
                raise GcbenchError("attn: GPT-2's reorder_and_upcast_attn bypasses the attention interface")
            implementation = module.config._attn_implementation or "sdpa"
            name = RECOMPUTE_CORE_PREFIX + implementation
            if name not in interface:
                interface[name] = _checkpointed_core(implementation)
            # The module alone sees a copy of the config naming the rerouted implementation: the model's mask
            # construction and every other module keep reading the original.
            view = copy.copy(module.config)
            view._attn_implementation = name
            rerouted.append((module, module.config))
            module.config = view

        def undo() -> None:
            for module, config in rerouted:
                module.config = config

        return undo


class HostOffload(torch.autograd.graph.save_on_cpu):
    """save_on_cpu that counts the bytes it moves to host memory and leaves parameters on the device.

    Parameters (e.g. a Linear's weight, saved for the input gradient) are model state that stays on the device anyway;
    plain save_on_cpu would copy every block's weights to the host on every step.
    """

    def __init__(self, pin_memory: bool, keep_storages: set[int]):  # ids of the storages that stay
        super().__init__(pin_memory=pin_memory)
        to_host, from_host = self.pack_hook, self.unpack_hook
        self.offloaded_bytes = 0

        def pack(t: torch.Tensor):
            if id(t.untyped_storage()) in keep_storages:
                return False, t
            self.offloaded_bytes += t.numel() * t.element_size()  # each save is its own host copy
            return True, to_host(t)

        def unpack(packed):
            on_host, payload = packed
            return from_host(payload) if on_host else payload

        self.pack_hook, self.unpack_hook = pack, unpack


class OffloadedBlock(nn.Module):
    """One block whose saved tensors go to host memory: its input only (checkpointed) or all it saves."""

    def __init__(self, block: nn.Module, checkpointed: bool):
        super().__init__()
        self.block, self.checkpointed = block, checkpointed
        self.offloaded_bytes = 0  # host bytes of the last forward
        # By storage identity (kept while the storage lives), not data pointer: fake tensors all point at 0.
        self._param_storages = {id(p.untyped_storage()) for p in block.parameters()}
        # Pinned host memory makes the device-to-host copy a DMA; it only exists next to a CUDA device.
        # Set by Offload.prepare from the run's device.
        self.pin_memory = False

    def forward(self, hidden_states, *args, **kwargs):
        offload = HostOffload(self.pin_memory, self._param_storages)
        with offload:
            if self.checkpointed:  # the checkpoint saves its inputs under our hooks, its internals under its own
                out = checkpoint(self.block, hidden_states, *args, use_reentrant=False, **kwargs)
            else:
                out = self.block(hidden_states, *args, **kwargs)
        self.offloaded_bytes = offload.offloaded_bytes
        return out


@register("offload")
@dataclass(frozen=True)
class Offload(Policy):
    summary = ("activations to host memory (save_on_cpu, pinned on CUDA): what=inputs checkpoints the block and "
               "offloads its input, what=all offloads everything it saves; k>1 does this for every k-th block only")
    what: str = option("inputs", "inputs: checkpoint + offload the block input | all: offload all the block saves")
    k: int = option(1, "offload every k-th block (1..N); with what=inputs this is every-k with offloaded inputs")

    def validate(self, n_blocks: int) -> None:
        if self.what not in ("inputs", "all"):
            raise GcbenchError(f"offload:what={self.what} is not known: use what=inputs or what=all")
        _check_k(self.name, self.k, n_blocks)

    def groups(self, n_blocks: int) -> list[range]:
        return EveryK(k=self.k).groups(n_blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return OffloadedBlock(group[0], checkpointed=self.what == "inputs")

    def prepare(self, step: TrainingStep) -> dict[str, Any]:
        """Pin host memory on a CUDA run; one untimed forward+backward to read how many bytes a step puts in host
        memory."""
        blocks = [m for m in step.model.modules() if isinstance(m, OffloadedBlock)]
        for block in blocks:
            block.pin_memory = step.device.type == "cuda"
        step.forward_backward()
        return {"offloaded_bytes": sum(b.offloaded_bytes for b in blocks)}


class CompiledBlock(nn.Module):
    """One block under torch.compile, compiled with a given activation memory budget."""

    def __init__(self, block: nn.Module, budget: float):
        super().__init__()
        self.budget = budget
        self.compiled = torch.compile(block)

    def forward(self, *args, **kwargs):
        # Read when a graph is compiled (first call or a recompile), so it is set around every call.
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.compiled(*args, **kwargs)


@register("budget")
@dataclass(frozen=True)
class CompileBudget(Policy):
    summary = ("EXPERIMENTAL: torch.compile every block with activation_memory_budget=b; the min-cut partitioner "
               "picks what to recompute (b=1: its default, b=0: recompute all it can)")
    b: float = option(0.5, "activation memory budget, 0..1 (fraction of the saved bytes of the default partition)")

    def validate(self, n_blocks: int) -> None:
        if not 0.0 <= self.b <= 1.0:
            raise GcbenchError(f"budget:b={self.b} is out of range: b must be in [0, 1]")

    def groups(self, n_blocks: int) -> list[range]:
        return Full().groups(n_blocks)

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        import torch._dynamo

        # Dynamo caches compiled code per code object and does not guard on the budget: forget earlier compiles.
        torch._dynamo.reset()
        return super().apply(blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return CompiledBlock(group[0], self.b)

    def prepare(self, step: TrainingStep) -> dict[str, Any]:
        """Compile (first step) outside the timed steps; measure what the dispatch-mode instruments cannot.

        Under any TorchDispatchMode (FLOP counter, CPU live-tensor tracker) Dynamo runs the blocks eagerly, so those
        instruments would report the uncompiled model: their fields are set to None here. Saved bytes use hooks only
        and are measured on the compiled model.
        """
        t0 = time.perf_counter()
        step.forward_backward()
        first_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        step.forward_backward()
        second_ms = (time.perf_counter() - t0) * 1e3
        saved = SavedActivations(exclude=step.params())
        with saved.recording():
            loss = step.forward()
        loss.backward()
        fields: dict[str, Any] = {
            "compile_ms": max(first_ms - second_ms, 0.0),  # first step minus a compiled step
            "saved_activation_bytes": saved.bytes,
            "flops": None,
            "recompute_flops_ratio": None,
        }
        if step.device.type != "cuda":
            fields |= {"peak_tracked_bytes": None, "fwd_bwd_peak_bytes": None, "activation_peak_bytes": None}
        return fields
