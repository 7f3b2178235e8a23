"""A model of many alike blocks simulated from two short ones, exactly: the simulation's time is its number of
ops, and a 32-block model's step has about eight times the ops of a 4-block one.

Why it is exact. Let the blocks be alike (the same modules, shapes and settings: `alike_blocks`), treated alike by
the policy (Policy.alike_blocks), talking to each other only through the hidden states they pass on, with one
micro-batch. At any moment of the step, each block that is not running is in one of a few states and holds the same
bytes as every other block in that state: before its forward (parameters, gradients, optimizer state), after it
(that and what it saved for backward), after its backward (without what it saved), before or after its optimizer
update. So the live bytes at a moment counted from the first block or from the last are a line in the number of
blocks L, whose slope is what one block holds in some state; and each state is the state of every block at a phase
boundary (the start of the forward, of the backward, of the optimizer step, the end), where the live bytes are lines
too. A phase's peak P(L) is the highest of its moments' lines: convex, with slopes at most sigma, the steepest of
its two boundaries' slopes. If P(4) - P(3) = sigma, the line of the moment that peaks at 4 has slope sigma (a
smaller one could not climb by sigma), and no line passes it later: P(L) = P(4) + (L - 4) * sigma for every L >= 4.
Blocks 0 and L-1 may differ from the others (the embedding's output, the last norm's input): from 3 blocks on there
is one of each kind, so 3 and 4 blocks have the same set of lines.
A multi-tensor optimizer step (one op over all parameters, the same ops allocating for any L) puts every block in
the state of each op at once: there, each op's own high-water mark is a line, taken op by op. An optimizer that updates one tensor
at a time goes through the two boundary states only.
One state escapes the boundaries: under autocast, each block that ran keeps its low-precision weight copies in
autocast's cache until the forward ends, and the cache is gone by the backward's boundary. A block that saves
those copies for backward (no checkpoint, or only the attention core recomputed) still shows them there; under
any other policy amp is simulated whole (a reviewer measured the forward climbing by one block's bf16 weights more
than sigma).
Anything else is simulated whole: blocks unlike (a local/global pattern, dense and MoE layers, per-layer router
outputs, adapter targets in some blocks only), a policy that treats blocks differently (sqrtn, every-k, plan),
micro-batches, too few blocks to gain, and any phase whose peak at 3 and 4 blocks is not on its steepest line. tests/test_layer_scaling.py holds the result
to a whole simulation, field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from gcbench.adapters import apply_adapter, compute_dtype, parse_adapter
from gcbench.errors import GcbenchError
from gcbench.estimators.estimates import Estimate
from gcbench.estimators.step_time import StepWork
from gcbench.modality import image_classifier
from gcbench.models import build_model, find_blocks, stack_sizes
from gcbench.resolved import ResolvedRun
from gcbench.results.schema import peak_phase

SHORT = (3, 4)  # blocks of the two short simulations: from 3 on, a first, an interior and a last block
FEWEST = 8  # below this many blocks the two short simulations (7 blocks) would not be faster than the whole one
# config keys that make a model gather something from every block (MoE router outputs for its auxiliary loss) or
# make its blocks differ (experts on some layers only): such a model is simulated whole
_UNLIKE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "output_router_logits")


@dataclasses.dataclass
class StepTrace:
    """What a simulation's tracked step leaves beside its peaks: the live bytes as each phase starts ("end": after
    the step), and the high-water mark of each op of the optimizer phase that allocates, with the op's name."""

    at: dict[str, int] = dataclasses.field(default_factory=dict)
    optimizer_highs: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    def clear(self) -> None:
        self.at.clear()
        self.optimizer_highs.clear()

    def marking(self, phases: Callable[[str], None], tracker: Any) -> Callable[[str], None]:
        """The step's `mark`: `phases`' own, noting the tracker's live bytes at each boundary, and its per-op highs
        (AllocatorModel.highs) through the optimizer phase."""
        def mark(phase: str) -> None:
            tracker.highs = None
            phases(phase)
            self.at[phase] = tracker.current
            if phase == "optimizer":
                tracker.highs = self.optimizer_highs

        return mark


def blocks_to_scale(spec: ResolvedRun) -> int | None:
    """The model's number of blocks where its simulation can be made from two short ones, else None."""
    config = spec.model_config()[0]
    if len(stack_sizes(config)) > 1 or image_classifier(config):  # simulated whole
        return None
    n = config.num_hidden_layers
    if n < FEWEST or spec.grad_accum != 1 or spec.shard != "none":
        return None
    if not all(spec.policy.alike_blocks(k) for k in (*SHORT, n)):
        return None
    # autocast keeps each block's low-precision weight copies in its cast cache until the forward ends, and the
    # backward's boundary comes after: a state no boundary reads, unless the block saves those copies itself, as
    # it does without checkpointing (none) or recomputing only the attention core (attn), which holds no weights
    if spec.autocast_dtype is not None and spec.policy.name not in ("none", "attn"):
        return None
    if any(getattr(config, key, None) for key in _UNLIKE_KEYS):
        return None
    if any(isinstance(v, list) and len(v) == n and len(set(map(repr, v))) > 1 for v in vars(config).values()):
        return None  # a per-block list that varies: Gemma's local/global layers, Qwen's sliding ones
    key = (config.to_json_string(use_diff=False), spec.param_dtype, spec.adapter, compute_dtype(spec))
    if key not in _ALIKE:  # a fit asks for every size it tries; the meta model is built once per config
        # with the adapter: targets naming one block's modules make that block unlike the others
        try:
            model = apply_adapter(build_model(config, "meta", spec.param_dtype), parse_adapter(spec.adapter),
                                  compute_dtype(spec), "meta")
        except GcbenchError:  # the whole simulation meets it and says why
            return None
        _ALIKE[key] = alike_blocks(model)
    return n if _ALIKE[key] else None


_ALIKE: dict[tuple, bool] = {}


def alike_blocks(model: torch.nn.Module) -> bool:
    """Every block the same: module classes, parameter and buffer shapes and dtypes, and every plain setting each
    module holds (a sliding window, a layer type) but its own index."""
    return len({_fingerprint(block) for block in find_blocks(model)}) == 1


def _fingerprint(block: torch.nn.Module) -> tuple:
    def settings(module: torch.nn.Module) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in vars(module).items() if not k.startswith("_")
                            and k not in ("layer_idx", "layer_id", "training")
                            and isinstance(v, (int, float, str, bool, type(None), tuple))))

    def tensors(items) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype) for name, t in items)

    return tuple((name, type(m).__qualname__, settings(m), tensors(m.named_parameters(recurse=False)),
                  tensors(m.named_buffers(recurse=False))) for name, m in block.named_modules())


def scaled(n: int, short: list[tuple[Estimate, StepTrace]]) -> Estimate | None:
    """The simulation of `n` blocks from those of SHORT blocks (each an Estimate and its StepTrace); None where a
    phase's peak is not proven (the module docstring)."""
    (e3, t3), (e4, t4) = short
    peaks = {}
    for phase, start, end in (("forward", "forward", "backward"), ("backward", "backward", "optimizer"),
                              ("optimizer", "optimizer", "end")):
        p3, p4 = (getattr(e, f"{phase}_peak_bytes") for e in (e3, e4))
        if p3 is None or p4 is None:
            if p3 is not p4:
                return None
            peaks[phase] = None
            continue
        if end not in t3.at:  # no optimizer phase (no optimizer, or one stepped in backward): the step's end
            end = "end"
        if any(t.at.get(b) is None for t in (t3, t4) for b in (start, end)):
            return None
        if phase == "optimizer" and [op for op, _ in t3.optimizer_highs] == [op for op, _ in t4.optimizer_highs]:
            # the same allocating ops at 3 and 4 blocks (multi-tensor): each op's high a line of its own, and the
            # phase's start (its peak begins there)
            points = [*((a, b) for (_, a), (_, b) in zip(t3.optimizer_highs, t4.optimizer_highs)),
                      (t3.at[start], t4.at[start])]
            if max(a for a, _ in points) != p3 or max(b for _, b in points) != p4:
                return None  # the trace does not account for the peak
            peaks[phase] = max(_line(n, a, b) for a, b in points)
            continue
        sigma = max(t4.at[start] - t3.at[start], t4.at[end] - t3.at[end])
        if p4 - p3 != sigma:
            return None
        peaks[phase] = p4 + (n - SHORT[1]) * sigma

    def line(field: str) -> Any:
        a, b = getattr(e3, field), getattr(e4, field)
        return None if a is None or b is None else _line(n, a, b)

    peak = max(p for p in peaks.values() if p is not None)
    parts = [line(f) for f in ("param_bytes", "grad_bytes", "optimizer_bytes")]
    return dataclasses.replace(
        e4, peak_bytes=peak, param_bytes=parts[0], grad_bytes=parts[1], optimizer_bytes=parts[2],
        activation_bytes=peak - sum(parts), peak_phase=peak_phase(peaks), forward_peak_bytes=peaks["forward"],
        backward_peak_bytes=peaks["backward"], optimizer_peak_bytes=peaks["optimizer"], n_params=line("n_params"),
        flops=line("flops"), optimizer_paged_bytes=line("optimizer_paged_bytes"), seconds=e3.seconds + e4.seconds,
        work=StepWork(scaled_from=(e3.work, e4.work), blocks=n, short=SHORT) if e3.work and e4.work else None)


def scaled_flops(n: int, short: list[int]) -> int:
    """The FLOPs of `n` blocks from those of SHORT blocks: the same ops in every block."""
    return _line(n, *short)


def _line(n: int, at_3: int, at_4: int) -> int:
    """The value at `n` blocks of the line through its values at SHORT blocks."""
    return at_3 + (n - SHORT[0]) * (at_4 - at_3)
