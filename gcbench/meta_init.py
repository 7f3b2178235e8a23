"""A model built on the meta device made real on a device one piece at a time, as transformers loads a checkpoint
(modeling_utils.py: a meta model, then _move_missing_keys_from_meta_to_device and initialize_weights): what
adapters.py does with a qlora base, so that the unquantised base never exists whole. Imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def made_on(model: nn.Module, linear: nn.Module, device: str) -> nn.Module:
    """The meta nn.Linear `linear` made on `device` in its dtype, initialised as the model initialises a linear
    layer (transformers' _init_weights: normal with the config's initializer_range, zero bias)."""
    import torch
    from torch import nn

    made = torch.nn.utils.skip_init(nn.Linear, linear.in_features, linear.out_features,
                                    bias=linear.bias is not None, device=device, dtype=linear.weight.dtype)
    model._init_weights(made)
    return made


def materialise(model: nn.Module, device: str) -> None:
    """Every parameter and buffer still on the meta device made on `device` (one tensor per shared one, so tied
    weights stay tied) and initialised by transformers' initialize_weights, which skips what is flagged
    `_is_hf_initialized`: the 4-bit layers made already. Non-persistent buffers (rotary frequencies, position ids)
    are restored by it as when transformers loads a checkpoint on the meta device."""
    import torch
    from torch import nn

    made: dict[int, torch.Tensor] = {}
    flagged: dict[int, Any] = {}  # by identity: a tied tensor appears twice
    for module in model.modules():
        fresh = False
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None:
                    continue
                if not tensor.is_meta:
                    flagged[id(tensor)] = tensor
                    continue
                if id(tensor) not in made:
                    real = torch.empty_like(tensor, device=device)
                    made[id(tensor)] = nn.Parameter(real, requires_grad=tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else real
                store[name] = made[id(tensor)]
                fresh = True
        if not fresh:
            flagged[id(module)] = module
    if not made:
        return
    for item in flagged.values():
        item._is_hf_initialized = True
    try:
        model.initialize_weights()
    finally:
        for item in flagged.values():
            del item._is_hf_initialized
