"""`--adapter`: a frozen base with trainable low-rank adapters (LoRA, DoRA) through peft, or QLoRA (LoRA on a base
whose targeted linear layers are 4-bit NF4 with double quantisation, bitsandbytes' Linear4bit).

Parsed once where a run is resolved (resolved.py); applied to the model right after it is built and before the
policy wraps its blocks (runner.py, paired.py, the simulation's fake model). Imports nothing heavy: the command line
reads it. See docs/levers.md, "Adapters".
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError, quiet_logger
from gcbench.meta_init import made_on, materialise
from gcbench.text import plain

if TYPE_CHECKING:
    import torch
    from torch import nn

NAMES = ("none", "lora", "dora", "qlora")
ALL_LINEAR = "all-linear"  # peft's own value: every linear layer but the output layer (LM head)
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")

# The 4-bit base QLoRA uses (Dettmers et al. 2023), as bitsandbytes lays it out (functional.py quantize_4bit and
# quantize_blockwise; nn/modules.py Params4bit's defaults): per weight of n elements, two 4-bit values per byte; one
# absmax per block of 64 elements, itself quantised to uint8 (compress_statistics, double quantisation) in blocks of
# 256 with an fp32 absmax each, an fp32 offset (the mean subtracted first), the 16-entry fp32 NF4 code and a copy of
# the 256-entry fp32 dynamic map (`code.to(A.device, copy=True)`) per weight.
NF4_BLOCK, NESTED_BLOCK, NF4_CODE_BYTES, NESTED_CODE_BYTES = 64, 256, 16 * 4, 256 * 4


def nf4_bytes(n: int) -> int:
    """Bytes bitsandbytes keeps for one NF4 weight of `n` elements with double quantisation (see above)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + NF4_CODE_BYTES + NESTED_CODE_BYTES


# bitsandbytes' CUDA kernel for a 4-bit matmul (backends/cuda/ops.py, the "bitsandbytes::gemm_4bit" kernel) runs
# its fused kernel for at most this many rows (_gemm_4bit_custom_max_m); past it, _dequant_linear_fallback
# dequantises the whole weight first. Below it, bitsandbytes chooses per GPU architecture
# (_gemm_4bit_use_custom_cuda): the prediction assumes the fused kernel there.
GEMM_4BIT_FUSED_MAX_ROWS = 1536


def gemm_4bit_workspace_bytes(block_bytes: int, a: torch.Tensor, b: torch.Tensor, shape_b: list[int],
                              absmax: torch.Tensor, blocksize: int, *rest: Any,
                              absmax_8bit: torch.Tensor | None = None, **kwargs: Any) -> int:
    """What the CUDA kernel of one 4-bit matmul (`bitsandbytes::gemm_4bit`, arguments as its schema names them)
    allocates inside the op, where no dispatch mode sees it, at its fullest: none in the fused kernel; in
    _dequant_linear_fallback the dequantised absmax (fp32, one per block), its sum with the offset (fp32) and the
    weight dequantised to A's dtype, all alive through the F.linear; each rounded up to `block_bytes`."""
    from gcbench.units import round_up

    if a.numel() // a.shape[-1] <= GEMM_4BIT_FUSED_MAX_ROWS:
        return 0
    if absmax_8bit is None and len(rest) > 2:  # (bias, absmax_8bit, ...) given by position
        absmax_8bit = rest[1]
    n = math.prod(shape_b)
    absmax_bytes = 2 * round_up(math.ceil(n / blocksize) * 4, block_bytes) if absmax_8bit is not None else 0
    return absmax_bytes + round_up(n * a.element_size(), block_bytes)


@dataclass(frozen=True)
class Adapter:
    """One `--adapter` value: `none`, or `lora` | `dora` | `qlora` with its options."""

    name: str = "none"
    r: int = 16  # rank of each adapter: A is r x in, B is out x r
    alpha: float = 32.0  # the adapter's output is scaled by alpha / r
    dropout: float = 0.05  # on the adapter's input (peft's lora_dropout): kept as a mask/noise for backward
    targets: tuple[str, ...] = (ALL_LINEAR,)  # module names (peft's suffix match), or every linear but the head

    @property
    def active(self) -> bool:
        return self.name != "none"

    @property
    def quantised(self) -> bool:
        return self.name == "qlora"

    def __str__(self) -> str:
        """The value as the record keeps it: the name, and only the options that differ from their defaults."""
        default = Adapter()
        options = [f"r={self.r}" if self.r != default.r else "",
                   f"alpha={self.alpha:g}" if self.alpha != default.alpha else "",
                   f"dropout={self.dropout:g}" if self.dropout != default.dropout else "",
                   f"targets={'+'.join(self.targets)}" if self.targets != default.targets else ""]
        options = [o for o in options if o]
        return f"{self.name}:{','.join(options)}" if options and self.active else self.name

    def build_device(self, device: str) -> str:
        """Where the run builds its base before apply_adapter. A qlora base: on the meta device, then each targeted
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
                               f"pip install 'gcbench[{','.join(e for _, e in missing)}]'")

    def lora_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, use_dora=self.name == "dora",
            target_modules=ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets),
            # peft's default sets B = 0, so that the adapted model starts as the base; then A's gradient is zero
            # (it is B^T times the incoming gradient) and a test that gradients under every policy equal none's
            # would compare zeros for half the adapters. Both random (nn.Linear's own init) keeps every gradient
            # non-zero; memory, FLOPs and the saved tensors do not depend on the values.
            init_lora_weights=False)


def parse_adapter(text: str | None) -> Adapter:
    """`none` or `name[:r=16,alpha=32,dropout=0.05,targets=all-linear|a+b]`; GcbenchError (one line) naming
    --adapter for an unknown name, option or value."""
    name, _, rest = (text or "none").partition(":")
    name = name.strip()
    if name not in NAMES:
        raise GcbenchError(f"--adapter: unknown adapter {plain(name)!r} ({', '.join(NAMES)})")
    if name == "none":
        if rest.strip():
            raise GcbenchError("--adapter none takes no options")
        return Adapter()
    values: dict[str, Any] = {}
    for piece in (p.strip() for p in rest.split(",") if p.strip()):
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
    if key == "targets":
        targets = tuple(sorted({t.strip() for t in value.split("+")}))  # one spelling: q+v, v+q, q+q+v alike
        if targets != (ALL_LINEAR,) and not all(_MODULE_NAME.fullmatch(t) for t in targets):
            raise GcbenchError(f"--adapter {name}: targets must be all-linear or module names joined by '+' "
                               f"(q_proj+v_proj), got {shown!r}")
        return targets
    raise GcbenchError(f"--adapter {name}: unknown option {plain(key)!r} (r, alpha, dropout, targets)")


_TARGETS_FOUND: dict[tuple, bool] = {}  # (config class, architectures, targets) -> whether any layer matches


def check_targets(adapter: Adapter, config: Any, build_meta_model: Callable[[Any], nn.Module]) -> None:
    """GcbenchError (one line) when the adapter's named targets match no linear layer of the model: found on a meta
    build (`build_meta_model`: models.build_meta_model, which sits above this module), once per kind of model and
    targets, so that the run is refused before anything runs."""
    if not adapter.active or adapter.targets == (ALL_LINEAR,):
        return
    # the head is part of the kind of model: a classifier's `score` is a linear layer an LM does not have
    key = (type(config).__name__, tuple(getattr(config, "architectures", None) or ()),
           getattr(config, "problem_type", None), adapter.targets)
    if key not in _TARGETS_FOUND:
        _TARGETS_FOUND[key] = bool(targeted_linears(build_meta_model(config), adapter))
    if not _TARGETS_FOUND[key]:
        raise GcbenchError(f"--adapter {adapter.name}: targets {plain('+'.join(adapter.targets))} name no linear "
                           f"layer of this {config.model_type} model")


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
    first makes each targeted nn.Linear a 4-bit Linear4bit (NF4, double quantisation, `compute_dtype`), quantised
    on `device`. On a meta model only lora and dora apply (a meta weight cannot be quantised)."""
    if not adapter.active:
        return model
    adapter.check_installed()
    with quiet_logger("bitsandbytes"):  # peft imports it where installed: its CPU backend warns of optional kernels
        from peft import get_peft_model
    if adapter.quantised:
        count_gemm_4bit_flops()
        _quantise_targets(model, adapter, compute_dtype, device)
        if str(device) != "meta":
            materialise(model, device)
        model.is_loaded_in_4bit = True  # what transformers sets on a 4-bit model: peft then wraps Linear4bit as such

    # peft warns about transformers' renamed attributes and about layers it cannot merge: nothing a run can act on
    with warnings.catch_warnings(), quiet_logger("peft"):
        warnings.simplefilter("ignore")
        try:
            wrapped = get_peft_model(model, adapter.lora_config())
        except ValueError as e:  # a target that names no module
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise GcbenchError(f"--adapter {adapter.name}: {plain(first)}") from None
    model = wrapped.base_model.model
    if adapter.build_device(device) == "cpu" != device:  # the rest of a host-built qlora model: norms, embeddings
        model.to(device)
    return model


_GEMM_4BIT_COUNTED = False


def count_gemm_4bit_flops() -> None:
    """Teach torch's FLOP counter (torch/utils/flop_counter.py: flop_registry, read by FlopCounterMode and by
    estimators/shortcuts.FlopTally) the forward matmul of a 4-bit layer: bitsandbytes' `gemm_4bit` op is one custom
    op the counter cannot see into, so a qlora step counted only the backward's matmuls (aten.mm on the dequantised
    weight). 2 x rows x out x in FLOPs, as aten.mm's formula counts the same product; once per process."""
    global _GEMM_4BIT_COUNTED
    if _GEMM_4BIT_COUNTED:
        return
    import torch
    from torch.utils.flop_counter import register_flop_formula

    with quiet_logger("bitsandbytes"):
        import bitsandbytes  # noqa: F401 - defines torch.ops.bitsandbytes

    @register_flop_formula(torch.ops.bitsandbytes.gemm_4bit)
    def gemm_4bit_flops(a_shape, b_shape, shape_b, *args, **kwargs) -> int:
        return 2 * math.prod(a_shape[:-1]) * shape_b[0] * shape_b[1]

    _GEMM_4BIT_COUNTED = True


def _quantise_targets(model: nn.Module, adapter: Adapter, compute_dtype: torch.dtype, device: str) -> None:
    with quiet_logger("bitsandbytes"):  # its CPU backend warns at import about optional kernels
        from bitsandbytes.nn import Linear4bit, Params4bit
    from torch import nn
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    targets = targeted_linears(model, adapter)
    if not targets:
        raise GcbenchError(f"--adapter qlora: no linear layer of {type(model).__name__} matches targets "
                           f"{'+'.join(adapter.targets)}")
    while targets:  # each original dropped as soon as its 4-bit layer is in place: one unquantised weight at a time
        parent, attr, linear = targets.pop(0)
        if not isinstance(linear, nn.Linear):
            raise GcbenchError(f"--adapter qlora quantises nn.Linear layers; {type(model).__name__}'s {attr} is a "
                               f"{type(linear).__name__}: use lora")
        with unset_fake_temporarily():  # a meta Params4bit made inside a fake mode would be a fake (see below)
            layer = Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                               compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                               device="meta")
        if linear.weight.is_meta and str(device) != "meta":  # a meta-built base (build_device): made here
            linear = made_on(model, linear, device)
        # quantised from the compute dtype (as a checkpoint loaded in bnb_4bit_compute_dtype is), so that the
        # dequantised weight is made in the dtype the matmul uses
        weight = linear.weight.data.to(compute_dtype)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        layer.weight = Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                  module=layer)
        # .to quantises it there (Params4bit._quantize); on the meta device it stays a meta weight: quantise_fakes
        setattr(parent, attr, layer.to(device))
        del linear, weight, layer


def quantise_fakes(model: nn.Module) -> None:
    """Quantise the 4-bit layers of a model whose meta weights materialise_as_fakes made fakes (the simulation's
    qlora: apply_adapter on the meta model, then fakes, then this, inside the fake mode)."""
    for module in model.modules():
        weight = module._parameters.get("weight")  # bitsandbytes' layer, not peft's wrapper of the same name
        if type(module).__name__ == "Linear4bit" and weight is not None and is_fake(weight) \
                and getattr(weight, "quant_state", None) is None:
            module.weight = _fake_params4bit(weight, module)


def _fake_params4bit(weight: torch.Tensor, layer: nn.Module) -> nn.Parameter:
    """What Params4bit._quantize makes of `weight`, for a fake tensor: a fake cannot become a Params4bit (a tensor
    subclass of its own), so the packed weight is a plain fake parameter carrying the attributes Linear4bit and peft
    read, and its QuantState is bitsandbytes' own, made by quantize_4bit, whose ops have fake implementations
    (bitsandbytes/_ops.py)."""
    from bitsandbytes import functional as F
    from torch import nn
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the 8-bit map is cached for every later call:
        if "dynamic" not in F.name2qmap:  # made from real values, never as a fake
            F.name2qmap["dynamic"] = F.create_dynamic_map()
    packed, state = F.quantize_4bit(weight, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4")
    param = nn.Parameter(packed, requires_grad=False)
    for key, value in dict(quant_state=state, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4",
                           quant_storage=packed.dtype, bnb_quantized=True, module=layer).items():
        setattr(param, key, value)
    layer.quant_state = state
    return param


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


def frozen_bytes(module: nn.Module, elem: int) -> int:
    """Bytes of `module`'s frozen parameters (an adapter's base) on a meta model, nothing yet quantised: `elem`
    bytes per element, a 4-bit weight (qlora) at its NF4 bytes."""
    return sum(nf4_bytes(p.numel()) if type(p).__name__ == "Params4bit" else p.numel() * elem
               for p in module.parameters() if not p.requires_grad)


def quantisation_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of each 4-bit weight's quantisation state (absmax, code, offset and the nested ones): device
    memory that is neither a parameter nor a buffer."""
    out = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [t for t in (state.absmax, state.code, state.offset) if t is not None]
            state = state.state2
    return out


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
