"""Predict a training step's peak memory without running it: the public face of the two predictors.

Both predict the number a measured run reports for the same RunSpec: on a CUDA target `max_memory_allocated` over
the whole step (`peak_allocated_bytes`), on a CPU target the live-tensor peak (`peak_tracked_bytes`).
- simulate.py runs the real training step on fake tensors (seconds; any policy that runs on fakes).
- analytic.py adds up per-block formulas along the policy's block groups (instant; the classic policies only).
- shape.py holds what both read off a spec (sizes, byte widths, the attention kernel); estimates.py the Estimate
  both return.
The runner asks for a record's predictions through `predict_for_run`; nothing here imports the runner.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from gcbench.compiled import UNPREDICTED
from gcbench.errors import GcbenchError
from gcbench.fields import default_precision
from gcbench.gpus import Gpu, max_memory_reserved
from gcbench.estimators import analytic, fake_ranks, per_rank, plan, sharing, simulate
from gcbench.estimators.caching_allocator import OutOfMemory
from gcbench.estimators.estimates import Estimate, Progress, Unavailable
from gcbench.resolved import ResolvedRun, distinct_runs, resolve
from gcbench.spec import RunSpec, check_grid_size, crossed_out

__all__ = ["METHODS", "TARGETS", "Estimate", "Unavailable", "estimate", "estimate_grid", "estimate_rows",
           "predict_for_run",
           "resolve_plan", "step_flops"]


def resolve_plan(spec: ResolvedRun) -> ResolvedRun:
    """`spec` with the mix of its `plan` policy chosen for its device (estimators/plan.py); any other as it is."""
    return plan.with_mix(spec, spec.device_kind)

# By the module, not the function: binding `analytic` here to the function would hide the submodule of that name.
_PREDICTORS = {"analytic": analytic.analytic, "simulate": simulate.simulate}
METHODS = tuple(_PREDICTORS)
TARGETS = ("cuda", "cpu")  # what is predicted: max_memory_allocated on a CUDA GPU | peak_tracked_bytes on CPU


def estimate(spec: RunSpec | ResolvedRun, method: str = "simulate", target: str = "cuda",
             flops: bool = False, timed: bool = True) -> Estimate:
    """Predict the peak memory of one training step of `spec` on `target` (cuda | cpu) by `method`; `flops`: the
    simulation also counts the step's FLOPs with recompute (Estimate.flops); `timed`: it also keeps the step's work
    for the time model (Estimate.work)."""
    if method not in METHODS:
        raise GcbenchError(f"unknown estimate method {method!r} ({', '.join(METHODS)})")
    if target not in TARGETS:
        raise GcbenchError(f"unknown estimate target {target!r} ({', '.join(TARGETS)})")
    _refuse_compiled(spec)
    spec = plan.with_mix(resolve(spec), target)
    if spec.shard != "none" and method == "simulate" and fake_ranks.available():  # FSDP2 itself, on fakes
        found = simulate.simulate(spec, target, timed=timed)
        return dataclasses.replace(found, flops=step_flops(spec, target)) if flops else found
    if spec.shard != "none":  # per rank: the unsharded step at the rank's batch, and FSDP2's terms
        one_process = spec.replace(shard="none", nproc=1)
        unsharded = estimate(one_process, method, target, flops, timed)
        if spec.precision == "amp-bf16":  # FSDP2 computes on the bf16 parameters it gathers (per_rank.py)
            computed = estimate(per_rank.compute_step(one_process), method, target, flops, timed)
            unsharded = per_rank.computed_in_bf16(unsharded, computed)
        return per_rank.shard_estimate(unsharded, spec)
    if method == "simulate":
        return simulate.simulate(spec, target, flops, timed=timed)
    return _PREDICTORS[method](spec, target)


def step_flops(spec: RunSpec | ResolvedRun, target: str = "cuda") -> int:
    """estimate(spec, "simulate", target, flops=True).flops, the cheapest exact way: the count of a simulation this
    process already ran, else one forward and backward counting FLOPs, nothing else (simulate.count_flops)."""
    _refuse_compiled(spec)
    spec = plan.with_mix(resolve(spec), target)
    if spec.shard != "none":  # the FLOPs of the unsharded step at the rank's batch, as estimate passes them on
        spec = spec.replace(shard="none", nproc=1)
    return simulate.count_flops(spec, target)


def _refuse_compiled(spec: RunSpec | ResolvedRun) -> None:
    """GcbenchError for compiled blocks (--compile blocks): neither method models what inductor's partition saves,
    and the eager step's prediction would be another step's (compiled.UNPREDICTED)."""
    if spec.compile != "none":
        raise GcbenchError(UNPREDICTED)


def estimate_grid(axes: dict[str, Iterable[Any]], methods: Iterable[str], target: str = "cuda",
                  progress: Progress | None = None, capacity: int | None = None, card: Gpu | None = None,
                  timed: bool = True, **spec_fields: Any
                  ) -> list[tuple[ResolvedRun, Estimate | Unavailable]]:
    """Every combination of the `axes` (RunSpec field -> its values: model, seq_len, batch_size, policy, precision,
    optimizer, ...), by every method. All specs are validated before anything runs, so bad input fails at once and
    nothing is half done. A config a method cannot predict is an Unavailable cell (n/a, and why), not an abort;
    where the analytic model cannot and the simulation was not asked for, the simulation predicts it and says what
    it stands in for (Estimate.stands_in). Only a grid of which nothing could be predicted is an error. No precision
    (or "") = bf16 for a CUDA target, fp32 for CPU, as `gcbench run` picks; spec_fields: the same for every config
    (layers, attn). The simulations run side by side where the machine has the cores (sharing.py); `progress` is
    told of each cell predicted. `capacity`: the bytes a card leaves to the caching allocator: each simulated
    cell of a CUDA target then has the allocator replayed on that card (`with_reserved`); `card`: the card named,
    whose cuBLAS workspaces the reserved peak adds (None: Hopper's, gpus.max_memory_reserved); `timed`: the
    simulated cells keep their step's work, which a step time on a card needs (estimate_rows with a card)."""
    methods = list(methods)
    for method in methods:
        if method not in METHODS:
            raise GcbenchError(f"unknown estimate method {method!r} ({', '.join(METHODS)})")
    if target not in TARGETS:
        raise GcbenchError(f"unknown device {target!r} to predict for ({', '.join(TARGETS)})")
    axes = {k: list(v) for k, v in axes.items()}
    axes["precision"] = [p or default_precision(target) for p in axes.get("precision", [""])]
    check_grid_size(axes)
    names = list(axes)
    # device="cpu": the spec must be valid on this machine; the target only tells what to predict
    combos = [dict(zip(names, values)) for values in itertools.product(*axes.values())]
    specs = distinct_runs(((resolve(RunSpec(**fields, device="cpu", **spec_fields)), fields) for fields in combos
                           if not crossed_out(fields, axes)), "predicted")
    jobs = [(spec, method) for spec in specs for method in methods]
    # the longest first, one worker per core, where they differ: the rest share the other core (llama-7b's none,
    # full and sqrtn, 7, 7 and 32 blocks simulated: 9.5 s against 11.0 s with three at once, whole processes on 2
    # cores); all at once where they are alike (sharing_cores)
    simulating = sorted((spec for spec, method in jobs if _simulates(spec, method, methods)),
                        key=simulate.blocks_simulated, reverse=True)
    replays = replays_for(jobs) if capacity and target == "cuda" else 0
    cells = []
    alike = len({simulate.blocks_simulated(spec) for spec in simulating}) < 2
    with sharing.sharing_cores(len(simulating), at_once=alike):
        if progress is not None:
            progress(0, len(jobs) + replays, "")  # the workers are forked: a progress bar may start its thread now
        for spec in simulating:  # begun at once, side by side in the workers; each cell then finds its own kept
            _begin(spec, target, timed)
        for spec, method in jobs:
            cells.append((spec, _predict_cell(spec, method, target, methods, timed)))
            if progress is not None:
                progress(len(cells), len(jobs) + replays, f"{spec.policy} ({method})")
    if replays:
        total = len(jobs) + replays
        cells = with_reserved(cells, capacity, lambda done, text: progress and progress(len(jobs) + done, total,
                                                                                        text), card)
        if progress is not None:
            progress(total, total, "")
    if all(isinstance(cell, Unavailable) for _, cell in cells):
        reasons = dict.fromkeys(cell.reason for _, cell in cells)  # each method's own, once (a missing package)
        raise GcbenchError(f"nothing in this grid can be predicted: {'; '.join(reasons)}")
    return cells


Cells = list[tuple[ResolvedRun, Estimate | Unavailable]]


def estimate_rows(cells: Cells, memory: int | None, gpu_name: str | None, target: str) -> list[dict[str, Any]]:
    """`gcbench estimate`'s rows (--format json prints them): each cell's record, whether it fits `memory`, its
    measured error band (bands.py), its step time on the card `gpu_name` names (step_time.py) and that time's
    measured error band on the card."""
    from gcbench.estimators.bands import band_fields, time_band_fields
    from gcbench.estimators.step_time import grid_time_fields
    from gcbench.gpus import gpu

    card = gpu(gpu_name).name if gpu_name else None
    return [e.as_record(spec) | ({"memory_bytes": memory, "fits": e.fits(memory)} if memory else {})
            | band_fields(spec, e, target) | times
            | (time_band_fields(spec, card, times.get("predicted_host_bound")) if target == "cuda" else {})
            for (spec, e), times in zip(cells, grid_time_fields(cells, gpu_name, target))]


def with_reserved(cells: Cells, capacity: int, progress: Callable[[int, str], Any] | None = None,
                  card: Gpu | None = None) -> Cells:
    """The cells with PyTorch's caching allocator replayed on a card that leaves it `capacity` bytes
    (simulate.replay_allocator), once per config that a cell simulated: its `reserved_bytes`
    (max_memory_reserved as `card` reads it, its cuBLAS workspaces included: gpus.max_memory_reserved), and `runs_out` on every cell of that config, whichever the method, so that a config
    fits or not whatever the row (a sharded config's: rank 0's, FSDP2 itself over a fake world). A config the
    replay does not take (a paged optimizer, a simulation that stood in for the analytic model, a sharded one in a
    process that holds a process group) keeps its peak against the memory."""
    replayed: dict[ResolvedRun, tuple[int | None, bool]] = {}
    for spec in dict.fromkeys(spec for spec, cell in cells if _replayable(spec, cell)):
        if progress is not None:
            progress(len(replayed), f"{spec.policy} (the allocator on the card)")
        try:
            _, allocator = simulate.replay_allocator(plan.with_mix(spec, "cuda"), capacity)
            replayed[spec] = (max_memory_reserved(allocator.peak_reserved, card), False)
        except OutOfMemory:
            replayed[spec] = (None, True)
        except GcbenchError:
            continue
    return [(spec, dataclasses.replace(cell, reserved_bytes=replayed[spec][0] if cell.method == "simulate" else None,
                                       runs_out=replayed[spec][1])
             if spec in replayed and isinstance(cell, Estimate) else cell) for spec, cell in cells]


def replays_for(jobs: Iterable[tuple[ResolvedRun, str]]) -> int:
    """How many configs with_reserved will replay at most (the progress bar's share)."""
    return len({spec for spec, method in jobs if method == "simulate" and _one_process_or_fake(spec)})


def _replayable(spec: ResolvedRun, cell: Estimate | Unavailable) -> bool:
    return isinstance(cell, Estimate) and cell.method == "simulate" and not cell.stands_in and \
        _one_process_or_fake(spec)


def _one_process_or_fake(spec: ResolvedRun) -> bool:
    """Whether the simulation runs the step itself: unsharded, or sharded over a fake world (fake_ranks.py)."""
    return spec.shard == "none" or fake_ranks.available()


def _simulates(spec: ResolvedRun, method: str, methods: list[str]) -> bool:
    """Whether the cell is predicted by the simulation (the analytic one stands in for it only where the
    simulation was not asked for)."""
    if spec.compile != "none":  # refused by estimate: nothing to begin
        return False
    return method == "simulate" or analytic.unavailable(spec) is not None and "simulate" not in methods


def _begin(spec: ResolvedRun, target: str, timed: bool = True) -> None:
    """Begin the simulations estimate(spec, "simulate", target) starts with: a plan's one per kind of block (its
    mix follows from them), else the step's own (a sharded one's, over a fake world, as estimate asks for it)."""
    if isinstance(spec.policy, plan.Plan) and not spec.policy.chosen:
        plan.begin_choice(spec, target)
        return
    simulate.begin(spec if _one_process_or_fake(spec) else spec.replace(shard="none", nproc=1), target,
                   timed=timed)


def begin_prediction(spec: ResolvedRun, target: str) -> None:
    """Begin the simulation predict_for_run(spec, target) will ask for, in a worker inside sharing.sharing_cores
    (else at once): begun for many configs, they run side by side."""
    if spec.compile == "none":  # a compiled config is refused, with nothing begun
        _begin(spec, target)


def _predict_cell(spec: ResolvedRun, method: str, target: str, methods: list[str], timed: bool = True
                  ) -> Estimate | Unavailable:
    reason = analytic.unavailable(spec) if method == "analytic" else None
    if reason is not None and "simulate" in methods:
        return Unavailable(method, target, reason)
    try:
        found = estimate(spec, "simulate" if reason else method, target, timed=timed)
    except GcbenchError as e:
        return Unavailable(method, target, f"{reason}, nor can the simulation: {e}" if reason else str(e))
    return dataclasses.replace(found, stands_in=reason) if reason else found


def predict_for_run(spec: ResolvedRun, target: str | None = None,
                    methods: tuple[str, ...] = ("simulate", "analytic"), cards: tuple[str, ...] = ()
                    ) -> dict[str, Any]:
    """The predictions a run's record carries, made before anything is allocated (an OOM record has them too):
    `predicted_peak_bytes` by the best method that can predict this policy (`prediction_method`; the simulation,
    exact on CPU, first; None when neither can), and each method's own prediction
    (`predicted_peak_bytes_simulate`, `predicted_peak_bytes_analytic`; None where it cannot), so that a GPU
    sweep shows both methods' errors. The analytic model is instant; the simulation takes about a second for tiny
    models and seconds for 7B ones. `target`: what to predict for, if not the run's own device (a GPU run's
    prediction made beforehand on a CPU machine). `methods`: those to run, the preferred first; the others' fields
    are None (a run predicts by the simulation only when asked: RunSpec.predict). `cards` (gpus.py names): the
    simulated step's time on each (step_time.py), `predicted_step_ms_by_card`, None for a card without rates; the
    runner keeps its own card's as `predicted_step_ms`."""
    from gcbench.estimators.step_time import time_fields
    from gcbench.gpus import gpu

    target = target or spec.device_kind
    out: dict[str, Any] = {"predicted_peak_bytes": None, "prediction_method": None, "predicted_peak_phase": None}
    work = None
    for method in ("simulate", "analytic"):  # the preferred one first
        if method not in methods:
            out[f"predicted_peak_bytes_{method}"] = None
            continue
        try:
            found = estimate(spec, method, target)
        except GcbenchError:
            found = None
        out[f"predicted_peak_bytes_{method}"] = found.peak_bytes if found else None
        work = work or (found.work if found else None)
        if out["predicted_peak_bytes"] is None and found is not None:
            out.update(predicted_peak_bytes=found.peak_bytes, prediction_method=method,
                       predicted_peak_phase=found.peak_phase)
    if cards:
        tokens = spec.batch_size * spec.seq_len * spec.grad_accum
        out["predicted_step_ms_by_card"] = {card: time_fields(work, tokens, gpu(card))["predicted_step_ms"]
                                            for card in cards}
    return out
