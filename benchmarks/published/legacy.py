"""What a published row's older PyTorch and transformers kept for backward that today's do not, replayed inside
the simulation of a CUDA target.

A row measured with older libraries (rows.toml: `torch = "1.10"`, `transformers = "4.15"`) is predicted by today's
libraries running the step, so where what the step keeps has changed since, check.py replays the old behaviour
around the prediction. Each difference is one documented change, never a constant fitted to a row:

- torch < 1.11: softmax saved its input as well as its output. derivatives.yaml declared
  `_softmax: self: _softmax_backward_data(grad, result, dim, self)`, so the autograd node kept `self` (the
  scores: a batch x heads x seq x seq tensor per eager attention) although the kernel reads only the output
  (pytorch/pytorch#49600; the input became a dtype in 1.11, pytorch/pytorch#65242; transformers' pytorch_utils
  called `_softmax_backward_data(grad_output, output, parent.dim, self)` while `is_torch_less_than_1_11`).
  Replayed on the softmax the CUDA target routes (estimators/cuda_target.py, `torch._softmax`): the input it
  received is kept, in its own dtype.
- transformers 4.x (4.15's BertModel.forward and ModuleUtilsMixin.get_extended_attention_mask): without an
  attention_mask BERT made one of ones, turned it into an additive mask in the parameters' dtype
  (`(1.0 - mask) * -10000.0`, all zeros) and added it to every layer's scores. Under fp16 autocast the parameters
  are fp32, so the sum promoted the fp16 scores to fp32: the softmax input the first change keeps is fp32. Today's
  BERT (5.x: masks made by masking_utils) adds no mask when there is none. Which 4.x release stopped is not pinned
  down here: a row on any 4.x gets the mask. Replayed by handing BERT's eager attention that zero mask.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

SOFTMAX_KEEPS_INPUT_BEFORE = (1, 11)  # torch
BERT_ADDS_A_MASK_BEFORE = (5, 0)  # transformers (the module docstring)


@functools.cache
def _softmax_keeping_input(original: Any) -> Any:
    """softmax as torch < 1.11's autograd recorded it, input and output saved, computed by `original` (made on first
    use: reading the rows file imports no torch)."""
    import torch

    class SoftmaxKeepingInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
            out = original(x, dim, half_to_float)
            ctx.save_for_backward(x, out)
            ctx.dim = dim
            return out

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            x, out = ctx.saved_tensors
            return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype), None, None

    return lambda x, dim, half_to_float: SoftmaxKeepingInput.apply(x, dim, half_to_float)


def _with_bert_mask(original: Any) -> Any:
    """BERT's eager attention handed transformers 4.x's additive mask where none is given: zeros of shape
    (batch, 1, 1, keys) in the parameters' dtype."""
    import torch

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None:
            dtype = next(module.parameters()).dtype
            attention_mask = torch.zeros((query.shape[0], 1, 1, key.shape[-2]), dtype=dtype)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def parse_version(text: str) -> tuple[int, int]:
    """"1.10" -> (1, 10); ValueError on anything else."""
    major, minor = str(text).split(".")[:2]
    return int(major), int(minor)


@contextlib.contextmanager
def _replacing(owner: Any, name: str, make: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def replayed(torch_version: str | None = None, transformers_version: str | None = None) -> Iterator[None]:
    """Inside, the simulation keeps what those versions kept for backward (module docstring); None: today's."""
    old_torch = torch_version is not None and parse_version(torch_version) < SOFTMAX_KEEPS_INPUT_BEFORE
    old_bert = transformers_version is not None and parse_version(transformers_version) < BERT_ADDS_A_MASK_BEFORE
    if not (old_torch or old_bert):
        yield
        return
    import torch
    from transformers.models.bert import modeling_bert

    from gcbench.estimators import sharing

    # the simulations this process keeps for reuse (sharing.py) are today's libraries', and those made inside are not
    sharing.forget()
    with contextlib.ExitStack() as stack:
        if old_torch:
            stack.enter_context(_replacing(torch, "_softmax", _softmax_keeping_input))
        if old_bert:
            stack.enter_context(_replacing(modeling_bert, "eager_attention_forward", _with_bert_mask))
        try:
            yield
        finally:
            sharing.forget()
