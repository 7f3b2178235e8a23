"""The training step gcbench measures: a model, its optimizer and one fixed random batch.

The runner (runner.py) times and measures it; the estimators (estimators/) simulate it on fake tensors; policies
wrap its model's blocks. It knows a RunSpec only by the few fields it reads (StepSpec), so it imports nothing of
gcbench and everything above can use it. Gradients are zeroed in place (set_to_none=False): they are static
memory like parameters and optimizer state, so everything above the step's starting baseline is activations and
temporaries.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per parameter


class StepSpec(Protocol):
    """What the step reads of a spec (spec.RunSpec has it all)."""

    batch_size: int
    seq_len: int
    seed: int
    device: str
    optimizer: str

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def autocast_dtype(self) -> torch.dtype | None: ...


class TrainingStep:
    """One training step on a fixed random batch, split in the two phases whose memory is reported apart."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: dict, spec: StepSpec):
        self.model, self.optimizer, self.batch = model, optimizer, batch
        self.device = torch.device(spec.device)
        dtype, device_type = spec.autocast_dtype, self.device.type
        self._autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else contextlib.nullcontext

    def forward(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=False)
        with self._autocast():
            return self.model(**self.batch).loss

    def forward_backward(self) -> None:
        self.forward().backward()

    def optimizer_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def __call__(self) -> None:
        self.forward_backward()
        self.optimizer_step()

    def static_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients and optimizer state: the step's starting baseline."""
        return self.params() + self.grads() + self.optimizer_state()

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters()] + [b for b in self.model.buffers()]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def make_optimizer(name: str, model: nn.Module, foreach: bool | None = None) -> torch.optim.Optimizer | None:
    """`foreach` None = torch's default (the multi-tensor path on CUDA: one parameter-sized temporary in the step);
    the memory estimator forces it on to simulate a CUDA step with CPU tensors."""
    params = list(model.parameters())
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=foreach)
    return None


def make_batch(spec: StepSpec, config, device: str) -> dict[str, torch.Tensor]:
    """Random token ids of the requested shape; labels = inputs (causal LM shifts them, MLM predicts them)."""
    gen = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(0, config.vocab_size, (spec.batch_size, spec.seq_len), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def model_state_bytes(spec: StepSpec, n_params: int) -> int:
    """Parameters + gradients + optimizer state, in bytes, before anything is allocated."""
    per_param = torch.tensor([], dtype=spec.param_dtype).element_size()
    return n_params * per_param * (2 + OPTIMIZER_STATES[spec.optimizer])
