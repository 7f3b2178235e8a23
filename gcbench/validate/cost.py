"""What the plan costs in device seconds, known before any GPU is lent: so that each tier fits one command of the
lent machine and the whole plan fits the time a session gets.

A config costs its start (a child forked warm, its CUDA context and cuBLAS, the model built on the GPU), its
training steps (warm-up, measured, and the untimed passes a run adds: per-phase peaks, saved bytes and FLOPs with
the policy, model FLOPs without it), and for a sharded config torchrun's start. A step's time is the time model's
(estimators/step_time.py) on the card, predicted beforehand with the config's other predictions (`validate
--predict`), with a margin; where none was made, its FLOPs at a fraction of the card's peak. A paired group adds one
process timing every policy in turn. A fit costs its trials.

Every number below is an assumption, named and chosen high where unsure: the plan must overestimate rather than
overrun a command. Each record of a run carries `config_wall_ms` (what the config took, seen from the sweep), and
`benchmarks/plan_cost.py` prices every config of the windows on record as it ran beside that figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gcbench.fields import DEFAULT_MAX_STEPS, DEFAULT_MAX_TIME_S
from gcbench.gpus import gpu
from gcbench.modality import block_config
from gcbench.resolved import ResolvedRun
from gcbench.timing import MIN_STEPS

# The time model's step on the card, times this: without a calibration on the card its host costs and most kernel
# fractions are assumed (estimators/card_rates.py), and the plan must not run short; half as much again. Not always
# enough for the step alone (on the H200's records the stored step was 0.36-0.87 of the measured one): the start,
# assumed high, is what keeps a config's price above what it takes (benchmarks/plan_cost.py).
PLAN_TIME_MARGIN = 1.5
# Where no step time was predicted beforehand: the fraction of the card's dense bf16 peak a step reaches, recompute
# included: eager PyTorch at batch 1 stays well below what compiled, large-batch runs publish; half of 0.4.
PLAN_EFFICIENCY = 0.2
# Launch-bound floor of a step: an eager block's forward and backward launch a few hundred kernels of ~5-10 us each.
STEP_FLOOR_S_PER_BLOCK = 0.004
# A config's start: fork from the warm fork server (tens of ms), CUDA context and cuBLAS (~1-2 s on an H100),
# the record's bookkeeping; then the model's construction on the GPU (transformers builds and initialises module by
# module in Python: per block, not per byte). Where the card's calibration measured the start (Starts), that instead,
# times PLAN_TIME_MARGIN, plus CHILD_S for what it does not measure: the fork, the prediction looked up, the record
# written, the child's exit (each tens to hundreds of ms).
CONFIG_START_S = 5.0
BUILD_S_PER_BLOCK = 0.15
CHILD_S = 1.0
# Untimed training steps a run adds after the measured ones (runner._measure): per-phase peaks, saved bytes and
# FLOPs under the policy, model FLOPs without it; under --steps auto on CUDA one more, launched after the last timed
# step before the budget stopped it (instruments.CudaInstrument.time_steps).
EXTRA_STEPS = 3
TORCHRUN_START_S = 20.0  # a sharded config: a fresh interpreter per rank, imports, the process group
SWEEP_START_S = 8.0  # a sweep's fork server: imports torch and transformers, builds each model on meta
PROCESS_START_S = 8.0  # a script's interpreter: imports torch (and transformers) cold
PYTEST_START_S = 20.0  # pytest's collection of the whole suite
PER_GPU_TEST_S = 3.0  # a GPU test: tiny models built and stepped a few times
FIT_TRIALS_PER_POLICY = 3  # a search whose prediction is one candidate off: the guess, the next size, one more
# The calibration (gcbench/calibration.py): a config's start first (a forked child imports transformers, makes its
# CUDA context and builds 5 llama-7b blocks: about 10 s), a 10 s soak, 14 matmul shapes and the rest at 3 rounds of
# 20 repetitions (the largest, 8192^3, about 1.5 ms each on an H100), two tiny models' steps for the host costs:
# about 50 s of device time beside its process's start, planned as 75 s; --quick (the smoke plan) a few seconds.
CALIBRATION_S = 75.0
CALIBRATION_QUICK_S = 5.0
FIT_PROBE_S = 8.0  # the fit's budget: a probe process reads the free memory once its CUDA context exists
DEFAULT_CARD = "h100-80gb"


@dataclass(frozen=True)
class Cost:
    """Device seconds of one step, and how many configs (or trials) it runs."""

    seconds: float
    configs: int


def step_flops(spec: ResolvedRun, n_params: int) -> float:
    """FLOPs of one training step: 6 per parameter and token (forward 2, backward 4), a second forward where the
    policy recomputes (every policy but none counted as recomputing all: an upper bound), and attention's
    sequence-squared matmuls (QK^T and AV: 4*b*s^2*d per block forward, twice that backward)."""
    config, _ = spec.model_config()
    tokens = spec.batch_size * spec.seq_len * spec.grad_accum
    recompute = 0 if str(spec.policy) == "none" else 1
    blocks = _blocks(spec)
    hidden = block_config(config).hidden_size  # a vision-language model's: its language model's
    attention = 4 * spec.batch_size * spec.seq_len ** 2 * hidden * blocks * spec.grad_accum
    return (6 + 2 * recompute) * n_params * tokens + (3 + recompute) * attention


@dataclass(frozen=True)
class Starts:
    """A config's start as the card's calibration measured it (gcbench/calibration.py, its `start` line), seconds."""

    context_s: float  # the CUDA context
    cublas_s: float  # cuBLAS's first matmul
    build_fixed_s: float  # the model built on the card: what a cold build pays once
    build_per_block_s: float  # and per block (llama-7b's: the plan's largest blocks)


def measured_starts(path: Path) -> Starts | None:
    """The start the calibration in `path` (results/gpu/<gpu>/calibration.ndjson) measured; None where there is
    no such line (no calibration yet, a --quick one, a start its child could not measure)."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    for line in lines:
        if isinstance(line, dict) and line.get("what") == "start" and not line.get("quick"):
            values = [line.get(name) for name in Starts.__dataclass_fields__]
            if all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                return Starts(*(max(float(v), 0.0) for v in values))
    return None


@dataclass(frozen=True)
class Pricing:
    """What a config's step time comes from: the time model's step on the card, predicted beforehand
    (`predicted_step_s`: the stored prediction of a sweep's config, a fit's `estimate --fit` row scaled to the
    trial's batch; None where none was made), else the FLOPs rule on the card's dense peak (`peak_flops`) with the
    config's parameter count (`params_of`)."""

    peak_flops: float
    params_of: Callable[[ResolvedRun], int]
    predicted_step_s: Callable[[ResolvedRun], float | None] = lambda spec: None
    starts: Starts | None = None  # measured on the card, else CONFIG_START_S and BUILD_S_PER_BLOCK

    def step_seconds(self, spec: ResolvedRun) -> float:
        """The step's seconds as the plan charges them, never under the launch-bound floor."""
        floor = _blocks(spec) * STEP_FLOOR_S_PER_BLOCK
        predicted = self.predicted_step_s(spec)
        if predicted is not None:
            return max(predicted * PLAN_TIME_MARGIN, floor)
        return max(step_flops(spec, self.params_of(spec)) / (self.peak_flops * PLAN_EFFICIENCY), floor)


def measured_steps(spec: ResolvedRun, step_s: float) -> float:
    """Steps a config times: its fixed count, or under --steps auto at most max_steps and max_time_s of steps (at
    least MIN_STEPS)."""
    if spec.measure_steps != "auto":
        return int(spec.measure_steps)
    return min(spec.max_steps or DEFAULT_MAX_STEPS,
               max(MIN_STEPS, (spec.max_time_s or DEFAULT_MAX_TIME_S) / step_s)) + 1  # the untimed one after


def _blocks(spec: ResolvedRun) -> int:
    """The model's blocks, every stack's (an encoder-decoder's encoder and decoder)."""
    from gcbench.blocks import total_blocks

    return total_blocks(spec.model_config()[0])


def start_seconds(spec: ResolvedRun, starts: Starts | None = None) -> float:
    """A config's start before its first step: the child, its CUDA context, the model built (torchrun's ranks);
    as `starts` measured it where given."""
    blocks = _blocks(spec)
    torchrun = TORCHRUN_START_S if spec.shard != "none" else 0.0
    assumed = CONFIG_START_S + BUILD_S_PER_BLOCK * blocks
    if starts is None:
        return assumed + torchrun
    measured = starts.context_s + starts.cublas_s + starts.build_fixed_s + starts.build_per_block_s * blocks
    # Until a window's records have checked the measured start (benchmarks/plan_cost.py), it may only raise the
    # assumed one: what it leaves out (a sweep's first config took 13-14 s on the H200, a QLoRA base's quantisation)
    # would let a command overrun, and a command that overruns loses its archive.
    return max(assumed, CHILD_S + PLAN_TIME_MARGIN * measured) + torchrun


def config_seconds(spec: ResolvedRun, pricing: Pricing) -> float:
    """One config run as a sweep runs it (unpaired)."""
    step_s = pricing.step_seconds(spec)
    return start_seconds(spec, pricing.starts) + steps_per_config(spec, step_s) * step_s


def steps_per_config(spec: ResolvedRun, step_s: float) -> float:
    """The training steps the model counts for a config (warm-up, measured, untimed): what a record's own count
    must not exceed (tests hold the fake GPU's runs to it)."""
    return spec.warmup_steps + measured_steps(spec, step_s) + EXTRA_STEPS


def paired_seconds(specs: list[ResolvedRun], pricing: Pricing) -> float:
    """A paired group's extra process: one model built, each policy warmed up, then rounds of one step per policy
    until the ratios are tight or each policy's time limit passes."""
    steps = [pricing.step_seconds(s) for s in specs]
    warm = sum(s.warmup_steps * t for s, t in zip(specs, steps))
    rounds = sum(measured_steps(s, t) * t for s, t in zip(specs, steps))
    return start_seconds(specs[0], pricing.starts) + warm + rounds


def sweep_cost(specs: list[ResolvedRun], paired: bool, pricing: Pricing, done: Callable[[ResolvedRun], bool],
               oom: Callable[[ResolvedRun], bool] = lambda spec: False) -> Cost:
    """A sweep step: its fork server, each config not yet done, and (paired) each group's paired process. A config
    predicted past the card's memory (`oom`) costs its start; those after it with the same options are skipped."""
    todo = [s for s in specs if not done(s)]
    if not todo:
        return Cost(0.0, 0)
    seconds = SWEEP_START_S
    out_of_memory: set[tuple] = set()
    for spec in todo:
        options = (spec.model, spec.layers, str(spec.policy), spec.optimizer, spec.optim_in_backward, spec.shard)
        if options in out_of_memory:
            continue  # the sweep skips it (a larger config of the same options after an oom; docs/sweeps)
        if oom(spec):
            out_of_memory.add(options)
            seconds += start_seconds(spec, pricing.starts)
            continue
        seconds += config_seconds(spec, pricing)
    todo = [s for s in todo if not oom(s)]
    if paired:
        groups: dict[tuple, list[ResolvedRun]] = {}
        for spec in todo:
            groups.setdefault((spec.model, spec.layers, spec.seq_len, spec.batch_size), []).append(spec)
        seconds += sum(paired_seconds(g, pricing) for g in groups.values() if len(g) > 1)
    return Cost(seconds, len(todo))


def fit_cost(trial_specs: Iterable[ResolvedRun], pricing: Pricing) -> Cost:
    """A fit: its budget probe, then FIT_TRIALS_PER_POLICY trials per policy (each spec given: one policy at its
    expected size) less the trials already recorded (the caller passes only what is left)."""
    specs = list(trial_specs)
    if not specs:
        return Cost(0.0, 0)
    seconds = FIT_PROBE_S + SWEEP_START_S + sum(config_seconds(s, pricing) for s in specs)
    return Cost(seconds, len(specs))


def script_cost(name: str, gpu_tests: int = 0, overhead_steps: float = 0.0, quick: bool = False) -> Cost:
    """A script step: the GPU tests (their count), the harness-overhead benchmark (its steps' seconds), the
    calibration, or a short script."""
    if name == "gpu-tests":
        return Cost(PYTEST_START_S + PER_GPU_TEST_S * gpu_tests, gpu_tests)
    if name == "calibration":
        return Cost(PROCESS_START_S + (CALIBRATION_QUICK_S if quick else CALIBRATION_S), 1)
    return Cost(PROCESS_START_S + overhead_steps, 1)


def assumptions(card: str, timed: int, configs: int, starts: Starts | None = None) -> list[str]:
    """The dry run's lines on what the plan assumes: `timed` of its `configs` have a step time predicted; `starts`:
    the start the card's calibration measured, if any."""
    start = f"{CONFIG_START_S:g} s start + {BUILD_S_PER_BLOCK:g} s per block" + (
        f" (or, if more, the card's calibrated start x {PLAN_TIME_MARGIN:g} + {CHILD_S:g} s)" if starts else "")
    return [f"assumed: steps at the time model's prediction for {card} x {PLAN_TIME_MARGIN:g}",
            f"  ({timed} of {configs} configs; the rest at {PLAN_EFFICIENCY:g} x the dense bf16 peak),",
            f"  {start} per config, {FIT_TRIALS_PER_POLICY} trials per fit policy", "  (gcbench/validate/cost.py)"]


def card_peak(card: str | None) -> float:
    return gpu(card or DEFAULT_CARD).peak_flops


def commands_for(seconds: float, limit: float) -> int:
    """How many commands of at most `limit` seconds a tier needs (each stops at its deadline between configs)."""
    return max(1, math.ceil(seconds / limit)) if seconds > 0 else 0
