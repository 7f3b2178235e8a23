"""Per-rank memory of an FSDP2 run (--shard fsdp2 --nproc N), from the prediction of the unsharded step at the
same per-rank batch (either method) and FSDP2's own terms (docs/scale.md, "The per-rank memory model"):

- model state: parameters, gradients and optimizer state, 1/N of the unsharded bytes each (DTensor shards);
- the root's parameters (embeddings, final norm, head), gathered before the forward and kept gathered until the
  backward ends (FSDP2 does not reshard the root after forward), and in backward their unsharded gradients;
- two units' gathered parameters: the one computing and the next, prefetched (forward and backward); a unit is a
  block, or a group policy's whole group (segments, sqrtn: one checkpoint, one FSDP unit);
- in backward, two units' unsharded gradients: the one computing and the one being reduce-scattered (in the
  reduce dtype: fp32 under amp-bf16);
- activations, temporaries and recompute: the unsharded step's at this rank's batch (each rank has its own rows);
- the optimizer step's temporaries: 1/N (it steps the shards).
Bytes are not rounded to FSDP2's padding (each shard of a dimension not divisible by N is padded: at most N-1 rows
per parameter). Under amp-bf16 the unsharded step's bf16 weight copies (autocast's) are kept, although FSDP2
gathers bf16 parameters and autocast then copies nothing: likely an overestimate there, not yet measured. This is a
model, not a simulation: no fake process group runs FSDP2 itself here.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gcbench.estimators.estimates import Estimate

GATHERED_BLOCKS = 2  # computing + prefetched (FSDP2's default: one block ahead, forward and backward)
UNSHARDED_GRAD_BLOCKS = 2  # computing + reduce-scattering


def shard_estimate(unsharded: Estimate, spec) -> Estimate:
    """The per-rank prediction of `spec` (shard fsdp2, nproc N) from `unsharded`, the same step's prediction in
    one process at the same per-rank batch."""
    world = spec.nproc
    root, block, n_blocks = _root_and_block_params(spec)
    # FSDP's unit: a block, or a group policy's whole group (fsdp.shard_model makes each group one unit)
    block *= max((len(group) for group in spec.policy.groups(n_blocks)), default=1)
    gathered = 2 if spec.precision == "amp-bf16" else torch.tensor([], dtype=spec.param_dtype).element_size()
    reduced = 4 if spec.precision == "amp-bf16" else gathered
    static = unsharded.param_bytes + unsharded.grad_bytes + unsharded.optimizer_bytes
    static_rank = math.ceil(static / world)
    forward_extra = (root + GATHERED_BLOCKS * block) * gathered
    backward_extra = forward_extra + root * gathered + UNSHARDED_GRAD_BLOCKS * block * reduced

    def rank_peak(phase_peak: int, extra: int) -> int:
        return static_rank + (phase_peak - static) + extra

    forward = rank_peak(unsharded.forward_peak_bytes, forward_extra)
    backward = rank_peak(unsharded.backward_peak_bytes, backward_extra)
    optimizer = None if unsharded.optimizer_peak_bytes is None else \
        static_rank + math.ceil((unsharded.optimizer_peak_bytes - static) / world)
    phases = {"forward": forward, "backward": backward, **({"optimizer": optimizer} if optimizer is not None else {})}
    phase = max(phases, key=phases.get)
    return dataclasses.replace(
        unsharded, peak_bytes=phases[phase], peak_phase=phase, forward_peak_bytes=forward,
        backward_peak_bytes=backward, optimizer_peak_bytes=optimizer,
        param_bytes=math.ceil(unsharded.param_bytes / world), grad_bytes=math.ceil(unsharded.grad_bytes / world),
        optimizer_bytes=math.ceil(unsharded.optimizer_bytes / world),
        activation_bytes=phases[phase] - static_rank)


def _root_and_block_params(spec) -> tuple[int, int, int]:
    """(parameters outside the blocks, parameters of the largest block, blocks), from a meta-device build."""
    from gcbench.models import build_meta_model, count_params, find_blocks

    config, _ = spec.model_config()
    model = build_meta_model(config)
    blocks = find_blocks(model)
    block = max(count_params(b) for b in blocks)
    return count_params(model) - sum(count_params(b) for b in blocks), block, len(blocks)
