"""Model presets: transformers config classes with random weights; nothing is ever downloaded."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Presets are built from configs only; this makes any accidental hub access fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from gcbench.errors import GcbenchError  # noqa: E402

transformers.logging.set_verbosity_error()  # config-validation chatter about random-init presets is noise here


@dataclass(frozen=True)
class Family:
    """How to build and train one architecture family."""

    config_cls: type[transformers.PretrainedConfig]
    auto_model: type  # the Auto* class with a training head (labels -> loss)
    learned_positions: bool  # a learned position table caps seq_len; RoPE models can be stretched


FAMILIES: dict[str, Family] = {
    "llama": Family(transformers.LlamaConfig, transformers.AutoModelForCausalLM, learned_positions=False),
    "mistral": Family(transformers.MistralConfig, transformers.AutoModelForCausalLM, learned_positions=False),
    "gpt2": Family(transformers.GPT2Config, transformers.AutoModelForCausalLM, learned_positions=True),
    "bert": Family(transformers.BertConfig, transformers.AutoModelForMaskedLM, learned_positions=True),
}


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    summary: str
    make_config: Callable[[], transformers.PretrainedConfig]


MODELS: dict[str, Preset] = {}


def preset(name: str, family: str, summary: str, **config) -> None:
    """Register a preset: `config` are the keyword arguments of the family's config class."""
    cls = FAMILIES[family].config_cls
    MODELS[name] = Preset(name, family, summary, lambda: cls(**config))


_LLAMA = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
preset("llama-7b", "llama", "Llama-2 7B: 32 x 4096, MHA 32 heads, SwiGLU 11008",
       hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, **_LLAMA)
preset("llama-13b", "llama", "Llama-2 13B: 40 x 5120, MHA 40 heads, SwiGLU 13824",
       hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, **_LLAMA)
preset("mistral-7b", "mistral", "Mistral 7B v0.1: 32 x 4096, GQA 32 query / 8 kv heads, SwiGLU 14336",
       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096)
preset("gpt2", "gpt2", "GPT-2 124M: 12 x 768, 12 heads, learned positions (<= 1024), dropout 0.1",
       n_embd=768, n_layer=12, n_head=12)
preset("gpt2-medium", "gpt2", "GPT-2 355M: 24 x 1024, 16 heads", n_embd=1024, n_layer=24, n_head=16)
preset("gpt2-xl", "gpt2", "GPT-2 1.5B: 48 x 1600, 25 heads", n_embd=1600, n_layer=48, n_head=25)
preset("bert-base", "bert", "BERT base (MLM): 12 x 768, 12 heads, <= 512 positions, dropout 0.1",
       hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
preset("bert-large", "bert", "BERT large (MLM): 24 x 1024, 16 heads",
       hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
# Tiny presets for CI: a few blocks, hidden <= 128, dropout on so that RNG replay in recompute is exercised.
preset("tiny-llama", "llama", "CI: 4 x 64, GQA 4/2 heads, attention dropout 0.1",
       hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
       vocab_size=512, max_position_embeddings=2048, attention_dropout=0.1, tie_word_embeddings=False)
preset("tiny-gpt2", "gpt2", "CI: 4 x 64, 4 heads, dropout 0.1 everywhere",
       n_embd=64, n_layer=4, n_head=4, vocab_size=512, n_positions=2048, bos_token_id=0, eos_token_id=0,
       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
preset("tiny-bert", "bert", "CI: 4 x 64, 4 heads, dropout 0.1 (MLM head)",
       hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=512,
       max_position_embeddings=2048)


def load_config(model: str) -> tuple[transformers.PretrainedConfig, str]:
    """The config of a preset name or of a local Hugging Face config.json; returns (config, family).

    A config.json is checked as a whole before it is used: the values transformers refuses, sizes that are not
    positive integers, heads that do not divide, and a model that cannot be built from it are each one
    GcbenchError naming the file, the field and the rule."""
    if model in MODELS:
        p = MODELS[model]
        return p.make_config(), p.family
    path = Path(model)
    try:
        if path.is_dir():
            path = path / "config.json"
        if not path.suffix == ".json":
            raise GcbenchError(f"unknown model {model!r}; presets: {', '.join(MODELS)} (or a path to a config.json)")
        if path.exists() and not path.is_file():
            raise OSError(f"{str(path)!r} is not a regular file")
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise GcbenchError(f"cannot read model config {str(path)[:200]!r}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bytes that are not UTF-8, nesting too deep
        raise GcbenchError(f"{str(path)!r} is not a JSON config: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise GcbenchError(f"{str(path)!r}: a config.json holds one JSON object, not a {type(data).__name__}")
    family = data.pop("model_type", None)
    if not isinstance(family, str) or family not in FAMILIES:
        raise GcbenchError(f"{str(path)!r}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
    cls = FAMILIES[family].config_cls
    sizes = {*_SIZES, *(cls.attribute_map[k] for k in _SIZES if k in cls.attribute_map)}  # gpt2: n_embd, ...
    for key, value in data.items():
        if key in sizes and value is not None and not _positive_int(value):
            raise GcbenchError(f"{path}: {key} must be a positive integer, got {value!r}")
    try:
        config = cls(**data)
    except Exception as e:  # noqa: BLE001 - transformers' refusal of the user's values, whatever its type
        raise GcbenchError(f"{path}: transformers refuses this config: {_validation_message(e)}") from None
    key = (str(path), json.dumps(data, sort_keys=True, default=str))
    if key not in _CHECKED:  # a sweep makes a RunSpec per config, each loading the config again
        _check_config(config, family, path)
        _CHECKED.add(key)
    return config, family


# Sizes every family's config has (through its attribute_map: gpt2's n_embd is hidden_size); None means "derived".
_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "vocab_size", "max_position_embeddings", "n_positions", "head_dim", "n_inner")


_CHECKED: set[tuple[str, str]] = set()  # (path, config text) already checked
MAX_LAYERS = 1_000  # blocks; the deepest published models have about 130


def _check_config(config: transformers.PretrainedConfig, family: str, path: Path) -> None:
    """The rules a config must obey to be built and trained."""
    for name in _SIZES:
        value = getattr(config, name, None)
        if value is not None and not _positive_int(value):
            raise GcbenchError(f"{path}: {name} must be a positive integer, got {value!r}")
    if config.num_hidden_layers > MAX_LAYERS:  # a meta build of millions of blocks would take the machine down
        raise GcbenchError(f"{path}: num_hidden_layers must be at most {MAX_LAYERS:,}, got {config.num_hidden_layers:,}")
    scaling = getattr(config, "rope_scaling", None) or {}
    factor = scaling.get("factor", 1.0) if isinstance(scaling, dict) else 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1e6:
        raise GcbenchError(f"{path}: rope_scaling's factor must be a number from 1 to 1e6, got {factor!r}")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv:
        raise GcbenchError(f"{path}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise GcbenchError(f"{path}: hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads "
                           f"({heads})")
    try:
        build_meta_model(config, family)  # no memory, no init: whatever else transformers refuses, say it now
    except Exception as e:  # noqa: BLE001
        raise GcbenchError(f"{path}: transformers cannot build a model from this config: {_one_line(e)}") from None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _validation_message(e: BaseException) -> str:
    """transformers' (huggingface_hub's strict dataclass) validation error as "field: rule" on one line."""
    text = _one_line(e)
    if m := re.fullmatch(r"Validation error for field '(\w+)': \w+: (.*)", text):
        return f"{m[1]}: {m[2]}"
    return re.sub(r"^Class validation error for validator '\w+': \w+: ", "", text)


def prepare_config(config: transformers.PretrainedConfig, family: str, *, layers: int | None, seq_len: int,
                   attn: str | None) -> transformers.PretrainedConfig:
    """Apply the run's shape to a config: truncate blocks, check positions, training-only settings."""
    n = config.num_hidden_layers
    if layers is not None:
        if not 1 <= layers <= n:
            raise GcbenchError(f"--layers {layers} is out of range: the model has {n} blocks")
        config.num_hidden_layers = layers
    max_pos = _max_positions(config)
    if seq_len > max_pos:
        if FAMILIES[family].learned_positions:
            raise GcbenchError(f"--seq {seq_len} exceeds the {max_pos} learned positions of this {family} model")
        raise GcbenchError(f"--seq {seq_len} exceeds the {max_pos} positions this {family} model is made for "
                           "(max_position_embeddings, with rope_scaling's factor); for longer sequences use a "
                           "config.json that allows them")
    config.use_cache = False
    if attn is not None:
        config._attn_implementation = attn
    return config


def _max_positions(config) -> int:
    """The longest sequence the model is made for: its learned position table, or (RoPE) max_position_embeddings
    times the factor of a linear or dynamic rope_scaling, which transformers does not fold into it."""
    positions = getattr(config, "n_positions", None) or config.max_position_embeddings
    scaling = getattr(config, "rope_scaling", None) or {}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("linear", "dynamic"):
        positions = int(positions * float(scaling.get("factor", 1.0)))
    return positions


def build_model(config, family: str, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Random-init the model directly on `device` in `dtype` (a 7B model is never materialised on the host)."""
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    with torch.device(device):
        model = FAMILIES[family].auto_model.from_config(config, dtype=dtype, attn_implementation=attn)
    model.train()
    return model


def build_meta_model(config, family: str) -> nn.Module:
    """The model on the meta device: shapes and parameter counts, no memory, no init time."""
    with torch.device("meta"):
        return FAMILIES[family].auto_model.from_config(config)


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer block list: the ModuleList holding `num_hidden_layers` modules of one class."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and len({type(m) for m in module}) == 1:
            return module
    raise GcbenchError(f"cannot find the {n} transformer blocks of {type(model).__name__}")


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(name: str) -> dict:
    """One row of `gcbench models`: name, family, params, layers, hidden, heads and kv heads, summary."""
    p = MODELS[name]
    config = p.make_config()
    heads = config.num_attention_heads
    return {
        "name": name,
        "family": p.family,
        "params": count_params(build_meta_model(config, p.family)),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,  # fewer than heads: GQA
        "max_seq": _max_positions(config),  # the longest --seq it takes
        "summary": p.summary,
    }
