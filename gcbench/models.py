"""Models from their config: a preset name, a local config.json or a Hugging Face Hub id (its config.json only).

Any transformers family builds through the Auto classes, random weights, nothing downloaded but a config.json:
a causal LM for decoders, a masked LM for encoders, a text-to-text model for encoder-decoders, an image classifier
for vision encoders, an image-text-to-text model for vision-language models. The stacks of blocks are found by one
rule for every family (blocks.py: find_stacks), and the longest sequence by another (max_positions); nothing here is
a table per family.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from gcbench.blocks import (DECODER_LAYERS, block_lists, find_blocks, find_stacks, group_refusal, image_tokens,
                            speech_input, stack_sizes, stack_text, tokens_per_image, total_blocks)
from gcbench.config_values import check_values, positive_int
from gcbench.errors import GcbenchError
from gcbench.modality import (FRAMES, IMAGE_TOKENS, MODALITIES, auto_class, block_config, choose_head,
                              image_classifier, modality_name, seq2seq, speech, vision_language)
from gcbench.per_layer import cut_layers, layer_configs, layer_values, reuses_missing_kv, shown
from gcbench.presets import MODELS, Preset
from gcbench.units import plural

__all__ = ["MODALITIES", "MODELS", "Preset", "block_lists", "build_meta_model", "build_model", "count_params",
           "describe", "experts_implementation", "find_blocks", "find_stacks", "group_refusal", "load_config",
           "max_positions", "image_classifier", "image_tokens", "prepare_config", "seq2seq", "stack_sizes",
           "stack_text", "total_blocks"]

transformers.logging.set_verbosity_error()  # config-validation chatter about random-init presets is noise here

# A Hub model id: owner/name (letters, digits, - _ .), optionally @revision (a branch, tag or commit)
_HUB_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*(@[\w./-]+)?")


def load_config(model: str) -> tuple[transformers.PretrainedConfig, str]:
    """(config, family) of a preset name, a local config.json (or a directory holding one), or a Hugging Face Hub
    id `owner/name[@revision]`, of which only config.json is fetched (hub.py). family is the config's model_type.

    A config.json is checked as a whole before it is used: the values transformers refuses, sizes that are not
    positive integers, heads that do not divide, and a model that cannot be built from it are each one
    GcbenchError naming the file, the field and the rule."""
    if model in MODELS:  # a deep copy: transformers writes into the dicts it is given (rope_scaling)
        return config_from_dict(copy.deepcopy(MODELS[model].config), model, check=False)
    path = Path(model)
    try:
        if path.is_dir():
            path = path / "config.json"
        local = path.suffix == ".json" or path.exists()
    except OSError as e:
        raise GcbenchError(f"cannot read model config {model[:200]!r}: {e.strerror or e}") from None
    if not local:
        if not _HUB_ID.fullmatch(model):
            raise GcbenchError(f"unknown model {model!r}: not a preset ({', '.join(MODELS)}), a path to a "
                               "config.json, or a Hugging Face Hub id such as Qwen/Qwen3-8B")
        from gcbench.hub import hub_config_file

        try:
            path = hub_config_file(model)
        except GcbenchError as e:
            raise GcbenchError(f"{e} (no local file or directory is named {model!r} either)") from None
    return config_from_dict(read_config_json(path), str(path) if local else model)


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object of a config.json; a file that cannot be read or is not one JSON object is a GcbenchError."""
    try:
        if path.exists() and not path.is_file():
            raise OSError(f"{str(path)!r} is not a regular file")
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise GcbenchError(f"cannot read model config {str(path)[:200]!r}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bytes that are not UTF-8, nesting too deep
        raise GcbenchError(f"{str(path)!r} is not a JSON config: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise GcbenchError(f"{str(path)!r}: a config.json holds one JSON object, not a {type(data).__name__}")
    return data


def config_from_dict(data: dict[str, Any], origin: str, check: bool = True) -> tuple[transformers.PretrainedConfig,
                                                                                     str]:
    """(config, family) from config.json fields; `origin` names them in errors (a path, a Hub id, a preset).

    A vision-language model's config (modality.vision_language: LLaVA, Gemma 3) that gives its vision_config is
    kept whole: its vision tower and its language model train. Any other multimodal config (a text model beside a
    tower gcbench makes no inputs for) becomes its text model's config, refused where transformers has no causal-LM
    head for that alone (Qwen2-VL's). `auto_map` is dropped: the model is always transformers' own class for its
    model_type, never code from the Hub."""
    data = dict(data)
    family = data.pop("model_type", None)
    if not isinstance(family, str):
        raise GcbenchError(f"{origin}: no model_type: a config.json names its transformers family (model_type)")
    if family not in transformers.CONFIG_MAPPING:
        own_code = "; gcbench never runs a model's own code (auto_map, trust_remote_code)" if "auto_map" in data \
            else ""
        raise GcbenchError(f"{origin}: model_type {family!r} is not a family transformers {transformers.__version__} "
                           f"has{own_code}")
    cls = transformers.CONFIG_MAPPING[family]
    sizes = {*_SIZES, *(cls.attribute_map[k] for k in _SIZES if k in cls.attribute_map)}  # gpt2: n_embd, ...
    check_values(data, sizes, origin)
    try:
        config = cls(**{k: v for k, v in data.items() if k != "auto_map"})
        # a text encoder-decoder is its own text model (T5's text config for a decoder is a copy that drops fields)
        # a VLM whose file describes its vision tower (one left to transformers' default trains its text model)
        whole = seq2seq(config) or image_classifier(config) or (vision_language(config) and "vision_config" in data)
        text = config if whole else config.get_text_config(decoder=True)
    except Exception as e:  # noqa: BLE001 - transformers' refusal of the user's values, whatever its type
        raise GcbenchError(f"{origin}: transformers refuses this config: {_validation_message(e)}") from None
    if text is not config:
        if family in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and text.model_type not in \
                MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # the real reason, not its text model's missing head
            raise GcbenchError(f"{origin}: {family} is a vision-language model whose vision tower gcbench makes no "
                               "inputs for (it takes images of one size into the text's placeholders only: "
                               f"docs/models.md, 'Vision-language models'), and its text model ({text.model_type}) "
                               f"has no causal-LM head in transformers {transformers.__version__} to train alone")
        config = text
        family = config.model_type
    key = (origin, json.dumps(data, sort_keys=True, default=str))
    if check and key not in _CHECKED:  # a sweep makes a RunSpec per config, each loading the config again
        _check_config(config, origin)
        _CHECKED.add(key)
    return config, family


# Sizes every family's config has (through its attribute_map: gpt2's n_embd is hidden_size); None means "derived".
_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "vocab_size", "max_position_embeddings", "n_positions", "head_dim", "n_inner", *DECODER_LAYERS,
          "image_size", "patch_size", "num_channels", "num_mel_bins", "max_source_positions", "max_target_positions")


_CHECKED: set[tuple[str, str]] = set()  # (origin, config text) already checked
MAX_LAYERS = 1_000  # blocks; the deepest published models have about 130


def _check_config(config: transformers.PretrainedConfig, origin: str) -> None:
    """The rules a config must obey to be built and trained (an image classifier's on its blocks' config)."""
    whole, text, config = config, not image_classifier(config), block_config(config)
    towers = ((whole.vision_config, "vision_config's "),) if vision_language(whole) else ()
    for part, where in ((config, ""), *towers):
        for at, layer in layer_configs(part):  # a config whose layers differ: each layer's (per_layer.py)
            for name in _SIZES:
                value = getattr(layer, name, None)
                if value is not None and not positive_int(value):
                    raise GcbenchError(f"{origin}: {where}{at}{name} must be a positive integer, got {value!r}")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", *(("vocab_size",) if text else ())):
        if None in layer_values(config, name):
            raise GcbenchError(f"{origin}: {name} is missing: gcbench trains transformer language models and image "
                               "classifiers")
    if why := reuses_missing_kv(config):
        raise GcbenchError(f"{origin}: {why}")
    for stack, n in stack_sizes(whole).items():  # a meta build of millions of blocks would take the machine down
        if n > MAX_LAYERS:
            name = "num_hidden_layers" if stack in ("blocks", "encoder") else "the decoder's layers"
            raise GcbenchError(f"{origin}: {name} must be at most {MAX_LAYERS:,}, got {n:,}")
    for rope in _rope_settings(config):
        factor = rope.get("factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1e6:
            raise GcbenchError(f"{origin}: rope_scaling's factor must be a number from 1 to 1e6, got {factor!r}")
    for where, layer in layer_configs(config):
        heads = layer.num_attention_heads
        kv = getattr(layer, "num_key_value_heads", None) or heads
        if heads % kv:
            raise GcbenchError(f"{origin}: {where}num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
        if getattr(layer, "head_dim", None) is None and layer.hidden_size % heads:
            raise GcbenchError(f"{origin}: {where}hidden_size ({layer.hidden_size}) must be a multiple of "
                               f"num_attention_heads ({heads})")
    config = whole
    head = auto_class(config, origin, "lm")  # the head a run chooses is prepare_config's
    pad = getattr(config, "pad_token_id", None)
    vocab = getattr(block_config(config), "vocab_size", None)  # a VLM's: its language model's
    if text and positive_int(pad) and pad >= vocab:  # transformers' own words name neither field
        raise GcbenchError(f"{origin}: pad_token_id ({pad}) must be below vocab_size ({vocab})")
    try:
        model = _meta_build(head, config)  # no memory, no init: whatever else transformers refuses, say it now
    except Exception as e:  # noqa: BLE001
        raise GcbenchError(f"{origin}: transformers cannot build a model from this config: {_one_line(e)}") from None
    find_stacks(model, origin)
    if image_classifier(config):
        image_tokens(config, build_meta_model, origin)  # an image its patches do not fit: said now
    if vision_language(config):
        tokens_per_image(config, build_meta_model, origin)
    if speech(config):
        speech_input(config, build_meta_model, origin)  # features its conv stem cannot read: said now


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _validation_message(e: BaseException) -> str:
    """transformers' (huggingface_hub's strict dataclass) validation error as "field: rule" on one line."""
    text = _one_line(e)
    if m := re.fullmatch(r"Validation error for field '(\w+)': \w+: (.*)", text):
        return f"{m[1]}: {m[2]}"
    return re.sub(r"^Class validation error for validator '\w+': \w+: ", "", text)


def prepare_config(config: transformers.PretrainedConfig, family: str, *, layers: int | None, seq_len: int,
                   attn: str | None, head: str = "lm", images: int | None = None, target_len: int | None = None
                   ) -> transformers.PretrainedConfig:
    """Apply the run's shape to a config: truncate blocks, check positions, the head, training-only settings. A
    vision-language model's `seq_len` is its text's tokens; its language model sees its `images` too. An
    encoder-decoder's `target_len` is its decoder's (modality.target_tokens)."""
    blocks = block_config(config)  # an image classifier's vision config, a VLM's text config
    n = blocks.num_hidden_layers
    if images is not None and not vision_language(config):
        raise GcbenchError(f"--images {images}: this {family} model has no vision tower that gcbench feeds (--images "
                           "is for vision-language models: llava, gemma3, ...)")
    if layers is not None:
        sizes = stack_sizes(config)
        if not 1 <= layers <= min(sizes.values()):
            has = f"{n} blocks" if len(sizes) == 1 else " and ".join(f"{m} in its {k}" for k, m in sizes.items())
            raise GcbenchError(f"--layers {layers} is out of range: the model has {has}")
        for part in (config.vision_config, blocks) if vision_language(config) else (blocks,):  # each stack its N
            n = part.num_hidden_layers
            for key, value in vars(part).items():
                # per-block lists (layer_types: Gemma's local/global pattern, Qwen's sliding layers) keep the first N
                if isinstance(value, list) and len(value) == n and not key.endswith(("token_id", "token_ids")):
                    setattr(part, key, value[:layers])
            part.num_hidden_layers = layers
            cut_layers(part, layers, n)  # per-layer settings (per_layer.py): the first N layers' own
        for key in DECODER_LAYERS if "decoder" in sizes else ():  # an encoder-decoder: each stack its first N
            if getattr(config, key, None):
                setattr(config, key, layers)
    if image_classifier(config):
        if seq_len != (tokens := image_tokens(config, build_meta_model)):
            side = blocks.image_size
            raise GcbenchError(f"--seq {seq_len}: this {family} model reads {side}x{side} images, {tokens} tokens "
                               f"each (its patches and class tokens): give --seq {tokens} (another image size needs a "
                               "config.json that sets it)")
    if speech(config):
        frames, tokens = speech_input(config, build_meta_model)
        if seq_len != tokens:
            raise GcbenchError(f"--seq {seq_len}: this {family} model's encoder reads {frames} frames of log-mel "
                               f"features per sample, {tokens} positions (max_source_positions): give --seq {tokens} "
                               "(another length needs a config.json that sets max_source_positions)")
        setattr(config, FRAMES, frames)  # what the step draws (modality.inputs_of)
    _check_targets(config, family, target_len)
    limit, learned = (None, False) if image_classifier(config) or speech(config) else max_positions(blocks)
    if vision_language(config):
        setattr(config, IMAGE_TOKENS, tokens_per_image(config, build_meta_model, family))
        if limit is not None and seq_len + (images or 1) * getattr(config, IMAGE_TOKENS) > limit:
            each = getattr(config, IMAGE_TOKENS)
            raise GcbenchError(f"--seq {seq_len}: with {plural(images or 1, 'image')} of {each} tokens, this {family} "
                               f"model's language model would see {seq_len + (images or 1) * each} tokens, beyond its "
                               f"{limit} positions (--seq counts the text's tokens alone)")
    if limit is not None and seq_len > limit:
        if learned:
            raise GcbenchError(f"--seq {seq_len} exceeds the {limit} learned positions of this {family} model")
        scaled = limit != getattr(config, "max_position_embeddings", limit)
        raise GcbenchError(f"--seq {seq_len} exceeds the {limit} positions this {family} model is made for "
                           f"(max_position_embeddings{', times its rope_scaling factor' if scaled else ''}); for "
                           "longer sequences use a config.json that allows them")
    config.use_cache = False
    for part in (getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if isinstance(part, transformers.PretrainedConfig) and vision_language(config):
            part.use_cache = False  # the language model reads its own config's
    if seq2seq(config) and not isinstance(getattr(config, "decoder_start_token_id", None), int):
        # the decoder's first input (transformers 5 keeps it in the generation config when the file omits it):
        # T5's convention, the pad id, else 0; which id changes no memory
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else 0
    choose_head(config, head)
    sdpa = auto_class(config)._model_mapping[type(config)]._supports_sdpa
    if attn == "sdpa" and not sdpa:
        raise GcbenchError(f"{family} models have no SDPA attention in transformers {transformers.__version__}; "
                           "use --attn eager")
    # Set here, so that every reader (the step, the estimators, the record) sees the one the model runs.
    config._attn_implementation = attn or ("sdpa" if sdpa else "eager")
    if layers is not None:  # the first N blocks may not make a model (a layer reusing what a cut one made): say it
        try:
            build_meta_model(config)
        except Exception as e:  # noqa: BLE001
            raise GcbenchError(f"--layers {layers}: transformers cannot build this {family} model from its first "
                               f"{layers} blocks: {_one_line(e)}") from None
    return config


def _check_targets(config: transformers.PretrainedConfig, family: str, target_len: int | None) -> None:
    """--target-len against the model: an encoder-decoder's, within its decoder's positions (its own table where the
    config sizes one, max_target_positions, else the positions both stacks share)."""
    if target_len is None:
        return
    if not seq2seq(config):
        raise GcbenchError(f"--target-len {target_len}: this {family} model is not an encoder-decoder (T5, BART, "
                           "Whisper); its one sequence is --seq")
    own = getattr(config, "max_target_positions", None)
    limit = own or max_positions(config)[0]
    if limit is not None and target_len > limit:
        raise GcbenchError(f"--target-len {target_len} exceeds the {limit} positions of this {family} model's decoder "
                           f"({'max_target_positions' if own else 'max_position_embeddings'})")


def _rope_settings(config) -> list[dict]:
    """The rotary embedding's parameters (transformers 5: rope_parameters; older: rope_scaling): one dict, or one
    per layer type (Gemma 3: local and global layers); [] without RoPE."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    nested = [v for v in rope.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(rope) else [rope]


_POSITION_TABLES: dict[str, int | None] = {}  # config text -> the usable rows of its learned position table


def max_positions(config) -> tuple[int | None, bool]:
    """(the longest sequence the model is made for, whether that is a learned position table's size).

    With RoPE: max_position_embeddings, times the factor of a linear or dynamic rope_scaling, which transformers
    does not fold into it (with settings per layer type, the smallest); a longer sequence would run, outside what
    the model was made for. Otherwise the learned
    position table (an embedding, not the token embedding, of max_position_embeddings rows), less the rows below
    its padding index that RoBERTa-style models skip; without one, max_position_embeddings if the config has it."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if ropes := _rope_settings(config):
        # per layer type, the smallest factor: every layer must be within what it is made for
        factor = min(float(r.get("factor", 1.0)) if r.get("rope_type", r.get("type")) in ("linear", "dynamic")
                     else 1.0 for r in ropes)
        return (None if positions is None else int(positions * factor)), False
    key = config.to_json_string(use_diff=False)
    if key not in _POSITION_TABLES:
        model = build_meta_model(config)
        tokens = model.get_input_embeddings()
        tables = [m for m in model.modules() if isinstance(m, nn.Embedding) and m is not tokens
                  and m.num_embeddings == positions]
        _POSITION_TABLES[key] = None if not tables else \
            tables[0].num_embeddings - (0 if tables[0].padding_idx is None else tables[0].padding_idx + 1)
    table = _POSITION_TABLES[key]
    return (table, True) if table is not None else (positions, False)


def build_model(config, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Random-init the model directly on `device` in `dtype` (a 7B model is never materialised on the host). The
    model gets its own copy of `config` (transformers writes the dtype into it, a policy the attention kernel): a
    resolved run's config is shared by every build of that run."""
    config = copy.deepcopy(config)
    with _BUILDING, torch.device(device):
        model = auto_class(config).from_config(config, dtype=dtype,
                                               attn_implementation=getattr(config, "_attn_implementation", None))
    model.train()
    return model


def build_meta_model(config) -> nn.Module:
    """The model on the meta device: shapes and parameter counts, no memory, no init time (on its own copy of
    `config`, as build_model)."""
    return _meta_build(auto_class(config), copy.deepcopy(config))


def _meta_build(head: type, config) -> nn.Module:
    with _BUILDING, torch.device("meta"):
        return head.from_config(config)


# transformers sets the process's default dtype while it builds a model (from_config(dtype=...)): a build in
# another thread meanwhile would take that dtype for its parameters. One build at a time (the estimators' threads,
# estimators/sharing.py side_by_side).
_BUILDING = threading.RLock()


def experts_implementation(model: nn.Module) -> str | None:
    """How transformers runs the model's mixture-of-experts layers: the experts_implementation of the experts
    modules its use_experts_implementation decorator made (those carry has_gate and is_transposed), grouped_mm by
    default (modeling_utils.get_correct_experts_implementation), batched_mm or eager where asked; None for a model
    without such modules (a dense one, or experts of an older transformers)."""
    found = {getattr(m.config, "_experts_implementation", None) or "eager" for m in model.modules()
             if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "config")}
    return "+".join(sorted(found)) or None


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(name: str) -> dict[str, Any]:
    """One row of `gcbench models`: name, family, params, layers, hidden, heads and kv heads, vocab, max seq (an
    image classifier: no vocabulary, and the one --seq it takes, its image's tokens; a vision-language model: its
    language model's, and the longest --seq of text beside one image). A preset is fixed: its row is made once per
    process (a meta build each, 0.1-0.3 s), and each caller gets its own copy."""
    return dict(_described(name))


@functools.cache
def _described(name: str) -> dict[str, Any]:
    p = MODELS[name]
    config, family = load_config(name)
    blocks = block_config(config)
    return {
        "name": name,
        "family": family,
        "modality": modality_name(config),
        "params": count_params(build_meta_model(config)),
        "layers": total_blocks(config), "stacks": stack_text(config),  # and each stack's ("encoder:12,decoder:12")
        "hidden": shown(blocks, "hidden_size"),  # where the layers differ: each value ("4,2")
        "heads": shown(blocks, "num_attention_heads"),
        "kv_heads": shown(blocks, "num_key_value_heads") or shown(blocks, "num_attention_heads"),  # fewer: GQA
        "vocab": getattr(blocks, "vocab_size", None),
        "max_seq": image_tokens(config, build_meta_model) if image_classifier(config) else
        max_positions(blocks)[0] - tokens_per_image(config, build_meta_model) if vision_language(config) else
        speech_input(config, build_meta_model)[1] if speech(config) else max_positions(blocks)[0],
        "summary": p.summary,
        "source": p.source,
    }
