"""Predict a training step's peak memory without running it: an analytic model and a fake-tensor simulation.

Both predict the number a measured run reports for the same RunSpec: on a CUDA target `max_memory_allocated` over
the whole step (`peak_allocated_bytes`), on a CPU target the live-tensor peak (`peak_tracked_bytes`).

- `simulate` runs the worker's real TrainingStep (the policy applied, warm-up step, forward, backward, optimizer
  step) on fake tensors: every op computes shapes only, the LiveTensorTracker counts what would be allocated. The
  fakes are CPU tensors even for a CUDA target, because a CPU-only torch build cannot run fake CUDA tensors
  through autograd; what CUDA does differently is put back: the attention kernel CUDA would pick, its backward
  workspace, the multi-tensor optimizer path and the allocator's 512-byte blocks. See docs/methodology.md,
  "Predicting memory".
- `analytic` adds up per-block formulas (Korthikanti et al. 2022, per-layer bytes sbh(34 + 5as/h), rewritten for
  the attention kernel, GQA, the MLP shape and the dtype) along the policy's block groups. Instant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gcbench.errors import GcbenchError
from gcbench.measure import LiveTensorTracker, round_up, storage_bytes
from gcbench.models import build_model, find_blocks
from gcbench.policies import Policy
from gcbench.spec import RunSpec
from gcbench.step import OPTIMIZER_STATES, TrainingStep, make_optimizer

METHODS = ("analytic", "simulate")
TARGETS = ("cuda", "cpu")  # what is predicted: max_memory_allocated on a CUDA GPU | peak_tracked_bytes on CPU
CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


@dataclass(frozen=True)
class Estimate:
    """One prediction: the step's peak and what it is made of, in bytes."""

    method: str  # analytic | simulate
    target: str  # cuda (max_memory_allocated) | cpu (peak_tracked_bytes)
    peak_bytes: int  # whole step: forward, backward and optimizer step
    param_bytes: int  # parameters and buffers
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # the rest at the peak: saved activations, temporaries, recompute, the batch
    peak_phase: str  # "forward/backward" | "optimizer step": where the peak is reached
    attention_kernel: str  # the SDPA kernel the prediction assumes (flash, efficient, math, cpu-flash, eager)
    seconds: float  # how long the prediction took

    def fits(self, memory_bytes: int) -> bool:
        return self.peak_bytes <= memory_bytes

    def as_record(self, spec: RunSpec) -> dict[str, Any]:
        """Flat, JSON-ready: the spec's shape fields, then the prediction."""
        return {
            "model": spec.model,
            "seq_len": spec.seq_len,
            "batch_size": spec.batch_size,
            "policy": str(spec.policy),
            "layers": spec.layers,
            "precision": spec.precision,
            "optimizer": spec.optimizer,
            **dataclasses.asdict(self),
        }


def estimate(spec: RunSpec, method: str = "simulate", target: str = "cuda") -> Estimate:
    """Predict the peak memory of one training step of `spec` on `target` (cuda | cpu) by `method`."""
    if method not in METHODS:
        raise GcbenchError(f"unknown estimate method {method!r} ({', '.join(METHODS)})")
    if target not in TARGETS:
        raise GcbenchError(f"unknown estimate target {target!r} ({', '.join(TARGETS)})")
    return simulate(spec, target) if method == "simulate" else analytic(spec, target)


def estimate_grid(models: Iterable[str], seq_lens: Iterable[int], batch_sizes: Iterable[int],
                  policies: Iterable[str], methods: Iterable[str], target: str = "cuda", precision: str = "",
                  **spec_fields: Any) -> list[tuple[RunSpec, Estimate]]:
    """Every model x seq x batch x policy, by every method. All specs are validated (and every policy checked
    against the analytic model) before anything runs, so bad input fails at once and nothing is half done.
    precision "" = bf16 for a CUDA target, fp32 for CPU, as `gcbench run` picks; spec_fields: layers, optimizer,
    attn."""
    methods = list(methods)
    for method in methods:
        if method not in METHODS:
            raise GcbenchError(f"unknown estimate method {method!r} ({', '.join(METHODS)})")
    if target not in TARGETS:
        raise GcbenchError(f"unknown device {target!r} to predict for ({', '.join(TARGETS)})")
    precision = precision or ("bf16" if target == "cuda" else "fp32")
    # device="cpu": the spec must be valid on this machine; the target only tells what to predict
    specs = [RunSpec(model=m, seq_len=s, batch_size=b, policy=p, device="cpu", precision=precision, **spec_fields)
             for m in models for s in seq_lens for b in batch_sizes for p in policies]
    if "analytic" in methods:
        for spec in specs:
            _check_understood(spec.policy)
    return [(spec, estimate(spec, method, target)) for spec in specs for method in methods]


def predict_for_run(spec: RunSpec) -> dict[str, Any]:
    """The predictions a run's record carries, made before anything is allocated (an OOM record has them too):
    `predicted_peak_bytes` by the best method that can predict this policy (`prediction_method`; the simulation,
    exact on CPU, first; None when neither can), and each method's own prediction
    (`predicted_peak_bytes_simulate`, `predicted_peak_bytes_analytic`; None where it cannot), so that a GPU
    sweep shows both methods' errors. The analytic model is instant; the simulation takes about a second for tiny
    models and seconds for 7B ones."""
    target = "cuda" if spec.device.startswith("cuda") else "cpu"
    out: dict[str, Any] = {"predicted_peak_bytes": None, "prediction_method": None}
    for method in METHODS[::-1]:
        try:
            peak = estimate(spec, method, target).peak_bytes
        except GcbenchError:
            peak = None
        out[f"predicted_peak_bytes_{method}"] = peak
        if out["predicted_peak_bytes"] is None and peak is not None:
            out["predicted_peak_bytes"], out["prediction_method"] = peak, method
    return out


# ---------------------------------------------------------------------------------------------------------------------
# simulate


def simulate(spec: RunSpec, target: str = "cuda") -> Estimate:
    """Run one warm-up step and one tracked step of `spec` on fake tensors; nothing is allocated for real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    # The fakes are CPU tensors whatever the target (autocast, too, must act on CPU tensors); see module docstring.
    spec = dataclasses.replace(spec, device="cpu", memory_cap_bytes=None)
    cuda = target == "cuda"
    config, family = spec.model_config()
    fake = FakeTensorMode()
    model = build_model(config, family, "meta", spec.param_dtype)
    materialise_as_fakes(model, fake)
    spec.policy.apply(find_blocks(model))
    _refuse_compiled(model, spec.policy)
    tracker = AllocatorModel(cuda)
    try:
        with fake, _unpacked_batch(), (cuda_kernels() if cuda else contextlib.nullcontext()):
            ids = torch.empty((spec.batch_size, spec.seq_len), dtype=torch.long)
            optimizer = make_optimizer(spec.optimizer, model, foreach=True if cuda else None)
            step = TrainingStep(model, optimizer, {"input_ids": ids, "labels": ids}, spec)
            spec.policy.prepare(step)
            step()  # warm-up: gradients and optimizer state exist from here on, as in the measured steps
            tracker.track(step.static_tensors() + [ids])
            with tracker:
                step.forward_backward()
                fwd_bwd_peak = tracker.peak
                step.optimizer_step()
            parts = [storage_bytes(tensors, tracker.granularity_bytes)
                     for tensors in (step.params(), step.grads(), step.optimizer_state())]
    except GcbenchError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a policy on fake tensors is the user's answer
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise GcbenchError(f"simulate cannot run {spec.model} with policy {spec.policy} on fake tensors: "
                           f"{first_line}") from None
    return Estimate(
        method="simulate", target=target, peak_bytes=tracker.peak, param_bytes=parts[0], grad_bytes=parts[1],
        optimizer_bytes=parts[2], activation_bytes=tracker.peak - sum(parts),
        peak_phase="optimizer step" if tracker.peak > fwd_bwd_peak else "forward/backward",
        attention_kernel=attention_kernel(spec, config, target), seconds=time.perf_counter() - start)


def _refuse_compiled(model: nn.Module, policy: Policy) -> None:
    # torch.compile on fake tensors crashes the whole process (segmentation fault, torch 2.13 CPU): refuse instead
    from torch._dynamo.eval_frame import OptimizedModule

    if any(isinstance(m, OptimizedModule) for m in model.modules()):
        raise GcbenchError(f"simulate cannot run policy {policy}: it compiles blocks with torch.compile, which does "
                           "not run on fake tensors")


def materialise_as_fakes(model: nn.Module, fake) -> None:
    """Replace every meta parameter and buffer by a CPU fake tensor of the same shape, dtype and strides.

    Tied weights stay tied (one fake per original tensor). Values are never read: a fake has none."""
    fakes: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with fake:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fakes[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        return fakes[id(t)]

    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    slots[name] = fake_of(t)


@contextlib.contextmanager
def _unpacked_batch() -> Iterator[None]:
    """Tell transformers' mask code that the batch holds one sequence per row, as the real run finds out.

    transformers reads position ids to detect packed sequences, but refuses to read a fake tensor and then builds a
    full 4-D mask — a different (and larger) step than the real one, which runs `is_causal` without a mask.
    gcbench batches are never packed, so the answer the real run computes is known."""
    import transformers.masking_utils as masking

    if not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


class AllocatorModel(LiveTensorTracker):
    """The live-tensor tracker, counting as the target device would: on CUDA, 512-byte blocks plus the workspace
    a kernel allocates internally (invisible to a dispatch mode, but part of max_memory_allocated)."""

    def __init__(self, cuda: bool):
        super().__init__(granularity_bytes=CUDA_BLOCK_BYTES if cuda else 1)
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.cuda and func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            self.peak = max(self.peak, self.current + flash_backward_workspace_bytes(args[1], args[2]))
        return out


def flash_backward_workspace_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """Scratch of FlashAttention-2's backward (flash_api.cpp, mha_bwd): softmax_d and the fp32 dq accumulator,
    plus dk/dv at full head count when K/V have fewer heads (GQA). query/key: (batch, heads, seq, head_dim)."""
    b, h, s, d = query.shape
    s_rounded, d_rounded = round_up(s, 128), round_up(d, 32 if d <= 128 else 64)
    block = lambda n: -(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES  # noqa: E731
    total = block(b * h * s_rounded * 4) + block(b * s_rounded * h * d_rounded * 4)
    if key.shape[1] != h:
        total += 2 * block(b * key.shape[2] * h * d * key.element_size())
    return total


# --- the attention kernel: which one, and what CUDA would run


def cuda_kernel(dtype: torch.dtype, has_mask: bool, head_dim: int) -> str:
    """The SDPA kernel torch picks on an sm80+ GPU (sdp_utils.cpp, select_sdp_backend), as far as memory goes.

    cuDNN attention (preferred on some Hopper builds) keeps the same tensors for backward as flash: output and a
    float32 log-sum-exp per row. Flash needs 16-bit inputs and no mask; memory-efficient takes masks and fp32."""
    low_precision = dtype in (torch.float16, torch.bfloat16)
    if low_precision and not has_mask and head_dim <= 256:
        return "flash"
    if head_dim % (8 if low_precision else 4) == 0:
        return "efficient"
    return "math"


def cpu_kernel(dropout: float) -> str:
    """CPU SDPA: the CPU flash kernel, except with dropout (sdp_utils_cpp.cpp, check_for_dropout): then the math
    path, which keeps the seq x seq probabilities."""
    return "math" if dropout > 0 else "cpu-flash"


def attention_kernel(spec: RunSpec, config, target: str) -> str:
    """The kernel the step's attention runs on `target` (the model's own attention when it is eager)."""
    if (getattr(config, "_attn_implementation", None) or "sdpa") == "eager":
        return "eager"
    shape = Shape.of(spec, config)
    if target == "cpu":
        return cpu_kernel(shape.attn_dropout)
    return cuda_kernel(shape.act_dtype, shape.has_mask, shape.head_dim)


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Route attention and dropout to the aten kernels CUDA would run, on CPU fake tensors.

    CPU and CUDA keep different tensors for backward. SDPA: CPU falls back to the math path (seq x seq
    probabilities kept) whenever dropout is on, CUDA flash never keeps them; the CUDA kernels' meta functions give
    their exact outputs and saved tensors without a GPU. Autocast lists SDPA as a lower-precision op on CUDA, so
    under amp its inputs are cast first (calling the kernel directly would skip that). Dropout: CPU keeps a noise
    tensor of the input's dtype, CUDA's fused kernel a bool mask."""
    import torch.nn.functional as F

    original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        kernel = cuda_kernel(query.dtype, attn_mask is not None, query.shape[-1])
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "efficient":
            if key.shape[1] != query.shape[1]:  # the kernel wants equal head counts: repeat K/V as math does
                repeat = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # CUDA turns a bool mask into an additive one
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(bias.logical_not(), -math.inf)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0 or inplace:
            return original_dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    F.scaled_dot_product_attention, F.dropout = sdpa, dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


# ---------------------------------------------------------------------------------------------------------------------
# analytic


@dataclass(frozen=True)
class Shape:
    """What the formulas need: sizes from the model config, byte widths from the precision. T = batch x seq."""

    family: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    stream_bytes: int  # residual stream, parameters and gradients: 4 (fp32, amp-bf16) | 2 (bf16)
    act_bytes: int  # matmul outputs: the stream's width, 2 under amp-bf16
    amp: bool
    attn_dropout: float
    hidden_dropout: float  # GPT-2 resid/embd, BERT hidden dropout; Llama has none
    has_mask: bool  # transformers passes an explicit mask (a sliding window is reached) instead of is_causal
    attn_impl: str

    @classmethod
    def of(cls, spec: RunSpec, config) -> Shape:
        heads = config.num_attention_heads
        stream = torch.tensor([], dtype=spec.param_dtype).element_size()
        window = getattr(config, "sliding_window", None)
        return cls(
            family=type(config).model_type,
            batch=spec.batch_size,
            seq=spec.seq_len,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
            or 4 * config.hidden_size,
            vocab=config.vocab_size,
            stream_bytes=stream,
            act_bytes=2 if spec.autocast_dtype is not None else stream,
            amp=spec.autocast_dtype is not None,
            attn_dropout=float(getattr(config, "attention_dropout", None) or getattr(config, "attn_pdrop", None)
                               or getattr(config, "attention_probs_dropout_prob", 0.0) or 0.0),
            hidden_dropout=float(getattr(config, "resid_pdrop", None) or getattr(config, "hidden_dropout_prob", 0.0)
                                 or 0.0),
            has_mask=bool(window) and spec.seq_len >= window,
            attn_impl=getattr(config, "_attn_implementation", None) or "sdpa",
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def act_dtype(self) -> torch.dtype:
        return {2: torch.bfloat16, 4: torch.float32}[self.act_bytes]

    @property
    def gqa_in_sdpa(self) -> bool:
        # transformers lets SDPA broadcast K/V heads only without a mask (integrations/sdpa_attention.py)
        return self.kv_heads != self.heads and not self.has_mask and self.attn_impl != "eager"


@dataclass(frozen=True)
class Target:
    """What the target device changes in the formulas."""

    cuda: bool
    kernel: str  # flash | efficient | math | cpu-flash | eager

    def dropout_mask_bytes(self, p: float, elements: int, dtype_bytes: int) -> int:
        """Kept by one dropout for backward: CUDA's fused kernel a bool mask, CPU a noise tensor of the dtype."""
        return 0 if p == 0 else elements * (1 if self.cuda else dtype_bytes)

    def stats_bytes(self, tokens: int, stream_bytes: int) -> int:
        """LayerNorm's saved mean and rstd (fp32 on CUDA, the input dtype on CPU)."""
        return 2 * tokens * (4 if self.cuda else stream_bytes)


@dataclass(frozen=True)
class BlockBytes:
    """Per-block terms of the analytic model, in bytes. The backward runs the MLP half first: while the attention
    half runs, the MLP half's saved tensors are already freed."""

    attention_half: int  # kept for backward up to the attention core, included (norm, projections, core)
    mlp_half: int  # kept for backward after it (output projection's dropout, norm, MLP)
    input: int  # the block's input, which a checkpoint keeps
    input_in_saved: bool  # the halves hold the input tensor itself, so a recomputed block adds nothing for it
    weight_copies: int  # amp: bf16 copies of the block's matmul weights (saved with the ops that use them)
    mlp_extra: int  # gradients alive at once in the MLP's backward, above what is saved
    attention_extra: int  # same in the attention core's backward
    grad_flow: int  # the gradient of the residual stream entering the block

    @property
    def saved(self) -> int:
        """Kept for backward by the block run without checkpoint."""
        return self.attention_half + self.mlp_half + self.weight_copies

    @property
    def backward_peak(self) -> int:
        """The most the block's backward holds at once: its saved tensors still unused plus the transients."""
        return self.grad_flow + self.weight_copies + max(self.attention_half + self.mlp_half + self.mlp_extra,
                                                         self.attention_half + self.attention_extra)


def attention_saved(sh: Shape, dev: Target, fused_qkv: bool) -> tuple[int, int]:
    """(bytes the attention core keeps for backward, the transient of its backward) for one block.

    fused_qkv: q, k, v are views of one projection output (GPT-2's c_attn), kept whole while any view is kept;
    otherwise each is a tensor of its own (Llama after RoPE, BERT's separate projections)."""
    th, t = sh.tokens * sh.hidden, sh.tokens
    e = 2 if sh.amp else sh.act_bytes  # under amp, autocast runs attention in bf16
    # K/V at their own head count when SDPA broadcasts them; the memory-efficient kernel gets them repeated
    kv = sh.kv_heads / sh.heads if sh.gqa_in_sdpa and dev.kernel != "efficient" else 1.0
    scores = sh.batch * sh.heads * sh.seq * sh.seq  # elements of the seq x seq matrices of all heads
    if dev.kernel in ("flash", "efficient", "cpu-flash"):
        # q, k, v, output, and a float32 log-sum-exp per row (memory-efficient pads the rows to 32)
        qkv = 3 * e * th if fused_qkv else int(e * th * (1 + 2 * kv))
        rows = -(-sh.seq // 32) * 32 if dev.kernel == "efficient" else sh.seq
        # a bool mask (sliding window) becomes an additive float mask per layer, which backward keeps
        bias = sh.batch * sh.seq * sh.seq * e if sh.has_mask and dev.kernel != "flash" else 0
        # backward: dq, dk, dv; CUDA flash adds its fp32 dq accumulator (flash_backward_workspace_bytes)
        workspace = 4 * th + 4 * t * sh.heads if dev.cuda and dev.kernel == "flash" else 0
        return qkv + e * th + 4 * sh.batch * sh.heads * rows + bias, int(e * th * (1 + 2 * kv)) + workspace
    if dev.kernel == "eager":
        # transformers' eager attention: q and k^T for QK^T, softmax (fp32 in Llama), dropout, v for PV, output copy
        m = e
        probs = (4 if sh.family in ("llama", "mistral") else e) * scores
        if sh.attn_dropout == 0 and probs != e * scores:
            probs += e * scores  # the probabilities cast back to the activation dtype are what PV keeps
        q_k_v = 3 * e * th
    else:
        # SDPA's math path upcasts 16-bit q, k, v to fp32 (attention.cpp, _scaled_dot_product_attention_math) and
        # keeps its own copies: scaled q, scaled k^T, v made contiguous for the batched matmul (all heads), the
        # probabilities; then the output cast back
        m = 4
        probs = m * scores
        q_k_v = 3 * m * th
    if sh.attn_dropout > 0:
        probs += dev.dropout_mask_bytes(sh.attn_dropout, scores, m) + m * scores
    # backward holds one seq x seq gradient at a time; Llama's eager fp32 softmax two fp32 ones (the incoming
    # gradient cast up, and its own), by when dropout's mask and output (or the cast probabilities) are freed
    extra = m * scores
    if dev.kernel == "eager" and sh.family in ("llama", "mistral"):
        freed = probs - 4 * scores
        extra = max(extra, 8 * scores - freed)
    return q_k_v + probs + e * th, extra + m * th


def llama_block(sh: Shape, dev: Target, weights: BlockWeights) -> BlockBytes:
    """Llama / Mistral: RMSNorm (computed in fp32), q/k/v/o projections, RoPE, SwiGLU MLP, no dropout outside
    attention. Per block, bf16 with flash: 24 Th + 8 Ti bytes for MHA (Korthikanti's 34 Th had a GELU MLP of 4h,
    dropout masks and no fp32 norm)."""
    t, th, ti, e = sh.tokens, sh.tokens * sh.hidden, sh.tokens * sh.intermediate, sh.act_bytes

    def rms_norm(consumers: int) -> int:
        # fp32 input (the stream itself, or its fp32 copy), rsqrt per token, x*rsqrt in the stream dtype for the
        # weight's gradient, and the output as the projections keep it (under amp: each its own bf16 cast)
        out = 2 * consumers if sh.amp else sh.stream_bytes
        return 4 * th + 4 * t + sh.stream_bytes * th + out * th

    attention, attention_extra = attention_saved(sh, dev, fused_qkv=False)
    mlp = 4 * e * ti  # gate, up, silu(gate), silu(gate) * up
    return BlockBytes(
        attention_half=rms_norm(3) + attention, mlp_half=rms_norm(2) + mlp, input=sh.stream_bytes * th,
        input_in_saved=sh.stream_bytes == 4, weight_copies=weights.amp_copies,
        mlp_extra=max(2 * e * ti, weights.largest_grad + e * ti), attention_extra=attention_extra,
        grad_flow=sh.stream_bytes * th)


def gpt2_block(sh: Shape, dev: Target, weights: BlockWeights) -> BlockBytes:
    """GPT-2: pre-LayerNorm, fused c_attn, tanh-GELU written out in Python (keeps 5 tensors of 4h), dropout after
    both projections."""
    t, th, ti, e, es = sh.tokens, sh.tokens * sh.hidden, sh.tokens * sh.intermediate, sh.act_bytes, sh.stream_bytes

    def layer_norm() -> int:
        return es * th + dev.stats_bytes(t, es) + (2 if sh.amp else es) * th  # input, mean/rstd, output (or cast)

    attention, attention_extra = attention_saved(sh, dev, fused_qkv=True)
    dropout = dev.dropout_mask_bytes(sh.hidden_dropout, th, e)
    return BlockBytes(
        attention_half=layer_norm() + attention, mlp_half=dropout + layer_norm() + 5 * e * ti + dropout,
        input=es * th, input_in_saved=True, weight_copies=weights.amp_copies,
        mlp_extra=max(2 * e * ti, weights.largest_grad + e * ti), attention_extra=attention_extra, grad_flow=es * th)


def bert_block(sh: Shape, dev: Target, weights: BlockWeights) -> BlockBytes:
    """BERT: post-LayerNorm, separate q/k/v, exact GELU, dropout after both output projections."""
    t, th, ti, e, es = sh.tokens, sh.tokens * sh.hidden, sh.tokens * sh.intermediate, sh.act_bytes, sh.stream_bytes
    attention, attention_extra = attention_saved(sh, dev, fused_qkv=False)
    dropout = dev.dropout_mask_bytes(sh.hidden_dropout, th, e)
    block_input = 3 * 2 * th if sh.amp else es * th  # kept by the q/k/v projections (under amp: three casts)
    ln1 = es * th + dev.stats_bytes(t, es) + (2 if sh.amp else es) * th  # input, stats, output as the MLP keeps it
    ln2 = es * th + dev.stats_bytes(t, es)  # its output is the next block's input
    return BlockBytes(
        attention_half=block_input + attention, mlp_half=dropout + ln1 + 2 * e * ti + dropout + ln2,
        input=es * th, input_in_saved=not sh.amp, weight_copies=weights.amp_copies,
        mlp_extra=max(2 * e * ti, weights.largest_grad + e * ti), attention_extra=attention_extra, grad_flow=es * th)


@dataclass(frozen=True)
class BlockWeights:
    """The block's matmul weights, from the meta model: amp keeps a bf16 copy of each; backward makes a gradient
    of each before adding it into .grad (the largest is a transient)."""

    amp_copies: int
    largest_grad: int

    @classmethod
    def of(cls, block: nn.Module, sh: Shape) -> BlockWeights:
        matrices = [p.numel() for p in block.parameters() if p.dim() == 2]
        grad_bytes = 2 + 4 if sh.amp else sh.stream_bytes  # amp: a bf16 gradient, then its fp32 cast
        return cls(amp_copies=2 * sum(matrices) if sh.amp else 0, largest_grad=grad_bytes * max(matrices, default=0))


def embedding_saved(sh: Shape, dev: Target) -> int:
    """Kept for backward before the first block: RoPE tables, position ids, embedding LayerNorm and dropout."""
    th, es, s = sh.tokens * sh.hidden, sh.stream_bytes, sh.seq
    if sh.family in ("llama", "mistral"):
        return 2 * s * sh.head_dim * es  # cos, sin
    if sh.family == "gpt2":
        return 8 * s + dev.dropout_mask_bytes(sh.hidden_dropout, th, es)
    return 8 * s + es * th + dev.stats_bytes(sh.tokens, es) + dev.dropout_mask_bytes(sh.hidden_dropout, th, es)


@dataclass(frozen=True)
class HeadBytes:
    """The LM head, the loss, and the output embedding's gradient, in bytes."""

    saved: int  # final norm, LM head input, log-softmax output, targets (amp: the weight's bf16 copy)
    forward_extra: int  # logits (and their fp32 copy) at the end of the forward
    backward_extra: int  # loss and log-softmax gradients at the start of the backward
    weight_grad: int  # the LM head's backward: logits' gradient and the weight's gradient before .grad += it
    tied_pending: int  # a weight shared with the input embedding: its head gradient waits for the embedding's
    embedding_backward: int  # the input embedding's dense gradient (tied: plus the pending one and their sum)


def head_bytes(sh: Shape, dev: Target, vocab_weight: int, tied: bool) -> HeadBytes:
    """The LM head and the cross-entropy loss. Causal LMs upcast the logits to fp32 before the loss; BERT's loss
    runs in the logits' dtype. vocab_weight: elements of the output embedding."""
    t, th, tv, e, es = sh.tokens, sh.tokens * sh.hidden, sh.tokens * sh.vocab, sh.act_bytes, sh.stream_bytes
    copy = 2 * vocab_weight if sh.amp else 0  # amp: the bf16 copy of the output embedding
    grad = vocab_weight * (2 + 4 if sh.amp else es)  # amp: a bf16 gradient, then its fp32 cast
    gradients = dict(tied_pending=vocab_weight * es if tied else 0,
                     embedding_backward=vocab_weight * es * (3 if tied else 1))
    if sh.family == "bert":
        lsm = 4 if sh.amp else e
        # transform: dense input, dense output (GELU keeps it), GELU output (LayerNorm keeps it), stats, output
        inputs = (2 if sh.amp else es) * th + e * th + (4 if sh.amp else es) * th + dev.stats_bytes(t, es) \
            + (2 if sh.amp else es) * th
        return HeadBytes(inputs + lsm * tv + copy, e * tv + (4 * tv if lsm > e else 0), 2 * lsm * tv,
                         weight_grad=inputs + copy + e * tv + grad, **gradients)
    if sh.family == "gpt2":
        inputs = es * th + dev.stats_bytes(t, es) + (2 if sh.amp else es) * th
    else:
        inputs = 4 * th + 4 * t + es * th + (2 if sh.amp else es) * th
    return HeadBytes(inputs + 4 * tv + 8 * t + copy, e * tv + (4 * tv if e < 4 else 0), 2 * 4 * tv,
                     weight_grad=inputs + copy + e * tv + grad, **gradients)


BLOCK_FORMULAS = {"llama": llama_block, "mistral": llama_block, "gpt2": gpt2_block, "bert": bert_block}


def understands(policy: Policy) -> bool:
    """True for a policy that only groups blocks into plain checkpoints (the analytic model's vocabulary)."""
    cls = type(policy)
    return cls.apply is Policy.apply and getattr(cls, "wrap_group", None) is getattr(Policy, "wrap_group", None)


def _check_understood(policy: Policy) -> None:
    if not understands(policy):
        raise GcbenchError(f"the analytic model does not know policy {policy.name!r} (it knows policies that only "
                           f"group blocks into plain checkpoints: none, full, every-k, segments, sqrtn); use "
                           f"--method simulate")


def analytic(spec: RunSpec, target: str = "cuda") -> Estimate:
    """Add up the per-block formulas along the policy's block groups; see the module docstring."""
    start = time.perf_counter()
    _check_understood(spec.policy)
    config, family = spec.model_config()
    if family not in BLOCK_FORMULAS:
        raise GcbenchError(f"the analytic model has no formulas for {family!r} models; use --method simulate")
    cuda = target == "cuda"
    sh = Shape.of(spec, config)
    dev = Target(cuda=cuda, kernel=attention_kernel(spec, config, target))
    meta = build_model(config, family, "meta", spec.param_dtype)
    blocks = find_blocks(meta)
    block = BLOCK_FORMULAS[family](sh, dev, BlockWeights.of(blocks[0], sh))
    output, input_ = meta.get_output_embeddings().weight, meta.get_input_embeddings().weight
    head = head_bytes(sh, dev, output.numel(), tied=output is input_)

    granularity = CUDA_BLOCK_BYTES if cuda else 1
    params = list(meta.parameters()) + list(meta.buffers())
    param_bytes = sum(round_up(p.numel() * p.element_size(), granularity) for p in params)
    grad_bytes = sum(round_up(p.numel() * p.element_size(), granularity) for p in meta.parameters())
    states = OPTIMIZER_STATES[spec.optimizer]
    # AdamW/SGD keep a 0-dim fp32 `step` per parameter on the host: tracked on CPU, not in CUDA memory
    step_tensors = 0 if cuda or spec.optimizer != "adamw" else len(params) * 4
    optimizer_bytes = states * grad_bytes + step_tensors
    static = param_bytes + grad_bytes + optimizer_bytes + round_up(8 * sh.tokens, granularity)

    activations, phase = _activation_peak(spec.policy, len(blocks), block, head, embedding_saved(sh, dev),
                                          sh.amp, _optimizer_extra(spec.optimizer, cuda, meta))
    return Estimate(
        method="analytic", target=target, peak_bytes=static + activations, param_bytes=param_bytes,
        grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, activation_bytes=static + activations - param_bytes
        - grad_bytes - optimizer_bytes, peak_phase=phase, attention_kernel=dev.kernel,
        seconds=time.perf_counter() - start)


def _optimizer_extra(optimizer: str, cuda: bool, meta: nn.Module) -> int:
    """Temporaries of the optimizer step above model state: CUDA AdamW's multi-tensor path builds sqrt(v) for all
    parameters at once; the CPU single-tensor path two of the largest parameter at a time; SGD works in place."""
    if optimizer != "adamw":
        return 0
    sizes = [p.numel() * p.element_size() for p in meta.parameters()]
    return sum(sizes) if cuda else 2 * max(sizes)


def _activation_peak(policy: Policy, n: int, block: BlockBytes, head: HeadBytes, embedding: int, amp: bool,
                     optimizer_extra: int) -> tuple[int, str]:
    """Peak above static memory, and its phase, walking the forward and then the backward block by block.

    A block outside every group keeps `block.saved`; a checkpointed group keeps its input only, and when the
    backward reaches it, recomputes all its blocks at once (the peak of a checkpointed model)."""
    group_of = {i: g for g in policy.groups(n) for i in g}
    stored = [block.input if i in group_of and group_of[i].start == i else 0 if i in group_of else block.saved
              for i in range(n)]
    checkpointed = sum(1 for i in range(n) if i in group_of)
    # amp: autocast caches every weight's bf16 copy until the forward ends, checkpointed blocks' too
    forward = embedding + sum(stored) + head.saved + head.forward_extra + (block.weight_copies * checkpointed if amp
                                                                            else 0)
    candidates = [forward, embedding + sum(stored) + head.saved + head.backward_extra,
                  embedding + sum(stored) + head.weight_grad, embedding + block.grad_flow + head.embedding_backward]
    embedding += head.tied_pending  # from here to the end of the backward
    i = n - 1
    while i >= 0:
        group = group_of.get(i)
        if group is None:
            candidates.append(embedding + sum(stored[:i]) + block.backward_peak)
            i -= 1
            continue
        recomputed = (len(group) - 1) * block.saved + (0 if block.input_in_saved else block.input)
        candidates.append(embedding + sum(stored[: group.start]) + recomputed + block.backward_peak)
        i = group.start - 1
    fwd_bwd = max(candidates)
    if optimizer_extra > fwd_bwd:
        return optimizer_extra, "optimizer step"
    return fwd_bwd, "forward/backward"
