"""The `analytic` predictor: add up per-block formulas along the policy's block groups. Instant.

The formulas follow Korthikanti et al. 2022 (per-layer bytes sbh(34 + 5as/h)), rewritten per model family for the
attention kernel, GQA, the MLP shape and the dtype, and for what the target device keeps (CUDA's bool dropout masks
and fp32 LayerNorm statistics, the CPU's noise tensors). The walk over the blocks knows the policies that only
group blocks into plain checkpoints (ANALYTIC_POLICIES); anything else is the simulation's. See
docs/methodology.md, "Predicting memory".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import nn

from gcbench.errors import GcbenchError
from gcbench.estimators.estimates import Estimate
from gcbench.estimators.loss_head import loss_head_terms
from gcbench.estimators.shape import CUDA_BLOCK_BYTES, Shape, attention_kernel
from gcbench.losses import CPU_TARGET
from gcbench.modality import block_config
from gcbench.models import build_model, find_blocks
from gcbench.per_layer import varying
from gcbench.policies import EveryK, Full, NoCheckpoint, Policy, Segments, SqrtN
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec
from gcbench.optimizers import optimizer_kind
from gcbench.results.schema import peak_phase
from gcbench.units import round_up

# What _activation_peak can walk: policies whose whole effect is `groups()`, each group one plain checkpoint. Named
# here, not inferred from which methods a class overrides, so that a new policy is the simulation's until someone
# writes (and tests) its formulas; the exact class, not a subclass, which may change what its blocks keep.
ANALYTIC_POLICIES: tuple[type[Policy], ...] = (NoCheckpoint, Full, EveryK, Segments, SqrtN)


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
        probs = (4 if _follows(sh, "llama") else e) * scores
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
    if dev.kernel == "eager" and _follows(sh, "llama"):
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
    if _follows(sh, "llama"):
        return 2 * s * sh.head_dim * es  # cos, sin
    if _follows(sh, "gpt2"):
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


def head_bytes(sh: Shape, dev: Target, vocab_weight: int, tied: bool, loss: str = "ce") -> HeadBytes:
    """The LM head and the cross-entropy loss. Causal LMs upcast the logits to fp32 before the loss; BERT's loss
    runs in the logits' dtype. vocab_weight: elements of the output embedding. loss: --loss (a chunked or fused
    one: loss_head.py)."""
    t, th, tv, e, es = sh.tokens, sh.tokens * sh.hidden, sh.tokens * sh.vocab, sh.act_bytes, sh.stream_bytes
    copy = 2 * vocab_weight if sh.amp else 0  # amp: the bf16 copy of the output embedding
    grad = vocab_weight * (2 + 4 if sh.amp else es)  # amp: a bf16 gradient, then its fp32 cast
    gradients = dict(tied_pending=vocab_weight * es if tied else 0,
                     embedding_backward=vocab_weight * es * (3 if tied else 1))
    if _follows(sh, "bert"):
        lsm = 4 if sh.amp else e
        # transform: dense input, dense output (GELU keeps it), GELU output (LayerNorm keeps it), stats, output
        inputs = (2 if sh.amp else es) * th + e * th + (4 if sh.amp else es) * th + dev.stats_bytes(t, es) \
            + (2 if sh.amp else es) * th
        return HeadBytes(inputs + lsm * tv + copy, e * tv + (4 * tv if lsm > e else 0), 2 * lsm * tv,
                         weight_grad=inputs + copy + e * tv + grad, **gradients)
    if _follows(sh, "gpt2"):
        inputs = es * th + dev.stats_bytes(t, es) + (2 if sh.amp else es) * th
    else:
        inputs = 4 * th + 4 * t + es * th + (2 if sh.amp else es) * th
    if loss != "ce":
        terms = loss_head_terms(sh, loss, inputs, (2 if sh.amp else es) * th, vocab_weight, copy)
        return HeadBytes(**terms, **gradients)
    return HeadBytes(inputs + 4 * tv + 8 * t + copy, e * tv + (4 * tv if e < 4 else 0), 2 * 4 * tv,
                     weight_grad=inputs + copy + e * tv + grad, **gradients)


BLOCK_FORMULAS = {"llama": llama_block, "gpt2": gpt2_block, "bert": bert_block}
# model_type -> the formulas its blocks follow. A family is listed only where its blocks, embeddings and head keep
# what those formulas count: tests/test_families.py holds each within 10% of the simulation. What the others add
# (q/k norms, soft-capping, local/global layers, fused projections, parallel residuals, experts) is in
# docs/methodology.md, "What the analytic model does not describe"; the simulation predicts them.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "bert": "bert",
                 "roberta": "bert"}


def _follows(sh: Shape, architecture: str) -> bool:
    return ARCHITECTURES.get(sh.family) == architecture


def understands(policy: Policy) -> bool:
    """True for a policy the analytic model knows (ANALYTIC_POLICIES)."""
    return type(policy) in ANALYTIC_POLICIES


def unavailable(spec: RunSpec | ResolvedRun) -> str | None:
    """Why the analytic model cannot predict `spec` (its policy or its model family), or None when it can."""
    spec = resolve(spec)
    if not understands(spec.policy):
        known = ", ".join(cls.name for cls in ANALYTIC_POLICIES)
        return (f"the analytic model does not know policy {spec.policy.name!r} (it knows policies that only group "
                f"blocks into plain checkpoints: {known})")
    config, family = spec.model_config()
    if differ := varying(block_config(config)):  # per_layer.py: one formula per block takes one value for all
        return (f"the analytic model has no formulas for models whose layers differ ({', '.join(sorted(differ))} "
                "per layer: per_layer_config)")
    if family not in ARCHITECTURES:
        return (f"the analytic model has no formulas for {family} models (it has them for "
                f"{', '.join(sorted(ARCHITECTURES))})")
    if spec.head != "lm":
        return ("the analytic model has no formulas for --head seq-cls (its formulas are for a language-model head; "
                "a classifier reads one token's hidden state and has no vocabulary-wide logits)")
    if spec.loss.partition(":")[0] == "litgpt":
        return ("the analytic model has no formulas for --loss litgpt (every slice's logits kept, and under autocast "
                "a copy of the head's weight per slice)")
    if spec.adapter != "none":  # docs/levers.md, "Adapters": what a frozen base and its adapters keep, measured
        return (f"the analytic model has no formulas for --adapter {spec.adapter.partition(':')[0]} (a frozen base "
                "keeps other tensors for backward, and its adapters their own)")
    return None


def analytic(spec: RunSpec | ResolvedRun, target: str = "cuda") -> Estimate:
    """Add up the per-block formulas along the policy's block groups; see the module docstring."""
    start = time.perf_counter()
    spec = resolve(spec)
    if reason := unavailable(spec):
        raise GcbenchError(f"{reason}; use --method simulate")
    config, family = spec.model_config()
    cuda = target == "cuda"
    if spec.loss == "fused-linear" and not cuda:
        raise GcbenchError(CPU_TARGET)
    sh = Shape.of(spec, config)
    dev = Target(cuda=cuda, kernel=attention_kernel(spec, config, target))
    meta = build_model(config, "meta", spec.param_dtype)
    blocks = find_blocks(meta)
    block = BLOCK_FORMULAS[ARCHITECTURES[family]](sh, dev, BlockWeights.of(blocks[0], sh))
    output, input_ = meta.get_output_embeddings().weight, meta.get_input_embeddings().weight
    head = head_bytes(sh, dev, output.numel(), tied=output is input_, loss=spec.loss)

    granularity = CUDA_BLOCK_BYTES if cuda else 1
    size = lambda nbytes: round_up(nbytes, granularity)  # noqa: E731 - what the device holds for one tensor
    weights = list(meta.parameters())
    param_bytes = sum(size(p.numel() * p.element_size()) for p in weights + list(meta.buffers()))
    # with the optimizer in backward no gradient outlives its parameter's step: none is model state
    grad_bytes = 0 if spec.optim_in_backward else sum(size(p.numel() * p.element_size()) for p in weights)
    kind = optimizer_kind(spec.optimizer)
    optimizer_bytes = sum(size(b) for p in weights for b in kind.state(tuple(p.shape), sh.stream_bytes, cuda)) \
        + kind.shared_bytes([tuple(p.shape) for p in weights], spec.optim_in_backward)
    # --precision amp-fp16, torch.amp.GradScaler (torch/amp/grad_scaler.py): its scale (fp32) and growth tracker
    # (int32), 0-dim on the device from the start (step._grad_scaler); each backward holds the scaled loss (loss *
    # scale, 0-dim fp32); unscale_ makes inv_scale (via fp64), found_inf and one copy of each per device
    # (_MultiDeviceReplicator), unscales the gradients in place (_amp_foreach_non_finite_check_and_unscale_), and
    # keeps the found_inf copy until update(), across the optimizer's step; update() changes the scale in place
    scalar = size(4) if spec.precision == "amp-fp16" else 0
    static = param_bytes + grad_bytes + optimizer_bytes + size(8 * sh.tokens * spec.grad_accum)  # + the token ids
    static += 2 * scalar

    sizes = [p.numel() * p.element_size() for p in weights]
    multi_tensor = cuda and kind.multi_tensor_on_cuda  # the path torch takes by default on the target
    if spec.optim_in_backward:
        # each parameter is stepped alone as its gradient completes: its step's temporaries join the backward
        in_backward = lambda nbytes: kind.temporaries([nbytes], multi_tensor)  # noqa: E731
    else:
        in_backward = lambda nbytes: 0  # noqa: E731
    phases: dict[str, int | None] = _activation_peaks(
        spec.policy, len(blocks), block, head, embedding_saved(sh, dev), sh.amp,
        in_backward(max(p.numel() * p.element_size() for p in blocks[0].parameters())), in_backward(max(sizes)))
    steps_after = kind.steps and not spec.optim_in_backward
    phases["optimizer"] = max(4 * scalar, scalar + kind.temporaries(sizes, multi_tensor)) if steps_after else None
    phases["backward"] += scalar  # the scaled loss
    phase = peak_phase(phases)
    peak = static + phases[phase]
    above = lambda extra: None if extra is None else static + extra  # noqa: E731
    return Estimate(
        method="analytic", target=target, peak_bytes=peak, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes, activation_bytes=peak - param_bytes - grad_bytes - optimizer_bytes,
        peak_phase=phase, forward_peak_bytes=above(phases["forward"]), backward_peak_bytes=above(phases["backward"]),
        optimizer_peak_bytes=above(phases["optimizer"]), n_params=sum(p.numel() for p in weights),
        attention_kernel=dev.kernel, seconds=time.perf_counter() - start,
        optimizer_paged_bytes=kind.paged_bytes([tuple(p.shape) for p in weights], cuda) if kind.paged else None)


def _activation_peaks(policy: Policy, n: int, block: BlockBytes, head: HeadBytes, embedding: int, amp: bool,
                      block_step: int, head_step: int) -> dict[str, int]:
    """Peak above static memory in the forward and in the backward, walking the forward and then the backward
    block by block. block_step / head_step: the temporaries of a parameter's optimizer step run in backward, in a
    block and where the head's and embeddings' gradients complete (there: the largest parameter's; 0 when the
    optimizer steps after backward).

    A block outside every group keeps `block.saved`; a checkpointed group keeps its input only, and when the
    backward reaches it, recomputes all its blocks at once (the peak of a checkpointed model)."""
    group_of = {i: g for g in policy.groups(n) for i in g}
    stored = [block.input if i in group_of and group_of[i].start == i else 0 if i in group_of else block.saved
              for i in range(n)]
    checkpointed = sum(1 for i in range(n) if i in group_of)
    # amp: autocast caches every weight's bf16 copy until the forward ends, checkpointed blocks' too
    forward = embedding + sum(stored) + head.saved + head.forward_extra + (block.weight_copies * checkpointed if amp
                                                                            else 0)
    candidates = [embedding + sum(stored) + head.saved + head.backward_extra,
                  embedding + sum(stored) + head.weight_grad + head_step,
                  embedding + block.grad_flow + head.embedding_backward + head_step]
    embedding += head.tied_pending  # from here to the end of the backward
    i = n - 1
    while i >= 0:
        group = group_of.get(i)
        if group is None:
            candidates.append(embedding + sum(stored[:i]) + block.backward_peak + block_step)
            i -= 1
            continue
        recomputed = (len(group) - 1) * block.saved + (0 if block.input_in_saved else block.input)
        candidates.append(embedding + sum(stored[: group.start]) + recomputed + block.backward_peak + block_step)
        i = group.start - 1
    return {"forward": forward, "backward": max(candidates)}
