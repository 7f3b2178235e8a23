"""`--adapter`: a frozen base with trainable low-rank adapters (LoRA, DoRA) through peft, or QLoRA (LoRA on a base
whose linear layers are 4-bit NF4 with double quantisation, bitsandbytes' Linear4bit: every one transformers would
quantise, whichever carry adapters; nf4.py).

Parsed once where a run is resolved (resolved.py); applied to the model right after it is built and before the
policy wraps its blocks (runner.py, paired.py, the simulation's fake model). Imports nothing heavy: the command line
reads it. See docs/levers.md, "Adapters".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError, quiet_logger
from gcbench.meta_init import materialise
from gcbench.nf4 import count_gemm_4bit_flops, nf4_bytes, quantise_base, quantised_linears
from gcbench.text import plain

if TYPE_CHECKING:
    import torch
    from torch import nn

NAMES = ("none", "lora", "dora", "qlora")
ALL_LINEAR = "all-linear"  # peft's own value: every linear layer but the output layer (LM head)
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")

@dataclass(frozen=True)
class Adapter:
    """One `--adapter` value: `none`, or `lora` | `dora` | `qlora` with its options."""

    name: str = "none"
    r: int = 16  # rank of each adapter: A is r x in, B is out x r
    alpha: float = 32.0  # the adapter's output is scaled by alpha / r
    dropout: float = 0.05  # on the adapter's input (peft's lora_dropout): kept as a mask/noise for backward
    targets: tuple[str, ...] = (ALL_LINEAR,)  # module names (peft's suffix match), or every linear but the head
    # qlora: module names kept out of the 4-bit base beside those transformers keeps there (the head, tied weights):
    # nf4.kept_in_compute_dtype, matched as transformers matches llm_int8_skip_modules
    skip: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.name != "none"

    @property
    def quantised(self) -> bool:
        return self.name == "qlora"

    def as_lora(self) -> Adapter:
        """LoRA with the same options (qlora's skip= aside): the adapters and FLOPs of this adapter's run."""
        return dataclasses.replace(self, name="lora", skip=())

    def __str__(self) -> str:
        """The value as the record keeps it: the name, and only the options that differ from their defaults."""
        default = Adapter()
        options = [f"r={self.r}" if self.r != default.r else "",
                   f"alpha={self.alpha:g}" if self.alpha != default.alpha else "",
                   f"dropout={self.dropout:g}" if self.dropout != default.dropout else "",
                   f"targets={'+'.join(self.targets)}" if self.targets != default.targets else "",
                   f"skip={'+'.join(self.skip)}" if self.skip else ""]
        options = [o for o in options if o]
        return f"{self.name}:{','.join(options)}" if options and self.active else self.name

    def build_device(self, device: str) -> str:
        """Where the run builds its base before apply_adapter. A qlora base: on the meta device, then each 4-bit
        layer made, initialised and quantised on `device` one at a time, and the rest materialised there and
        initialised by transformers, as transformers loads a 4-bit checkpoint (modeling_utils.py:
        _move_missing_keys_from_meta_to_device, then initialize_weights). So the unquantised base never takes GPU
        memory (as check_fits and the estimate count it) nor host time: built on the host, 8 blocks of llama-7b
        took 74-86 s a config on the H200 against 2.5-3.4 s for lora. Before transformers 5 (whose weight init
        does not restore non-persistent buffers) a base for CUDA is built on the host. Any other where it runs."""
        if not self.quantised:
            return device
        from transformers import PreTrainedModel

        if hasattr(PreTrainedModel, "named_non_persistent_buffers"):  # transformers 5: init restores buffers
            return "meta"
        return "cpu" if str(device).split(":")[0] == "cuda" else device

    def check_installed(self) -> None:
        """GcbenchError in one line when a package this adapter needs cannot be imported."""
        needs = [("peft", "peft")] if self.active else []
        if self.quantised:
            needs.append(("bitsandbytes", "bnb"))
        missing = [(module, extra) for module, extra in needs if importlib.util.find_spec(module) is None]
        if missing:  # every missing package at once: one install, not one refusal after another
            raise GcbenchError(f"--adapter {self.name} needs {' and '.join(m for m, _ in missing)}, which "
                               f"{'is' if len(missing) == 1 else 'are'} not installed: "
                               f"pip install 'gcbench[{','.join(e for _, e in missing)}]'"
                               + (" (to estimate too, on a machine without a GPU: the simulation runs bitsandbytes' "
                                  "own 4-bit layer on fake tensors)" if any(m == "bitsandbytes" for m, _ in missing)
                                  else ""))

    def lora_config(self, model: nn.Module | None = None) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, use_dora=self.name == "dora",
            target_modules=all_linear(model) if self.targets == (ALL_LINEAR,) else list(self.targets),
            # peft's default sets B = 0, so that the adapted model starts as the base; then A's gradient is zero
            # (it is B^T times the incoming gradient) and a test that gradients under every policy equal none's
            # would compare zeros for half the adapters. Both random (nn.Linear's own init) keeps every gradient
            # non-zero; memory, FLOPs and the saved tensors do not depend on the values.
            init_lora_weights=False)


def parse_adapter(text: str | None) -> Adapter:
    """`none` or `name[:r=16,alpha=32,dropout=0.05,targets=all-linear|a+b]` (qlora also `skip=a+b`); GcbenchError
    (one line) naming --adapter for an unknown name, option or value."""
    name, colon, rest = (text or "none").partition(":")
    name = name.strip()
    if name not in NAMES:
        raise GcbenchError(f"--adapter: unknown adapter {plain(name)!r} ({', '.join(NAMES)})")
    if name == "none":
        if rest.strip():
            raise GcbenchError("--adapter none takes no options")
        return Adapter()
    if colon and not rest.replace(",", "").strip():  # `lora:` or `lora:,`: options promised, none given
        raise GcbenchError(f"--adapter {name}: nothing after ':' (give key=value options, or {name} alone)")
    values: dict[str, Any] = {}
    for piece in (p.strip() for p in rest.split(",")) if colon else ():
        if not piece:
            raise GcbenchError(f"--adapter {name}: an empty option in {plain(rest)!r} (options are key=value, "
                               "separated by single commas)")
        key, eq, value = (s.strip() for s in piece.partition("="))
        if not eq or not value:
            raise GcbenchError(f"--adapter {name}: expected key=value, got {plain(piece)!r}")
        if key in values:
            raise GcbenchError(f"--adapter {name}: option {key!r} given twice")
        values[key] = _option(name, key, value)
    return Adapter(name, **values)


def _option(name: str, key: str, value: str) -> Any:
    shown = plain(value)
    try:
        if key == "r":
            r = int(value)
            if not 1 <= r <= 4096:
                raise ValueError
            return r
        if key == "alpha":
            alpha = float(value)
            if not (alpha > 0 and math.isfinite(alpha)):
                raise ValueError
            return alpha
        if key == "dropout":
            p = float(value)
            if not 0 <= p < 1:
                raise ValueError
            return p
    except ValueError:
        want = {"r": "an integer from 1 to 4096", "alpha": "a number above 0", "dropout": "a number in [0, 1)"}[key]
        raise GcbenchError(f"--adapter {name}: {key} must be {want}, got {shown!r}") from None
    if key in ("targets", "skip"):
        if key == "skip" and name != "qlora":
            raise GcbenchError(f"--adapter {name}: skip is qlora's (the linear layers kept out of its 4-bit base)")
        names = tuple(sorted({t.strip() for t in value.split("+")}))  # one spelling: q+v, v+q, q+q+v alike
        if (key == "skip" or names != (ALL_LINEAR,)) and not all(_MODULE_NAME.fullmatch(t) for t in names):
            raise GcbenchError(f"--adapter {name}: {key} must be {'all-linear or ' if key == 'targets' else ''}"
                               f"module names joined by '+' (q_proj+v_proj), got {shown!r}")
        return names
    raise GcbenchError(f"--adapter {name}: unknown option {plain(key)!r} (r, alpha, dropout, targets"
                       f"{', skip' if name == 'qlora' else ''})")


_UNMATCHED: dict[tuple, str | None] = {}  # (kind of model, targets, skip) -> what matches no linear layer


def check_targets(adapter: Adapter, config: Any, build_meta_model: Callable[[Any], nn.Module]) -> None:
    """GcbenchError (one line) when the adapter's named targets, or a name in qlora's skip, match no linear layer
    of the model: found on a meta build (`build_meta_model`: models.build_meta_model, which sits above this module),
    once per kind of model, targets and skip, so that the run is refused before anything runs."""
    if not adapter.active or (adapter.targets == (ALL_LINEAR,) and not adapter.skip):
        return
    # the head is part of the kind of model: a classifier's `score` is a linear layer an LM does not have
    key = (type(config).__name__, tuple(getattr(config, "architectures", None) or ()),
           getattr(config, "problem_type", None), adapter.targets, adapter.skip)
    if key not in _UNMATCHED:
        model = build_meta_model(config)
        if adapter.targets != (ALL_LINEAR,) and not targeted_linears(model, adapter):
            _UNMATCHED[key] = f"targets {plain('+'.join(adapter.targets))} name"
        else:  # a skipped name: a layer the base would quantise without it (transformers' match)
            linears = {full for full, *_ in quantised_linears(model)}
            missed = [s for s in adapter.skip if {f for f, *_ in quantised_linears(model, (s,))} == linears]
            _UNMATCHED[key] = f"skip {plain(missed[0])} names" if missed else None
    if _UNMATCHED[key]:
        raise GcbenchError(f"--adapter {adapter.name}: {_UNMATCHED[key]} no linear layer of this {config.model_type} "
                           f"model" + (" that its 4-bit base quantises" if _UNMATCHED[key].startswith("skip") else ""))


def all_linear(model: nn.Module | None) -> str | list[str]:
    """What `targets=all-linear` adapts: peft's all-linear (every linear layer but the output layer), held to the
    language model in a vision-language model (a module built from the config's text_config beside a vision_config:
    LLaVA's own LoRA recipe, find_all_linear_names, leaves the vision tower and the projector out, and peft's
    all-linear would take them too); there, the language model's linear layers by their full names."""
    from torch import nn

    config = getattr(model, "config", None)
    text, vision = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if model is None or text is None or vision is None:
        return ALL_LINEAR
    language = next((name for name, m in model.named_modules() if getattr(m, "config", None) is text), None)
    if language is None:  # an image classifier of a two-tower config (SigLIP): no language model in it
        return ALL_LINEAR
    part = model.get_submodule(language)
    return [f"{language}.{name}" for name, m in part.named_modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


def compute_dtype(spec: Any) -> torch.dtype:
    """The dtype the run's matmuls compute in: autocast's (amp), else the parameters' (a resolved run)."""
    return spec.autocast_dtype or spec.param_dtype


def targeted_linears(model: nn.Module, adapter: Adapter) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every layer the adapter targets, as peft chooses them: `all-linear` takes every
    linear layer (nn.Linear, transformers' Conv1D) but the output layer; names match a module's full name or its
    last dotted parts."""
    from torch import nn

    output = model.get_output_embeddings()
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not (isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D") or child is output:
                continue
            full = f"{parent_name}.{attr}" if parent_name else attr
            if adapter.targets == (ALL_LINEAR,) or any(full == t or full.endswith("." + t) for t in adapter.targets):
                found.append((parent, attr, child))
    return found


def apply_adapter(model: nn.Module, adapter: Adapter, compute_dtype: torch.dtype, device: str) -> nn.Module:
    """The model with the adapter applied in place (the same object; peft's wrapper is not kept: the step, the
    policies and the estimators see the model they always see): the base frozen, the adapters trainable. qlora
    first makes its base 4-bit (nf4.quantise_base: every linear layer transformers would quantise, NF4, double
    quantisation, `compute_dtype`), quantised on `device`; on a meta model its weights stay meta (quantise_fakes).
    Then peft puts the adapters on the `targets`, 4-bit or not."""
    if not adapter.active:
        return model
    adapter.check_installed()
    with quiet_logger("bitsandbytes"):  # peft imports it where installed: its CPU backend warns of optional kernels
        from peft import __version__ as peft_version, get_peft_model
    _refuse_converted_moe(model, peft_version)
    if adapter.quantised:
        count_gemm_4bit_flops()
        quantise_base(model, adapter.skip, compute_dtype, device)
        if str(device) != "meta":
            materialise(model, device)
        model.is_loaded_in_4bit = True  # what transformers sets on a 4-bit model: peft then wraps Linear4bit as such

    # peft warns about transformers' renamed attributes and about layers it cannot merge: nothing a run can act on
    with warnings.catch_warnings(), quiet_logger("peft"):
        warnings.simplefilter("ignore")
        try:
            wrapped = get_peft_model(model, adapter.lora_config(model))
        except ValueError as e:  # a target that names no module
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise GcbenchError(f"--adapter {adapter.name}: {plain(first)}") from None
    model = wrapped.base_model.model
    if adapter.build_device(device) == "cpu" != device:  # the rest of a host-built qlora model: norms, embeddings
        model.to(device)
    return model


# Models whose LoRA targets peft 0.22 and later convert as if written for transformers 4 (its
# utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING): the experts' projections and the router
# become the fused experts' parameters (lora.ParamWrapper, no dropout): another adapter than the one gcbench describes.
PEFT_CONVERTED_MOE = ("mixtral", "qwen2_moe")


def _refuse_converted_moe(model: nn.Module, version: str) -> None:
    """GcbenchError in one line where peft would remap this model's targets (pyproject.toml pins peft below 0.22):
    peft converts only on transformers 5 and later, whose MoE layers fuse the experts."""
    import transformers

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    major_minor = lambda text: tuple(int(x) for x in re.findall(r"\d+", text)[:2])  # noqa: E731
    if model_type in PEFT_CONVERTED_MOE and major_minor(version) >= (0, 22) and \
            major_minor(transformers.__version__) >= (5, 0):
        raise GcbenchError(f"--adapter on {model_type}: peft {plain(version)} moves LoRA onto the fused experts and "
                           "the router (ParamWrapper, no dropout), another adapter than gcbench's: "
                           "pip install 'peft<0.22'")


def frozen_bytes(module: nn.Module, elem: int) -> int:
    """Bytes of `module`'s frozen parameters (an adapter's base) on a meta model, nothing yet quantised: `elem`
    bytes per element, a 4-bit weight (qlora) at its NF4 bytes."""
    return sum(nf4_bytes(p.numel()) if type(p).__name__ == "Params4bit" else p.numel() * elem
               for p in module.parameters() if not p.requires_grad)


def adapter_params(model: nn.Module) -> list[torch.Tensor]:
    """The adapters' own weights (peft names them lora_A, lora_B, lora_magnitude_vector)."""
    return [p for name, p in model.named_parameters() if ".lora_" in name]


def param_count(model: nn.Module) -> int:
    """Parameters (each once), a 4-bit weight by the elements it stands for (its packed tensor holds two a byte)."""
    return sum(math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None else p.numel()
               for p in model.parameters())


def trainable_params(model: nn.Module) -> int:
    """Parameters that train (each once, tied ones too): peft's own count, PeftModel.get_nb_trainable_parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
