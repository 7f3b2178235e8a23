"""`--compile blocks`: every transformer block under torch.compile, after the checkpoint policy wrapped it, as
torchtitan does (its `apply_compile`, torchtitan/models/llama3/parallelize.py: `torch.compile(transformer_block,
fullgraph=True)` for each block after `apply_ac`, registered back under the same name). Semantics, measured effect
and what is not predicted: docs/levers.md, "Compiled blocks".

Imports nothing heavy: resolve() checks a spec's combination here before anything is built.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError
from gcbench.fields import DeviceKind

if TYPE_CHECKING:
    from torch import nn

BLOCKS = "blocks"
# The policies whose wrapped blocks compile and keep none's gradients (tests/test_paged_compile.py holds each): the
# plain checkpoints (Dynamo traces torch.utils.checkpoint as one higher-order op whose region the partitioner
# recomputes) and attn's. Named here, not inferred, so that a new policy is refused until someone tests it.
COMPILES_WITH = ("none", "full", "every-k", "segments", "sqrtn", "attn")
# Why the others cannot, each in words the refusal prints (checked on torch 2.13, CPU)
REFUSED = {
    "budget": "budget compiles every block itself (under its activation memory budget)",
    "sac": "inductor fails on sac's selective-checkpoint context (BackendCompilerFailed on its context_fn)",
    "offload": "Dynamo cannot trace offload's saved_tensors_hooks: its blocks would run uncompiled",
    "plan": "a plan mixes sac and offload blocks, which do not compile",
}
# What `gcbench estimate` says for a compiled config, and why a run's record carries no prediction for it: the
# simulation does not compile (simulate._refuse_compiled: inductor on fake tensors crashed the process), and
# predicting the eager step instead would be a wrong number with a right name. docs/levers.md says what was checked
# toward reading the partition under fake tensors, and what is missing.
UNPREDICTED = ("compiled blocks are not predicted: the partitioner's saved set is not modelled (what AOTAutograd's "
               "min-cut partition keeps for backward); predict --compile none, or measure")


def check_compile(spec: Any, policy: Any, device: str) -> None:
    """GcbenchError in one line where `--compile blocks` cannot run as asked: with a policy it does not compile
    with, under FSDP2, or under a CPU memory cap (whose live-tensor tracker, a dispatch mode, would make Dynamo run
    every step's blocks uncompiled from the warm-up on). `spec`: a RunSpec; `policy`: its parsed policy; `device`:
    the resolved device."""
    if spec.compile != BLOCKS:
        return
    if policy.name not in COMPILES_WITH:
        why = REFUSED.get(policy.name, "it is not tested with compiled blocks")
        raise GcbenchError(f"--compile blocks does not go with --policy {policy.name}: {why}; use --compile none "
                           f"(compiled blocks go with {', '.join(COMPILES_WITH)})")
    if spec.shard != "none":
        raise GcbenchError("--compile blocks with --shard fsdp2 is not supported (compiled blocks inside FSDP2 "
                           "units are untested: their gradients are not known to equal none's)")
    if DeviceKind.of(device) is DeviceKind.CPU and spec.memory_cap_bytes is not None:
        raise GcbenchError("--compile blocks under a memory cap on CPU (--memory-cap, or gcbench fit's budget, "
                           "which caps every trial): the cap's live-tensor tracker would make torch.compile run the "
                           "blocks uncompiled in every step; on CPU measure compiled blocks with run or sweep and "
                           "no cap")


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Put each block of `blocks` (already wrapped by the policy) under torch.compile, in place. The stand-ins of a
    multi-block checkpoint (GroupArguments: they only note their call's arguments) stay eager; the group they stand
    for is compiled where it sits. The policy's undo puts the original blocks back, uncompiled.

    fullgraph=False, unlike torchtitan: under a TorchDispatchMode (the FLOP counter, the CPU live-tensor tracker)
    Dynamo refuses to compile, and with fullgraph=True it raises instead of running the block eagerly; the runner
    reports what those instruments count as unknown (as for the budget policy), and the tests check that the tiny
    models' blocks compile without a graph break. fallback_random: inductor draws random numbers with eager's
    kernels, so dropout masks, and so gradients, equal the eager step's (its own RNG would draw other masks)."""
    import torch
    import torch._dynamo

    from gcbench.policies.base import GroupArguments

    # The FLOP counter's module tracker (torch.utils.module_tracker) registers global module hooks while the runner
    # counts saved bytes; torch.compile then warns that they may fire twice. That count of a compiled block is
    # reported as unknown anyway (see above): the warning says nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"Using torch\.compile\(module\) when there are global hooks",
                            category=UserWarning)
    torch._dynamo.reset()  # a compile in this process before (another run) would make compile_ms a cache hit
    for name, block in blocks.named_children():
        if not isinstance(block, GroupArguments):
            blocks.register_module(name, torch.compile(block, options={"fallback_random": True}))
