"""The 4-bit base of `--adapter qlora`: which linear layers it quantises (every one transformers' bitsandbytes
integration would, as a QLoRA run loads its base with BitsAndBytesConfig(load_in_4bit=True)), their bytes, and the
layers made, quantised and counted (bitsandbytes' Linear4bit, NF4 with double quantisation). adapters.py puts the
adapters on top. Imports nothing heavy: the command line reads adapters.py."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError, quiet_logger
from gcbench.meta_init import made_on

if TYPE_CHECKING:
    import torch
    from torch import nn

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


def kept_in_compute_dtype(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Module names a 4-bit base leaves unquantised: what transformers leaves (quantizers/base.py
    get_keys_to_not_convert: tied weights, the last parameter's module, the output embeddings, i.e. the LM head or
    a classifier's `score`; and the model's `_keep_in_fp32_modules`, as quantizer_bnb_4bit.py adds them), and
    `skip`, the adapter's own (added to transformers' defaults, where its `llm_int8_skip_modules` replaces them)."""
    try:  # transformers >= 5; before, the bitsandbytes integration held it
        from transformers.quantizers.base import get_keys_to_not_convert
    except ImportError:
        from transformers.integrations import get_keys_to_not_convert
    return sorted({*get_keys_to_not_convert(model), *(getattr(model, "_keep_in_fp32_modules", None) or ()), *skip})


def _converts(name: str, kept: list[str]) -> bool:
    """Whether transformers' replace_with_bnb_linear converts the module called `name`, `kept` left out."""
    try:  # transformers >= 5: a kept name matches from the start to a module boundary, or as a suffix
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:  # before: as replace_with_bnb_linear's loop matched
        return not any(key + "." in name or key == name for key in kept)
    return should_convert_module(name, kept)


def quantised_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(full name, parent, attribute, layer) of every layer a 4-bit base quantises, as transformers'
    replace_with_bnb_linear (integrations/bitsandbytes.py) chooses them: each module of type nn.Linear exactly (a
    subclass is not converted) or transformers' Conv1D whose name matches none of kept_in_compute_dtype's. Which
    layers carry adapters (`targets`) does not change it: the base is 4-bit whole."""
    from torch import nn

    kept = kept_in_compute_dtype(model, skip)
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            full = f"{parent_name}.{attr}" if parent_name else attr
            if (type(child) is nn.Linear or type(child).__name__ == "Conv1D") and _converts(full, kept):
                found.append((full, parent, attr, child))
    return found


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


def quantise_base(model: nn.Module, skip: tuple[str, ...], compute_dtype: torch.dtype, device: str) -> None:
    """Make every layer quantised_linears names a 4-bit Linear4bit (NF4, double quantisation, `compute_dtype`),
    quantised on `device` one at a time; on the meta device each stays a meta weight (quantise_fakes)."""
    with quiet_logger("bitsandbytes"):  # its CPU backend warns at import about optional kernels
        from bitsandbytes.nn import Linear4bit, Params4bit
    from torch import nn
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    layers = quantised_linears(model, skip)
    if not layers:
        raise GcbenchError(f"--adapter qlora: {type(model).__name__} has no linear layer left to quantise "
                           f"(kept in the compute dtype: {', '.join(kept_in_compute_dtype(model, skip))})")
    while layers:  # each original dropped as soon as its 4-bit layer is in place: one unquantised weight at a time
        name, parent, attr, linear = layers.pop(0)
        if not isinstance(linear, nn.Linear):
            raise GcbenchError(f"--adapter qlora quantises nn.Linear layers; {type(model).__name__}'s {name} is a "
                               f"{type(linear).__name__}: use lora, or name it in skip=")
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


