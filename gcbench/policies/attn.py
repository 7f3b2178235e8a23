"""`attn`: recompute only the attention core (QK^T, softmax, dropout, PV) of every block (Korthikanti et al. 2022,
Megatron "selective") by rerouting each attention module's call of the transformers attention interface to a
checkpointed version of the same function. Semantics and sources: docs/policies.md.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from gcbench.errors import GcbenchError
from gcbench.measure import checkpoint
from gcbench.policies.base import Policy, register

# The checkpointed version of an implementation is registered in the attention interface under this prefix + the
# original implementation's name.
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


def _reroute(module: nn.Module, interface: Any) -> tuple[nn.Module, Any]:
    """Route `module`'s attention calls to the checkpointed version of its implementation; (module, its config)."""
    if getattr(module, "reorder_and_upcast_attn", False):
        raise GcbenchError("attn: GPT-2's reorder_and_upcast_attn bypasses the attention interface")
    implementation = module.config._attn_implementation or "sdpa"
    name = RECOMPUTE_CORE_PREFIX + implementation
    if name not in interface:
        interface[name] = _checkpointed_core(implementation)
    # The module alone sees a copy of the config naming the rerouted implementation: the model's mask construction
    # and every other module keep reading the original.
    view = copy.copy(module.config)
    view._attn_implementation = name
    config, module.config = module.config, view
    return module, config


@register("attn")
class AttentionCore(Policy):
    summary = ("recompute only the attention core (QK^T, softmax, dropout, PV) of every block; projections and MLP "
               "keep their activations (Korthikanti et al. 2022, Megatron 'selective')")

    def alike_blocks(self, n_blocks: int) -> bool:
        return True  # the same attention core rerouted in every block

    def apply(self, blocks: nn.ModuleList) -> Callable[[], None]:
        interface = _attention_interface()
        rerouted: list[tuple[nn.Module, Any]] = []
        for i, block in enumerate(blocks):
            # every attention module of the block: a decoder's of an encoder-decoder are two (self and cross)
            if not (found := attention_modules(block)):
                raise GcbenchError(f"attn: no attention module in block {i} ({type(block).__name__}) calls the "
                                   "transformers attention interface")
            for module in found:
                rerouted.append(_reroute(module, interface))

        def undo() -> None:
            for module, config in rerouted:
                module.config = config

        return undo
