"""Per-rank memory of an FSDP2 run (--shard fsdp2 --nproc N), from the prediction of the unsharded step at the
same per-rank batch (either method) and what FSDP2 holds at each moment of the step (docs/scale.md, "Predicting a
rank").

Model state is 1/N of the unsharded bytes each (parameters, gradients, optimizer state: DTensor shards). What FSDP2
adds is not the same at every moment, so it is not added to the unsharded phase peaks as one sum: the step is
walked moment by moment, as the analytic model walks it (analytic._activation_peaks), and at each moment the
unsharded step's activations there (`a`) get what FSDP2 holds then (`f`). A phase's prediction is the unsharded
phase peak (either method) plus max(a + f) - max(a) over the phase's moments. Where the analytic model has no
formulas (a family or policy only the simulation knows), `a` is unknown: every moment is taken at the phase peak,
max(f), which can only overestimate. What FSDP2 holds, from torch/distributed/fsdp/_fully_shard/ (torch 2.11-2.13):

- A unit is what `fully_shard` wraps (gcbench.fsdp.shard_model): a block, or a group policy's whole group. Its
  parameters are gathered in the compute dtype by its pre-forward and pre-backward (FSDPParamGroup.unshard and
  wait_for_unshard, _fsdp_param_group.py) and freed by `reshard` after its forward (reshard_after_forward, True for
  every unit but the root) and after its backward (post_backward).
- The root (embeddings, final norm, head) is never resharded after forward: FSDPState._lazy_init sets its
  post_forward_mesh_info to None (_fsdp_state.py, "For the root, do not reshard after forward"). It stays gathered
  until the backward's final callback.
- At N > 1, a unit's all-gather lands in a flat buffer of the unit's size (foreach_all_gather,
  _fsdp_collectives.py) that wait_for_unshard copies out into the parameters. In forward the buffer is kept
  ("Defer free", comm_ctx.all_gather_state) until the next unit's copy-out, the last one until the root's
  post-forward (_fsdp_state.py, _post_forward): through the head and the loss. At N = 1, unshard allocates nothing
  and wait_for_unshard copies the shards into the parameters (_fsdp_param_group.py, `world_size == 1`).
- Backward prefetch: a unit's pre-backward calls unshard on the unit before it in forward order
  (_backward_prefetch); the root's pre-backward runs from a hook on its outputs (the logits), after the loss's
  backward. unshard only all-gathers into the flat buffer (N > 1; nothing at N = 1); the copy-out waits for the
  unit's own pre-backward.
- Gradients: autograd makes the unit's unsharded gradients in the compute dtype; the unit's post-backward (when
  the gradient reaches its inputs: after its whole group's backward) copies them into a reduce-scatter input in the
  reduce dtype and frees them (foreach_reduce: "Only after the copy-in finishes can we free the gradients"). That
  input is kept until the next unit's post-backward (comm_ctx.reduce_scatter_states, reduce_scatter_max_input_buffers
  = 1). The root's inputs (token ids) need no gradient, so its gradients wait, unsharded, for the final callback.
Bytes are not rounded to FSDP2's padding (a dimension not divisible by N is padded: at most N-1 rows per parameter).
Under amp-bf16, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (fsdp.py) gathers bf16
parameters and casts the root's floating-point inputs to bf16 (cast_forward_inputs), so the step computes on bf16
weights: autocast finds nothing to copy and the hidden states are bf16, not the fp32 of an unsharded amp-bf16
step. The activations are then those of the pure-bf16 step (`compute_step`); the model state, its fp32 shards and
the optimizer step, stay amp-bf16's (`computed_in_bf16`). Autocast over bf16 weights differs from pure bf16 only
in the ops it runs in fp32 (a layer norm's output, on CUDA): not modelled. Measured on CPU ranks (docs/scale.md),
this is within -0.0..+1.3% where the unsharded amp-bf16 step gave +5.8..+12.3%.

This model is what `--method analytic` predicts, and what `simulate` falls back to inside a rank of a real run;
elsewhere `simulate` runs FSDP2 itself over a fake process group (fake_ranks.py), exact on CPU ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from gcbench.errors import GcbenchError
from gcbench.estimators.estimates import Estimate


@dataclass(frozen=True)
class Sizes:
    """Elements FSDP2 gathers and reduces, and the bytes per element of each."""

    root: int  # parameters outside the blocks (embeddings, final norm, head)
    root_grad: int  # of them, those whose gradient the head's backward makes: all but the input embeddings'
    block: int  # parameters of the largest block
    mlp: int  # of them, those outside its attention (MLP, norms): the gradients its backward makes first
    units: list[int]  # blocks per FSDP unit, in forward order
    gathered: int  # compute dtype: gathered parameters and their unsharded gradients
    reduced: int  # reduce dtype: the reduce-scatter input


def compute_step(one_process):
    """The unsharded step whose activations an FSDP2 rank has: under amp-bf16, the pure-bf16 step (the module
    docstring); else the step itself."""
    return one_process.replace(precision="bf16") if one_process.precision == "amp-bf16" else one_process


def computed_in_bf16(unsharded: Estimate, computed: Estimate) -> Estimate:
    """`unsharded` (amp-bf16, one process) with the forward's and backward's activations of `computed` (the same
    step on bf16 weights, compute_step): its model state and optimizer step are kept, fp32 as FSDP2 keeps them."""
    state = unsharded.param_bytes + unsharded.grad_bytes + unsharded.optimizer_bytes
    computed_state = computed.param_bytes + computed.grad_bytes + computed.optimizer_bytes
    return dataclasses.replace(
        unsharded, forward_peak_bytes=computed.forward_peak_bytes - computed_state + state,
        backward_peak_bytes=computed.backward_peak_bytes - computed_state + state,
        attention_kernel=computed.attention_kernel, work=None)


def shard_estimate(unsharded: Estimate, spec) -> Estimate:
    """The per-rank prediction of `spec` (shard fsdp2, nproc N) from `unsharded`, the same step's prediction in
    one process at the same per-rank batch."""
    world = spec.nproc
    sizes = _sizes(spec)
    static = unsharded.param_bytes + unsharded.grad_bytes + unsharded.optimizer_bytes
    static_rank = math.ceil(static / world)
    moments = _moments(sizes, world, _analytic_terms(spec, unsharded.target, sizes))
    extra = {phase: max(a + f for p, a, f in moments if p == phase) - max(a for p, a, f in moments if p == phase)
             for phase in ("forward", "backward")}

    def rank_peak(phase_peak: int, phase: str) -> int:
        return static_rank + (phase_peak - static) + extra[phase]

    forward = rank_peak(unsharded.forward_peak_bytes, "forward")
    backward = rank_peak(unsharded.backward_peak_bytes, "backward")
    optimizer = None if unsharded.optimizer_peak_bytes is None else \
        static_rank + math.ceil((unsharded.optimizer_peak_bytes - static) / world)  # it steps the shards
    phases = {"forward": forward, "backward": backward, **({"optimizer": optimizer} if optimizer is not None else {})}
    phase = max(phases, key=phases.get)
    return dataclasses.replace(
        unsharded, peak_bytes=phases[phase], peak_phase=phase, forward_peak_bytes=forward,
        backward_peak_bytes=backward, optimizer_peak_bytes=optimizer,
        param_bytes=math.ceil(unsharded.param_bytes / world), grad_bytes=math.ceil(unsharded.grad_bytes / world),
        optimizer_bytes=math.ceil(unsharded.optimizer_bytes / world),
        activation_bytes=phases[phase] - static_rank, work=None)  # no collectives: the time is not predicted


@dataclass(frozen=True)
class Terms:
    """The analytic model's activation terms of the unsharded step (analytic._activation_peaks), in bytes."""

    embedding: int
    stored: list[int]  # kept per block through the forward
    plain: list[bool]  # per block: outside every checkpoint
    saved: int  # a block's saved tensors, run without checkpoint
    input_adjust: int  # a recomputed group's input, where the block's saved tensors do not hold it
    backward_mlp: int  # what one block's backward holds at its MLP's (analytic BlockBytes.backward_peak's first term)
    backward_attention: int  # and at its attention's (the second), when the MLP's gradients are made
    forward_transient: int  # the most a checkpointed block's forward holds at once: its attention or MLP half
    grad_flow: int
    head_saved: int
    head_forward: int
    head_backward: int
    head_weight_grad: int
    head_embedding: int
    tied_pending: int
    weight_copies: int  # amp: autocast's bf16 copies, kept to the forward's end


def _moments(sz: Sizes, world: int, t: Terms | None) -> list[tuple[str, int, int]]:
    """(phase, unsharded activations `a`, FSDP2's bytes `f`) at each moment that can hold a phase's peak; `a` is 0
    throughout where the analytic terms are unknown (t None)."""
    n = sum(sz.units)
    t = t or Terms(0, [0] * n, [True] * n, *[0] * 13)
    g = 1 if world > 1 else 0  # flat all-gather buffers exist at N > 1 only
    unit = [k * sz.block * sz.gathered for k in sz.units]  # a unit's gathered parameters (its gradients: the same)
    rs = [k * sz.block * sz.reduced for k in sz.units]  # a unit's reduce-scatter input
    root, head_grads = sz.root * sz.gathered, sz.root_grad * sz.gathered
    starts = [sum(sz.units[:u]) for u in range(len(sz.units))]
    stored = lambda end: sum(t.stored[:end])  # noqa: E731
    moments = []
    # forward: each unit's copy-out (its flat buffer, the previous one's still kept) and the end of its forward
    for u, start in enumerate(starts):
        before = unit[u - 1] if u else 0
        moments.append(("forward", t.embedding + stored(start), root + g * (before + unit[u]) + unit[u]))
        moments.append(("forward", t.embedding + stored(start + sz.units[u]), root + (1 + g) * unit[u]))
        if not t.plain[start]:
            # inside a checkpointed unit's last block: what its forward computes is not kept, but is live at once
            # (the tensors of its attention or MLP half, as if saved; in a group, its own input too)
            inside = t.embedding + stored(start) + (t.input_adjust if sz.units[u] > 1 else 0) + t.forward_transient
            moments.append(("forward", inside, root + (1 + g) * unit[u]))
    # the head and the loss: every unit resharded, the last flat buffer kept until the root's post-forward
    head = t.embedding + stored(n)
    moments.append(("forward", head + t.head_saved + t.head_forward + t.weight_copies, root + g * unit[-1]))
    # backward: the loss's, whose gradients are still live when the logits' gradient fires the root's pre-backward
    # hook and its prefetch of the last unit (measured on CPU ranks: the peak of `none`); then the head's (its
    # gradient is the unsharded one autograd makes, counted in `a`)
    moments.append(("backward", head + t.head_saved + t.head_backward, root + g * unit[-1]))
    moments.append(("backward", head + t.head_weight_grad, root + g * unit[-1]))
    for u in reversed(range(len(sz.units))):
        held = root + head_grads + unit[u] + (g * unit[u - 1] if u else 0) + (rs[u + 1] if u + 1 < len(rs) else 0)
        k, start = sz.units[u], starts[u]
        base = t.embedding + t.tied_pending + stored(start)
        for j in range(k):  # the unit's blocks in backward order; its gradients grow by a block each
            # a checkpoint recomputes its blocks at once; each block's backward frees its saved tensors
            recomputed = 0 if t.plain[start] else (k - 1 - j) * t.saved + t.input_adjust
            done = j * sz.block  # gradients of the unit's blocks already through their backward
            moments.append(("backward", base + recomputed + t.backward_mlp, held + (done + sz.mlp) * sz.gathered))
            moments.append(("backward", base + recomputed + t.backward_attention,
                            held + (done + sz.block) * sz.gathered))
    # the input embedding's backward, then the root's post-backward (the final callback) reducing its gradients
    moments.append(("backward", t.embedding + t.grad_flow + t.head_embedding, root + head_grads + rs[0]))
    moments.append(("backward", 0, root + sz.root * (sz.gathered + sz.reduced)))
    return moments


def _sizes(spec) -> Sizes:
    """Parameters outside the blocks and in the largest block, and the units, from a meta-device build."""
    from gcbench.models import build_meta_model, count_params, find_blocks

    config, _ = spec.model_config()
    model = build_meta_model(config)
    blocks = find_blocks(model)
    largest = max(blocks, key=count_params)
    block = count_params(largest)
    # a block's backward runs its MLP first (analytic.BlockBytes): its attention's gradients come after
    attention = sum(count_params(m) for name, m in largest.named_children() if "attn" in name or "attention" in name)
    root = count_params(model) - sum(count_params(b) for b in blocks)
    # The input embeddings' gradients come at the backward's end; a head tied to one (GPT-2) waits with them in
    # autograd's buffer until both uses are summed, which the analytic terms count (HeadBytes.tied_pending)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    embedded = {id(p): p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False) if id(p) not in in_blocks}
    root_grad = root - sum(embedded.values())
    # fsdp.shard_model: each group of the policy is one unit, each block outside every group another
    grouped = {i: len(group) for group in spec.policy.groups(len(blocks)) for i in group}
    units, i = [], 0
    while i < len(blocks):
        units.append(grouped.get(i, 1))
        i += units[-1]
    element = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # noqa: E731
    gathered = 2 if spec.precision == "amp-bf16" else element(spec.param_dtype)  # MixedPrecisionPolicy (fsdp.py)
    reduced = 4 if spec.precision == "amp-bf16" else gathered
    return Sizes(root, root_grad, block, block - attention, units, gathered, reduced)


def _analytic_terms(spec, target: str, sizes: Sizes) -> Terms | None:
    """The analytic model's terms for the unsharded step of `spec`; None where it has no formulas for it."""
    from gcbench.estimators.analytic import (ARCHITECTURES, BLOCK_FORMULAS, BlockWeights, Target, embedding_saved,
                                             head_bytes, unavailable)
    from gcbench.estimators.shape import Shape, attention_kernel
    from gcbench.models import build_model, find_blocks

    one = compute_step(spec.replace(shard="none", nproc=1))
    if unavailable(one) or (one.loss == "fused-linear" and target != "cuda"):
        return None
    try:
        config, family = one.model_config()
        sh = Shape.of(one, config)
        dev = Target(cuda=target == "cuda", kernel=attention_kernel(one, config, target))
        meta = build_model(config, "meta", one.param_dtype)
        blocks = find_blocks(meta)
        block = BLOCK_FORMULAS[ARCHITECTURES[family]](sh, dev, BlockWeights.of(blocks[0], sh))
        output, input_ = meta.get_output_embeddings().weight, meta.get_input_embeddings().weight
        head = head_bytes(sh, dev, output.numel(), tied=output is input_, loss=one.loss)
        embedding = embedding_saved(sh, dev)
    except GcbenchError:
        return None
    group_of = {i: g for g in one.policy.groups(len(blocks)) for i in g}
    stored = [block.input if i in group_of and group_of[i].start == i else 0 if i in group_of else block.saved
              for i in range(len(blocks))]
    checkpointed = sum(1 for i in range(len(blocks)) if i in group_of)
    return Terms(embedding, stored, [i not in group_of for i in range(len(blocks))], block.saved,
                 0 if block.input_in_saved else block.input,
                 block.grad_flow + block.weight_copies + block.attention_half + block.mlp_half + block.mlp_extra,
                 block.grad_flow + block.weight_copies + block.attention_half + block.attention_extra,
                 max(block.attention_half, block.mlp_half),
                 block.grad_flow, head.saved, head.forward_extra, head.backward_extra, head.weight_grad,
                 head.embedding_backward, head.tied_pending,
                 block.weight_copies * checkpointed if sh.amp else 0)
