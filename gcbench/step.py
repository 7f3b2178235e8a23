"""The training step gcbench measures: a model, its optimizer and one fixed random batch.

The runner (runner.py) times and measures it; the estimators (estimators/) simulate it on fake tensors; policies
wrap its model's blocks. It knows a RunSpec only by the few fields it reads (StepSpec), so it imports nothing of
gcbench above it and everything above can use it. Gradients are zeroed in place (set_to_none=False): they are
static memory like parameters and optimizer state, so everything above the step's starting baseline is activations
and temporaries. With the optimizer in backward there are no static gradients: each is stepped and dropped as soon
as it is complete. Under fp16 autocast (--precision amp-fp16) a gradient scaler scales each micro-batch's loss
before backward and unscales the gradients in place before the optimizer steps (torch.amp.GradScaler).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from gcbench.losses import loss_of, parse_loss
from gcbench.modality import batch_of, block_config, inputs_of
from gcbench.nf4 import quantisation_state
from gcbench.optimizers import optimizer_kind
from gcbench.fsdp import rank_and_world

Mark = Callable[[str], None]  # called with each phase (results.schema.PHASES) as it starts, then with "end"


def _no_mark(phase: str) -> None:
    pass


class StepSpec(Protocol):
    """What the step reads of a spec (spec.RunSpec has it all)."""

    batch_size: int
    seq_len: int
    target_len: int | None  # an encoder-decoder's targets per sample; None: its default (modality.target_tokens)
    seed: int
    device: str
    optimizer: str
    grad_accum: int
    optim_in_backward: bool
    loss: str  # --loss: ce | chunked[:n=N] | litgpt[:len=L] | fused-linear (losses.py)

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def autocast_dtype(self) -> torch.dtype | None: ...


class OptimizerInBackward:
    """The optimizer step fused into backward: one optimizer per parameter, stepped by a post-accumulate-grad hook
    as soon as that parameter's gradient is complete, which is then dropped, so that the full gradients never all
    exist at once (the PyTorch tutorial "How to save memory by fusing the optimizer step into the backward pass")."""

    def __init__(self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], params: list[nn.Parameter]):
        self.optimizers = {p: make([p]) for p in params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._step) for p in params]

    def _step(self, param: nn.Parameter) -> None:
        from gcbench.host_work import python_issuing

        optimizer = self.optimizers[param]
        with python_issuing("optimizer"):  # Python issues these ops inside the backward (the step-time model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass  # every parameter was stepped in backward

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class TrainingStep:
    """One training step on a fixed random batch: `grad_accum` forward/backward passes of one micro-batch each, then
    the optimizer step. Calling it with a `mark` tells the caller when each phase starts (per-phase peaks)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerInBackward | None, batch: dict,
                 spec: StepSpec):
        self.model, self.optimizer, self.batch = model, optimizer, batch
        self.device = torch.device(spec.device)
        dtype, device_type = spec.autocast_dtype, self.device.type
        self._autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = _grad_scaler(self.device) if dtype == torch.float16 else None
        # micro-batches: views of rows of the one batch (the same storage), so accumulating N of them computes the
        # gradient of the whole batch, as one batch of N x --batch would (mean-reduced loss); each input's rows cut
        # in N (a vision-language model's pixel values have --images rows a sample)
        n = spec.grad_accum
        self.micro_batches = [{k: v.tensor_split(n)[i] for k, v in batch.items()} for i in range(n)] \
            if n > 1 else [batch]
        self.loss = parse_loss(getattr(spec, "loss", "ce"))
        self.held: list = []

    def forward(self, micro_batch: dict | None = None) -> torch.Tensor:
        """The loss of one micro-batch (the first by default), its share of the step's mean: loss / grad_accum."""
        with self._autocast():
            batch = micro_batch or self.micro_batches[0]
            # ce: the model's own loss, as always; else losses.py on its body's hidden states
            self.held = []  # what the loss keeps until its backward is done (losses.loss_of)
            loss = self.model(**batch).loss if self.loss.own else loss_of(self.loss, self.model, batch, self.held)
        n = len(self.micro_batches)
        return loss / n if n > 1 else loss

    def forward_backward(self, mark: Mark = _no_mark) -> None:
        self.model.zero_grad(set_to_none=False)
        for micro_batch in self.micro_batches:
            mark("forward")
            loss = self.forward(micro_batch)
            mark("backward")
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            self.held = []

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            return
        if self.scaler is None:
            self.optimizer.step()
            return
        # unscales the gradients in place (all micro-batches' were scaled alike: the scale changes in update()),
        # then steps unless one is inf/NaN, then grows or backs off the scale
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def __call__(self, mark: Mark = _no_mark) -> None:
        self.forward_backward(mark)
        if self.steps_after_backward:
            mark("optimizer")
            self.optimizer_step()
        mark("end")

    @property
    def steps_after_backward(self) -> bool:
        """Whether the step has an optimizer phase (not with --optimizer none, nor with the optimizer in backward)."""
        return self.optimizer is not None and not isinstance(self.optimizer, OptimizerInBackward)

    def static_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradients, optimizer state and the gradient scaler's: the step's starting baseline."""
        return self.params() + self.grads() + self.optimizer_state() + self.scaler_state()

    def params(self) -> list[torch.Tensor]:
        """Parameters, buffers and a 4-bit base's quantisation state (--adapter qlora: neither of the others)."""
        return [p for p in self.model.parameters()] + [b for b in self.model.buffers()] \
            + quantisation_state(self.model)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def scaler_state(self) -> list[torch.Tensor]:
        """The gradient scaler's scale and growth tracker (0-dim fp32 and int32 on the step's device), or none."""
        return [] if self.scaler is None else [self.scaler._scale, self.scaler._growth_tracker]

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _grad_scaler(device: torch.device) -> torch.amp.GradScaler:
    """torch.amp.GradScaler on `device` (its defaults: initial scale 2**16, as transformers' Trainer with fp16=True
    uses), its scale and growth tracker made now (else lazily by the first scale()): static memory from the start,
    and a step made of state alone (estimators/shortcuts.prime) can unscale."""
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.zeros((), device=device))  # makes _scale and _growth_tracker; the product is dropped
    return scaler


def make_optimizer(spec: StepSpec, model: nn.Module, multi_tensor: bool | None = None
                   ) -> torch.optim.Optimizer | OptimizerInBackward | None:
    """The spec's optimizer over the model's parameters, or one per parameter stepped in backward
    (`optim_in_backward`). `multi_tensor` None = torch's default for the device (the multi-tensor path on CUDA: one
    parameter-sized temporary in the step); the memory estimator sets it to simulate a CUDA step with CPU tensors."""
    kind = optimizer_kind(spec.optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # a frozen base (--adapter): its adapters only
    if not kind.steps:
        return None
    if spec.optim_in_backward:
        return OptimizerInBackward(lambda group: kind.build(group, multi_tensor), params)
    return kind.build(params, multi_tensor)


def make_batch(spec: StepSpec, config, device: str) -> dict[str, torch.Tensor]:
    """Random inputs for the whole step (grad_accum x batch rows: token ids, or an image classifier's pixel values
    or a speech encoder's log-mel features from a standard normal) and their labels (batch_of). In a sharded run,
    this rank's rows of every rank's: together the ranks train on exactly the rows one process of world x batch rows
    would (the same seed draws them)."""
    gen = torch.Generator().manual_seed(spec.seed)
    rank, world = rank_and_world()
    rows = spec.batch_size * spec.grad_accum
    drawn = {name: torch.randint(0, block_config(config).vocab_size, shape, generator=gen) if dtype == torch.long else
             torch.randn(shape, generator=gen, dtype=dtype) for name, (shape, dtype) in inputs_of(spec, config,
                                                                                            rows * world).items()}
    if world > 1:  # its own storage: the other ranks' rows are not its memory
        drawn = {name: t[rank * rows:(rank + 1) * rows].clone() for name, t in drawn.items()}
    return batch_of({name: t.to(device) for name, t in drawn.items()}, config)


def param_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """The shapes of a (meta) model's distinct parameters: what the optimizer keeps state for."""
    return [tuple(p.shape) for p in model.parameters()]


def model_state_bytes(spec: StepSpec, shapes: list[tuple[int, ...]], cuda: bool = False, frozen_bytes: int = 0
                      ) -> int:
    """Parameters + gradients (none with the optimizer in backward) + optimizer state, in bytes, before anything is
    allocated. `shapes`: the trainable parameters'; `frozen_bytes`: the frozen ones' (an adapter's base), which have
    neither gradients nor state."""
    import math

    elem = torch.tensor([], dtype=spec.param_dtype).element_size()
    kind = optimizer_kind(spec.optimizer)
    params = sum(math.prod(s) for s in shapes) * elem
    grads = 0 if spec.optim_in_backward else params
    return params + grads + sum(sum(kind.state(s, elem, cuda)) for s in shapes) \
        + kind.shared_bytes(shapes, spec.optim_in_backward) + frozen_bytes
