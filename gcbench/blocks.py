"""The stacks of transformer blocks in a model, found by one rule for every family: a model of one stack (a decoder,
an encoder, an image classifier's vision tower) has one block list; an encoder-decoder (T5, BART, Whisper) two, its
encoder's and its decoder's; a vision-language model (LLaVA) two, its vision tower's and its language model's; and
a policy applies to each on its own (policies.base.apply_to_stacks). What the blocks cannot do (be grouped into one
checkpoint) and see (an image's tokens, a speech encoder's frames and positions) is read off a meta build. Nothing
here is a table per family.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

from gcbench.errors import GcbenchError
from gcbench.modality import block_config, image_inputs, image_shape, seq2seq, vision_language


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
    for an encoder-decoder, {"vision": N, "language": M} for a vision-language model. A policy applies to each
    stack on its own (its own N)."""
    if vision_language(config):
        return {"vision": config.vision_config.num_hidden_layers, "language": config.text_config.num_hidden_layers}
    if not seq2seq(config):
        return {"blocks": block_config(config).num_hidden_layers}
    decoder = next((getattr(config, k) for k in DECODER_LAYERS if getattr(config, k, None)), None)
    return {"encoder": config.num_hidden_layers, "decoder": decoder or config.num_hidden_layers}


def total_blocks(config: transformers.PretrainedConfig) -> int:
    """Every stack's blocks."""
    return sum(stack_sizes(config).values())


def stack_text(config: transformers.PretrainedConfig) -> str | None:
    """The stacks as a record names them ("encoder:12,decoder:12"); None for a model of one stack."""
    sizes = stack_sizes(config)
    return None if len(sizes) == 1 else ",".join(f"{name}:{n}" for name, n in sizes.items())


def find_stacks(model: nn.Module, origin: str | None = None) -> list[tuple[str, nn.ModuleList]]:
    """(name, block list) of each stack, in the order the forward runs them: the model's own for one stack; the
    encoder's, then the decoder's, of an encoder-decoder; a vision-language model's vision tower's, then its
    language model's (each the module built from that part's config): each found by find_blocks' rule inside its
    part."""
    sizes = stack_sizes(model.config)
    where = origin or model.config.model_type
    if "blocks" in sizes:
        stacks = [("blocks", _block_list(model, sizes["blocks"], f"{where}: {type(model).__name__}",
                                         "num_hidden_layers"))]
    else:
        parts = _vision_language_parts(model) if "vision" in sizes else \
            {"encoder": model.get_encoder(), "decoder": model.get_decoder()}
        stacks = [(name, _block_list(parts[name], n, f"{where}: the {name} of {type(model).__name__}", "layers"))
                  for name, n in sizes.items()]
    for name, blocks in stacks:
        blocks.stack = name  # a policy that names one stack finds it by this (policies.base.apply_to_stacks)
    return stacks


def _vision_language_parts(model: nn.Module) -> dict[str, nn.Module]:
    """A vision-language model's vision tower and language model: the outermost module built from each part's
    config (transformers builds each with AutoModel.from_config(config.vision_config), ...text_config)."""
    config = model.config
    wanted = {"vision": config.vision_config, "language": config.text_config}
    found = {}
    for module in model.modules():
        for name, part in wanted.items():
            if name not in found and getattr(module, "config", None) is part:
                found[name] = module
    if len(found) < 2:
        raise GcbenchError(f"{config.model_type}: {type(model).__name__} has no module built from its "
                           f"{' and '.join(sorted(set(wanted) - set(found)))} config, so gcbench cannot find its "
                           "blocks")
    return found


def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The block list of each stack (find_stacks without the names): what a policy wraps, in place."""
    return [blocks for _, blocks in find_stacks(model)]


def forward_tree(cls: type) -> ast.Module | None:
    """The syntax tree of `cls.forward`'s source, or None where the source cannot be read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None


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
    """Whether `owner.forward` loops over `self.<attr>` and takes each call's result apart (into several names, or
    by index)."""
    if (tree := forward_tree(owner)) is None:
        return False
    for loop in ast.walk(tree):
        # `for block in self.<attr>`, `for i, block in enumerate(self.<attr>)`: the names a block may go by
        if isinstance(loop, ast.For) and f"self.{attr}" in ast.unparse(loop.iter):
            names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
            calls = [node for node in ast.walk(loop) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in names]
            # unpacked at once (`hidden, bias = block(...)`) or later by index (`out = block(...)`, then `out[1]`)
            results = {node.targets[0].id for node in calls if isinstance(node.targets[0], ast.Name)}
            if any(isinstance(node.targets[0], ast.Tuple) for node in calls) or any(
                    isinstance(node, ast.Subscript) and ast.unparse(node.value) in results for node in ast.walk(loop)):
                return True
    return False


_GROUPS: dict[str, str | None] = {}  # config text -> group_refusal's answer


def group_refusal(config: transformers.PretrainedConfig, build: Callable[[Any], nn.Module]) -> str | None:
    """Why a group of this model's blocks cannot run as one checkpoint (a stack's loop unpacks each block's output:
    what a block hands the next), or None; read off the model `build` makes on the meta device, once per config."""
    key = config.to_json_string(use_diff=False)
    if key not in _GROUPS:
        loops = sorted({getattr(blocks, "unpacked_by", None) for blocks in block_lists(build(config))} - {None})
        _GROUPS[key] = loops[0] if loops else None
    return None if _GROUPS[key] is None else grouping_refused(_GROUPS[key])


def grouping_refused(loop: str) -> str:
    """Why a group of blocks cannot run as one checkpoint in a stack run by `loop` (Class.forward)."""
    return (f"{loop} unpacks each block's output (what a block hands the next), so a group of blocks cannot run as one "
            "checkpoint; use a policy of single blocks (full, every-k, sac, attn, offload)")


_READ: dict[tuple[str, str], Any] = {}  # (what, config text) -> its answer, read off the meta model once


class _Seen(Exception):
    pass


def _read_once(what: str, config: transformers.PretrainedConfig, origin: str, read: Callable[[list[str]], Any]) -> Any:
    """read(said)'s answer for `config`, once per config. Where the model's own code refuses the config on the meta
    device: a GcbenchError, "{origin}: {said[0]} with this config: {why}", where read() sets said[0] to what a
    failure from that point means ("transformers cannot embed a 32x32 image"); until it does, the build failed."""
    key = (what, config.to_json_string(use_diff=False))
    if key not in _READ:
        said = ["transformers cannot build this model"]
        try:
            _READ[key] = read(said)
        except GcbenchError:
            raise
        except Exception as e:  # noqa: BLE001 - the config, refused by the model's own code
            why = " ".join(str(e).split())[:200]
            raise GcbenchError(f"{origin or config.model_type}: {said[0]} with this config: {why}") from None
    return _READ[key]


def _first_block_positions(model: nn.Module, forward: Callable[[], Any]) -> int:
    """The positions (dim 1) of the input of the model's first block, as `forward` runs the model: it stops there."""
    seen: list[int] = []

    def first_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args[0] if args else next(iter(kwargs.values()))).shape[1])
        raise _Seen

    hook = find_stacks(model)[0][1][0].register_forward_pre_hook(first_input, with_kwargs=True)
    try:
        forward()
    except _Seen:
        pass
    finally:
        hook.remove()
    if not seen:
        raise RuntimeError("its forward never reached its first block")
    return seen[0]


def image_tokens(config: transformers.PretrainedConfig, build: Callable[[Any], nn.Module], origin: str = "") -> int:
    """The tokens an image classifier's blocks see per image: its patches and the class tokens it adds (ViT one,
    DeiT two, SigLIP none), read off the first block's input in a forward of the model `build` makes on the meta
    device, once per config."""
    channels, side = image_shape(config, origin)  # a classifier fed no image of a fixed size: refused here

    def read(said: list[str]) -> int:
        model = build(config)
        said[0] = f"transformers cannot embed a {side}x{side} image"
        pixels = torch.empty(1, channels, side, side, device="meta")
        return _first_block_positions(model, lambda: model(pixel_values=pixels))

    return _read_once("image tokens", config, origin, read)


def tokens_per_image(config: transformers.PretrainedConfig, build: Callable[[Any], nn.Module], origin: str = "") -> int:
    """The tokens one image becomes in a vision-language model's language model: the rows of the features its
    get_image_features hands the language model for one image (LLaVA: the patches, its CLS token dropped or kept as
    vision_feature_select_strategy says), read off the model `build` makes on the meta device, once per config."""
    def read(said: list[str]) -> int:
        model = build(config)
        side = config.vision_config.image_size
        said[0] = f"transformers cannot embed a {side}x{side} image"
        pixels = {name: torch.empty(shape, dtype=dtype, device="meta")
                  for name, (shape, dtype) in image_inputs(config, 1).items()}
        return model.get_image_features(**pixels, return_dict=True).pooler_output[0].shape[0]

    return _read_once("tokens per image", config, origin, read)


def speech_input(config: transformers.PretrainedConfig, build: Callable[[Any], nn.Module], origin: str = ""
                 ) -> tuple[int, int]:
    """(frames of log-mel features per sample, the positions the encoder's blocks see) of a speech encoder: its
    positions (max_source_positions) times the strides of its conv stem's Conv1d layers (Whisper's 1 and 2: 3,000
    frames, 30 s of audio, make 1,500 positions; WhisperEncoder refuses any other count), read off the model `build`
    makes on the meta device, and the positions off the first block's input in a forward of the encoder there,
    once per config."""
    def read(said: list[str]) -> tuple[int, int]:
        model = build(config)
        encoder = model.get_encoder()
        frames = config.max_source_positions * math.prod(
            m.stride[0] for m in encoder.modules() if isinstance(m, nn.Conv1d))
        said[0] = f"transformers cannot encode {frames} frames of {config.num_mel_bins} log-mel bins"
        features = torch.empty(1, config.num_mel_bins, frames, device="meta")
        return frames, _first_block_positions(model, lambda: encoder(input_features=features))

    return _read_once("speech input", config, origin, read)
