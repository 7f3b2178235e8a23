"""How far `estimate` has been from GPU measurements of configs like the one asked about: the error band a CUDA
prediction is shown with (issue 31, item 4).

The measurements are of two kinds, both kept in the repository: gcbench's own runs on a lent GPU
(results/gpu/<gpu>/, each record's max_memory_allocated) and the figures others published
(benchmarks/published/rows.toml, the rows whose figure is max_memory_allocated). `benchmarks/error_bands.py`
predicts each of them with each method, as `estimate` would, and writes the errors, grouped by `class_of`, into
measured_bands.py beside this module. A band is a record of what happened, never a correction: no prediction is
moved by it, and nothing is fitted to the measurements.

A class is what the evidence says decides the error: the model's family (gpt2 misses a cuBLASLt workspace that llama
does not take), the precision (autocast's casts), the adapter (peft's and bitsandbytes' tensors), sharding (the
per-rank model), the attention implementation and the loss (each keeps other tensors: LitGPT's rows, eager attention
and `--loss litgpt`, say nothing of transformers' SDPA and `ce`), the head (a classifier has no vocabulary-wide
logits), the optimizer (each keeps its own state: AdamW's two fp32 moments, Adafactor's factored rows and
columns, bitsandbytes' 8-bit blocks; a band measured under AdamW says nothing of Adafactor) and the method.
Policy and sizes are not in it: within a class the measured errors do not follow them, and a band over all of
them is the worst seen among them. A config whose class has no measurement has no band, and says so ("-"),
rather than borrowing another's.

The step time has its own bands (TIME_BANDS), from the GPU records alone (the published step times are on other
cards, with other settings: benchmarks/published/check.py --time): each record's median step against the time
model's step for the card it ran on. Their class is the memory class with the card and the step's regime in place
of the method (the time follows the simulated step's work whichever method predicted the memory, and the card's
rates, measured or assumed, are the model's input): a band measured on an H200 says nothing of an H100 until that
card's own records come home, nor one of steps whose kernels keep the GPU busy of a step predicted host-bound (the
GPU waiting on Python: a tiny model, where what decides is the host's time per op). Within that, the time errors
still follow the policy and the sizes (a recomputation adds kernels, a short matmul fills fewer SMs): a band over
all of them is the worst seen, wide where the records differ most. Its count is of configs; a config measured
twice (two windows, two files) adds both errors.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from gcbench.adapters import parse_adapter
from gcbench.estimators.estimates import Estimate, Unavailable
from gcbench.losses import parse_loss
from gcbench.resolved import ResolvedRun
from gcbench.results.band_words import PEAK_PREFIX, TIME_PREFIX

# family, precision, adapter name, sharding (_sharding), attention implementation, loss name, head, optimizer, method
Class = tuple[str, str, str, str, str, str, str, str, str]
# the card's name (gpus.py), the step's regime (REGIMES), then the memory class less its method
TimeClass = tuple[str, str, str, str, str, str, str, str, str, str]
REGIMES = {False: "kernel-bound", True: "host-bound"}  # by the time model's predicted_host_bound


@dataclass(frozen=True)
class Band:
    """The errors (signed, percent) of one method's predictions against the measurements of one class."""

    configs: int
    median_abs_pct: float
    low_pct: float  # the most negative error (under-predicted)
    high_pct: float  # the most positive (over-predicted)

    @property
    def worst_pct(self) -> float:
        return max(abs(self.low_pct), abs(self.high_pct))

    def as_record(self, prefix: str = PEAK_PREFIX) -> dict[str, float | int]:
        return {f"{prefix}_configs": self.configs, f"{prefix}_error_low_pct": self.low_pct,
                f"{prefix}_error_high_pct": self.high_pct}


def class_of(spec: ResolvedRun, method: str) -> Class:
    """The class a config's prediction by `method` belongs to (the module docstring)."""
    config, family = spec.model_config()
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    return (family, spec.precision, parse_adapter(spec.adapter).name, _sharding(spec), attention,
            parse_loss(spec.loss).name, spec.head, spec.optimizer, method)


def time_class_of(spec: ResolvedRun, card: str, host_bound: bool) -> TimeClass:
    """The class of a config's predicted step time on the card named `card`, predicted host-bound or not (the
    module docstring)."""
    return (card, REGIMES[host_bound], *class_of(spec, "simulate")[:-1])


def _sharding(spec: ResolvedRun) -> str:
    """none, or the sharding and whether over one rank or several: FSDP2 at one rank (its overhead alone) is no
    evidence for the gathers and reductions of many."""
    return spec.shard if spec.shard == "none" else f"{spec.shard}:{'1' if spec.nproc == 1 else 'n'}"


def band_for(spec: ResolvedRun, method: str) -> Band | None:
    """The measured error band of `method` on configs of `spec`'s class, or None where none was measured."""
    from gcbench.estimators.measured_bands import BANDS

    found = BANDS.get(class_of(spec, method))
    return Band(*found) if found else None


def time_band_for(spec: ResolvedRun, card: str, host_bound: bool) -> Band | None:
    """The measured error band of the predicted step time of configs of `spec`'s class on the card named `card` in
    the same regime, or None where none was measured there."""
    from gcbench.estimators.measured_bands import TIME_BANDS

    found = TIME_BANDS.get(time_class_of(spec, card, host_bound))
    return Band(*found) if found else None


def order_error(card: str) -> dict[str, tuple[int, float, float]] | None:
    """How far the time model's ratio of two steps of one window was from the measured one on the records of the
    card named `card` (ORDER_ERRORS: {"within" a class, "across" two: (pairs, median %, 90th percentile %)}), or
    None where none were measured there."""
    from gcbench.estimators.measured_bands import ORDER_ERRORS

    return ORDER_ERRORS.get(card)


def bands(errors: Iterable[tuple[Class, float]]) -> dict[Class, Band]:
    """Each class's band from (class, signed error in percent) pairs (benchmarks/error_bands.py)."""
    grouped: dict[Class, list[float]] = {}
    for key, error in errors:
        grouped.setdefault(key, []).append(error)
    return {key: Band(len(found), round(statistics.median(abs(e) for e in found), 2), round(min(found), 2),
                      round(max(found), 2)) for key, found in sorted(grouped.items())}


def band_fields(spec: ResolvedRun, found: Estimate | Unavailable, target: str) -> dict[str, float | int | None]:
    """What an estimate row carries of its band: nothing for a CPU target (the CPU figures are exact, methodology.md),
    else the band's fields, None (and 0 configs) where its class was never measured or the cell has no prediction
    (every CUDA row has the same keys)."""
    if target != "cuda":
        return {}
    band = band_for(spec, found.method) if isinstance(found, Estimate) else None
    return band.as_record() if band else _no_band(PEAK_PREFIX)


def time_band_fields(spec: ResolvedRun | None, card: str | None, host_bound: bool | None
                     ) -> dict[str, float | int | None]:
    """What a CUDA estimate row carries of its step time's band on the card named `card`: the band's fields, or None
    (and 0 configs) where no step time was predicted (`spec`, `card` or `host_bound` None) or nothing of its class
    was measured on that card."""
    band = time_band_for(spec, card, host_bound) if None not in (spec, card, host_bound) else None
    return band.as_record(TIME_PREFIX) if band else _no_band(TIME_PREFIX)


def _no_band(prefix: str) -> dict[str, float | int | None]:
    return {f"{prefix}_configs": 0, f"{prefix}_error_low_pct": None, f"{prefix}_error_high_pct": None}
