"""The stacks of transformer blocks in a model, found by one rule for every family: a model of one stack (a decoder
or an encoder) has one block list; a text encoder-decoder (T5, BART) two, its encoder's and its decoder's, and a
policy applies to each on its own (policies.base.apply_to_stacks). Nothing here is a table per family.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import transformers
from torch import nn

from gcbench.errors import GcbenchError


def seq2seq(config: transformers.PretrainedConfig) -> bool:
    """Whether the model is a text encoder-decoder (T5, BART): an encoder stack reads the input ids, a decoder stack
    the targets shifted right, with cross-attention to the encoder's output (a ForConditionalGeneration head)."""
    return bool(getattr(config, "is_encoder_decoder", False))


def find_blocks(model: nn.Module, origin: str | None = None) -> nn.ModuleList:
    """The transformer block list of a model of one stack, by one rule for every family: the first (outermost)
    nn.ModuleList holding `num_hidden_layers` modules of one class (model.layers, transformer.h, encoder.layer,
    gpt_neox.layers, ...). An encoder-decoder has two: find_stacks."""
    if len(stacks := find_stacks(model, origin)) > 1:
        raise GcbenchError(f"{origin or model.config.model_type}: an encoder-decoder has {len(stacks)} stacks of "
                           "blocks; this path takes a model of one")
    return stacks[0][1]


# The decoder's block count in an encoder-decoder's config (T5's, BART's); num_hidden_layers is the encoder's
DECODER_LAYERS = ("num_decoder_layers", "decoder_layers")


def stack_sizes(config: transformers.PretrainedConfig) -> dict[str, int]:
    """Blocks per stack, by the stack's name: {"blocks": N} for a model of one stack, {"encoder": N, "decoder": M}
    for an encoder-decoder. A policy applies to each stack on its own (its own N)."""
    if not seq2seq(config):
        return {"blocks": config.num_hidden_layers}
    decoder = next((getattr(config, k) for k in DECODER_LAYERS if getattr(config, k, None)), None)
    return {"encoder": config.num_hidden_layers, "decoder": decoder or config.num_hidden_layers}


def stack_text(config: transformers.PretrainedConfig) -> str | None:
    """The stacks as a record names them ("encoder:12,decoder:12"); None for a model of one stack."""
    sizes = stack_sizes(config)
    return None if len(sizes) == 1 else ",".join(f"{name}:{n}" for name, n in sizes.items())


def find_stacks(model: nn.Module, origin: str | None = None) -> list[tuple[str, nn.ModuleList]]:
    """(name, block list) of each stack, in the order the forward runs them: the model's own for one stack; the
    encoder's, then the decoder's, of an encoder-decoder (each found by find_blocks' rule inside that part)."""
    sizes = stack_sizes(model.config)
    where = origin or model.config.model_type
    if "blocks" in sizes:
        blocks = _block_list(model, sizes["blocks"], f"{where}: {type(model).__name__}", "num_hidden_layers")
        return [("blocks", blocks)]
    parts = {"encoder": model.get_encoder(), "decoder": model.get_decoder()}
    return [(name, _block_list(parts[name], n, f"{where}: the {name} of {type(model).__name__}", "layers"))
            for name, n in sizes.items()]


def _block_list(module: nn.Module, n: int, what: str, field: str) -> nn.ModuleList:
    """The first (outermost) nn.ModuleList of `n` modules of one class in `module`. Where the loop that runs them
    unpacks each block's output (T5's blocks hand the next one their position biases), the list's `unpacked_by`
    names that loop: a group of its blocks cannot stand in it as one checkpoint (policies.base.Policy.apply)."""
    for owner in module.modules():
        for attr, m in owner.named_children():
            if isinstance(m, nn.ModuleList) and len(m) == n and len({type(b) for b in m}) == 1:
                if _unpacks_outputs(type(owner), attr):
                    m.unpacked_by = f"{type(owner).__name__}.forward"
                return m
    raise GcbenchError(f"{what} has no nn.ModuleList of its {n} blocks ({field}) of one class, so gcbench cannot "
                       "find the blocks to checkpoint")


@functools.cache
def _unpacks_outputs(owner: type, attr: str) -> bool:
    """Whether `owner.forward` loops over `self.<attr>` and unpacks each call's result into several names."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and attr in ast.unparse(loop.iter):
            name = loop.target.id
            if any(isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                   and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == name
                   for node in ast.walk(loop)):
                return True
    return False
