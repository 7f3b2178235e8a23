"""Activation-checkpointing policies: small registered classes that wrap a model's list of transformer blocks.

Importing this package fills POLICIES, in the order `gcbench policies` lists them: base.py holds the machinery
(registry, options, the Policy base class, parse_policy), each other module one kind of policy: classic.py (none,
full, every-k, segments, sqrtn), sac.py (op-level selective), attn.py (attention-core recompute), offload.py (host
memory), budget.py (torch.compile's activation memory budget),
plan.py (a per-block mix chosen to fit a memory budget). docs/policies.md has their semantics and sources.
A new policy module is imported below, or its policies are never registered.
"""

from gcbench.policies.base import (POLICIES, CheckpointedGroup, GroupArguments, Policy, apply_to_stacks, option,
                                   option_fields, parse_policy, register)
from gcbench.policies.classic import EveryK, Full, NoCheckpoint, Segments, SqrtN
from gcbench.policies.sac import SAC_ATTENTION, SAC_MATMULS, SelectiveCheckpointedBlock, SelectiveOps, sac_policy_fn
from gcbench.policies.attn import RECOMPUTE_CORE_PREFIX, AttentionCore, attention_modules
from gcbench.policies.offload import HostOffload, Offload, OffloadedBlock
from gcbench.policies.budget import CompileBudget, CompiledBlock
from gcbench.policies.plan import Plan

__all__ = [
    "POLICIES", "CheckpointedGroup", "GroupArguments", "Policy", "apply_to_stacks", "option", "parse_policy", "register",
    "EveryK", "Full", "NoCheckpoint", "Segments", "SqrtN",
    "SAC_ATTENTION", "SAC_MATMULS", "SelectiveCheckpointedBlock", "SelectiveOps", "sac_policy_fn",
    "RECOMPUTE_CORE_PREFIX", "AttentionCore", "attention_modules",
    "HostOffload", "Offload", "OffloadedBlock",
    "CompileBudget", "CompiledBlock",
    "Plan", "option_fields",
]
