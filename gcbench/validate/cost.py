"""What the plan costs in device seconds, known before any GPU is lent: so that each tier fits one command of the
lent machine and the whole plan fits the time a session gets.

A config costs its start (a child forked warm, its CUDA context and cuBLAS, the model built on the GPU), its
training steps (warm-up, measured, and the untimed passes a run adds: per-phase peaks, saved bytes and FLOPs with
the policy, model FLOPs without it) at a step time from the step's FLOPs, and for a sharded config torchrun's
start. A paired group adds one process timing every policy in turn. A fit costs its trials.

Every number below is an assumption, named and chosen high where unsure: the plan must overestimate rather than
overrun a command. Each record of a run carries `config_wall_ms` (what the config took, seen from the sweep), and
`gcbench validate --import` prints the plan's figure beside the measured one per step, so the first GPU window
checks them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gcbench.fields import DEFAULT_MAX_STEPS, DEFAULT_MAX_TIME_S
from gcbench.gpus import gpu
from gcbench.resolved import ResolvedRun
from gcbench.timing import MIN_STEPS

# The fraction of the card's dense bf16 peak a step reaches, recompute included: eager PyTorch at batch 1 stays well
# below what compiled, large-batch runs publish; estimate --fit assumes 0.4 (fits/predict.py), the plan half that.
PLAN_EFFICIENCY = 0.2
# Launch-bound floor of a step: an eager block's forward and backward launch a few hundred kernels of ~5-10 us each.
STEP_FLOOR_S_PER_BLOCK = 0.004
# A config's start: fork from the warm fork server (tens of ms), CUDA context and cuBLAS (~1-2 s on an H100),
# the record's bookkeeping; then the model's construction on the GPU (transformers builds and initialises module by
# module in Python: per block, not per byte).
CONFIG_START_S = 5.0
BUILD_S_PER_BLOCK = 0.15
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
# The calibration (gcbench/calibration.py): a 10 s soak, 14 matmul shapes and the rest at 3 rounds of 20 repetitions
# (the largest, 8192^3, about 1.5 ms each on an H100), two tiny models' steps for the host costs: about 40 s of
# device time beside its process's start, planned as 60 s; --quick (the smoke plan) a few seconds.
CALIBRATION_S = 60.0
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
    blocks = config.num_hidden_layers
    attention = 4 * spec.batch_size * spec.seq_len ** 2 * config.hidden_size * blocks * spec.grad_accum
    return (6 + 2 * recompute) * n_params * tokens + (3 + recompute) * attention


def step_seconds(spec: ResolvedRun, n_params: int, peak_flops: float) -> float:
    blocks = spec.model_config()[0].num_hidden_layers
    return max(step_flops(spec, n_params) / (peak_flops * PLAN_EFFICIENCY), blocks * STEP_FLOOR_S_PER_BLOCK)


def measured_steps(spec: ResolvedRun, step_s: float) -> float:
    """Steps a config times: its fixed count, or under --steps auto at most max_steps and max_time_s of steps (at
    least MIN_STEPS)."""
    if spec.measure_steps != "auto":
        return int(spec.measure_steps)
    return min(spec.max_steps or DEFAULT_MAX_STEPS,
               max(MIN_STEPS, (spec.max_time_s or DEFAULT_MAX_TIME_S) / step_s)) + 1  # the untimed one after


def config_seconds(spec: ResolvedRun, n_params: int, peak_flops: float) -> float:
    """One config run as a sweep runs it (unpaired)."""
    step_s = step_seconds(spec, n_params, peak_flops)
    blocks = spec.model_config()[0].num_hidden_layers
    start = CONFIG_START_S + BUILD_S_PER_BLOCK * blocks + (TORCHRUN_START_S if spec.shard != "none" else 0)
    return start + (spec.warmup_steps + measured_steps(spec, step_s) + EXTRA_STEPS) * step_s


def steps_per_config(spec: ResolvedRun, step_s: float) -> float:
    """The training steps the model counts for a config (warm-up, measured, untimed): what a record's own count
    must not exceed (tests hold the fake GPU's runs to it)."""
    return spec.warmup_steps + measured_steps(spec, step_s) + EXTRA_STEPS


def paired_seconds(specs: list[ResolvedRun], n_params: int, peak_flops: float) -> float:
    """A paired group's extra process: one model built, each policy warmed up, then rounds of one step per policy
    until the ratios are tight or each policy's time limit passes."""
    first = specs[0]
    blocks = first.model_config()[0].num_hidden_layers
    steps = [step_seconds(s, n_params, peak_flops) for s in specs]
    warm = sum(s.warmup_steps * t for s, t in zip(specs, steps))
    rounds = sum(measured_steps(s, t) * t for s, t in zip(specs, steps))
    return CONFIG_START_S + BUILD_S_PER_BLOCK * blocks + warm + rounds


def sweep_cost(specs: list[ResolvedRun], paired: bool, peak_flops: float,
               params_of: Callable[[ResolvedRun], int], done: Callable[[ResolvedRun], bool],
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
            seconds += CONFIG_START_S
            continue
        seconds += config_seconds(spec, params_of(spec), peak_flops)
    todo = [s for s in todo if not oom(s)]
    if paired:
        groups: dict[tuple, list[ResolvedRun]] = {}
        for spec in todo:
            groups.setdefault((spec.model, spec.layers, spec.seq_len, spec.batch_size), []).append(spec)
        seconds += sum(paired_seconds(g, params_of(g[0]), peak_flops) for g in groups.values() if len(g) > 1)
    return Cost(seconds, len(todo))


def fit_cost(trial_specs: Iterable[ResolvedRun], peak_flops: float,
             params_of: Callable[[ResolvedRun], int]) -> Cost:
    """A fit: its budget probe, then FIT_TRIALS_PER_POLICY trials per policy (each spec given: one policy at its
    expected size) less the trials already recorded (the caller passes only what is left)."""
    specs = list(trial_specs)
    if not specs:
        return Cost(0.0, 0)
    seconds = FIT_PROBE_S + SWEEP_START_S + sum(config_seconds(s, params_of(s), peak_flops) for s in specs)
    return Cost(seconds, len(specs))


def script_cost(name: str, gpu_tests: int = 0, overhead_steps: float = 0.0, quick: bool = False) -> Cost:
    """A script step: the GPU tests (their count), the harness-overhead benchmark (its steps' seconds), the
    calibration, or a short script."""
    if name == "gpu-tests":
        return Cost(PYTEST_START_S + PER_GPU_TEST_S * gpu_tests, gpu_tests)
    if name == "calibration":
        return Cost(PROCESS_START_S + (CALIBRATION_QUICK_S if quick else CALIBRATION_S), 1)
    return Cost(PROCESS_START_S + overhead_steps, 1)


def card_peak(card: str | None) -> float:
    return gpu(card or DEFAULT_CARD).peak_flops


def commands_for(seconds: float, limit: float) -> int:
    """How many commands of at most `limit` seconds a tier needs (each stops at its deadline between configs)."""
    return max(1, math.ceil(seconds / limit)) if seconds > 0 else 0
