"""Published step times replayed through gcbench's step-time model: `check.py --time` (issue 47, item 5).

Each row of speed.toml that gcbench can express is simulated on a CPU (the same fake-CUDA step that predicts
memory: estimators/simulate.py, with the older libraries a row names replayed: legacy.py), and the work the step
clock wrote down is played on the row's card (estimators/step_time.py on card_rates.rates_for: the datasheet in
gcbench/gpus.py and, where no calibration ran on the card, the stated default fractions and host costs). The
published figure becomes a time per optimizer step:
- runtime_s_for_steps: the runtime over its optimizer_steps (a runtime that includes the first steps' warm-up, as
  a Trainer's train_runtime does, stays in: the row says so in figure_source);
- samples_per_s: micro_batch x grad_accum samples per optimizer step;
- tokens_per_s, tokens_per_s_per_gpu: micro_batch x grad_accum x seq_len tokens per step (per GPU);
- step_ms: as published.
A test of the model, never a tuning set: nothing here or in gcbench is fitted to these rows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import legacy  # noqa: E402  (benchmarks/published/legacy.py, beside this file)
import table  # noqa: E402  (benchmarks/published/table.py)
from gcbench.errors import GcbenchError
from gcbench.text import plain

# each figure with the units it may be published in, and their size in its base unit (s, samples/s, ...)
FIGURES = {"runtime_s_for_steps": {"s": 1.0, "min": 60.0}, "samples_per_s": {"samples/s": 1.0},
           "tokens_per_s": {"tokens/s": 1.0}, "tokens_per_s_per_gpu": {"tokens/s/GPU": 1.0}, "step_ms": {"ms": 1.0}}
REQUIRED = ("id", "source", "quote", "figure", "figure_source", "value", "unit", "gpu", "model", "seq",
            "micro_batch", "grad_accum", "precision", "optimizer", "checkpointing", "sharding", "adapter")
WIDTH = 80


@dataclass
class Outcome:
    """One row's result: predicted (error_pct set), not expressible (reason) or rejected (reason)."""

    row: dict[str, Any]
    status: str  # predicted | not_expressible | rejected
    published_ms: float | None = None  # per optimizer step
    predicted_ms: float | None = None
    reason: str | None = None
    basis: str | None = None  # what the card's rates come from (card_rates.Rates.basis)

    @property
    def error_pct(self) -> float | None:
        if self.predicted_ms is None or not self.published_ms:
            return None
        return 100.0 * (self.predicted_ms - self.published_ms) / self.published_ms


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of `path`, each checked whole; GcbenchError naming the first bad one."""
    rows = table.read_rows(path, REQUIRED, "published speed rows")
    for row in rows:
        name = plain(row["id"])
        if row["figure"] not in FIGURES:
            raise GcbenchError(f"{plain(path)}: {name}: figure {plain(row['figure'])!r} is not one of "
                               f"{', '.join(FIGURES)}")
        if "spec" not in row:
            continue
        if row["unit"] not in FIGURES[row["figure"]]:
            raise GcbenchError(f"{plain(path)}: {name}: unit {plain(row['unit'])!r} is not one of "
                               f"{', '.join(FIGURES[row['figure']])} for {row['figure']}")
        if row["figure"] != "tokens_per_s_per_gpu" and row.get("n_gpus", 1) != 1:
            raise GcbenchError(f"{plain(path)}: {name}: a predicted {row['figure']} row runs on one GPU (n_gpus 1)")
        value = row["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise GcbenchError(f"{plain(path)}: {name}: value {plain(value)!r} is not a positive number")
        steps = row.get("optimizer_steps")
        if row["figure"] == "runtime_s_for_steps" and (isinstance(steps, bool) or not isinstance(steps, int)
                                                       or steps < 1):
            raise GcbenchError(f"{plain(path)}: {name}: a runtime row needs optimizer_steps, a positive integer")
        table.check_versions(path, row)
    return rows


def published_ms(row: dict[str, Any]) -> float:
    """The row's figure as milliseconds per optimizer step (module docstring)."""
    value, spec = float(row["value"]) * FIGURES[row["figure"]].get(row.get("unit"), 1.0), row["spec"]
    samples = int(spec.get("batch_size", 1)) * int(spec.get("grad_accum", 1))
    return {"runtime_s_for_steps": lambda: value * 1e3 / row["optimizer_steps"],
            "samples_per_s": lambda: samples / value * 1e3,
            "tokens_per_s": lambda: samples * int(spec["seq_len"]) / value * 1e3,
            "tokens_per_s_per_gpu": lambda: samples * int(spec["seq_len"]) / value * 1e3,
            "step_ms": lambda: value}[row["figure"]]()


def predict(row: dict[str, Any], base: Path) -> Outcome:
    """The row's outcome: the time model's step on the row's card, or why there is none."""
    if "rejected" in row:
        return Outcome(row, "rejected", reason=row["rejected"])
    if "not_expressible" in row:
        return Outcome(row, "not_expressible", reason=row["not_expressible"])
    from gcbench.estimators import estimate
    from gcbench.estimators.card_rates import rates_for
    from gcbench.gpus import matching
    from gcbench.spec import RunSpec

    published = published_ms(row)
    rates = rates_for(matching(row["gpu"]))
    if isinstance(rates, str):
        return Outcome(row, "not_expressible", published, reason=f"no rates for {row['gpu']!r}: {rates}")
    fields = dict(row["spec"])
    fields["model"] = str((base / fields["model"]).resolve())
    try:
        with legacy.replayed(row.get("torch"), row.get("transformers")):
            found = estimate(RunSpec(**fields, device="cpu"), "simulate", "cuda")
    except GcbenchError as e:
        return Outcome(row, "not_expressible", published, reason=f"gcbench: {e}")
    except TypeError as e:  # a spec key RunSpec does not have
        raise GcbenchError(f"{plain(row['id'])}: bad spec: {plain(e)}") from None
    if found.work is None:
        return Outcome(row, "not_expressible", published, reason="the simulation wrote down no work to time")
    return Outcome(row, "predicted", published, found.work.time(rates).step_ms, basis=rates.basis)


def summary(outcomes: list[Outcome]) -> str:
    errors = [abs(o.error_pct) for o in outcomes if o.status == "predicted"]
    if not errors:
        return "median |error| n/a max n/a over 0 rows"
    return f"median |error| {statistics.median(errors):.1f}% max {max(errors):.1f}% over {len(errors)} rows"


def report(outcomes: list[Outcome]) -> str:
    """The table (80 columns), the summary line, each card's basis, then the rows not predicted, one line each."""
    lines = ["Published step times vs gcbench's time model (ms per optimizer step)", "",
             f"{'row':<40} {'published':>11} {'predicted':>11} {'error':>8}", "-" * WIDTH]
    for o in outcomes:
        if o.status != "predicted":
            continue
        name = plain(o.row["id"])
        name = name if len(name) <= 40 else name[:39] + "~"
        lines.append(f"{name:<40} {o.published_ms:>8.1f} ms {o.predicted_ms:>8.1f} ms {o.error_pct:>+7.1f}%")
    lines += ["-" * WIDTH, summary(outcomes)]
    bases = dict.fromkeys(o.basis for o in outcomes if o.basis)
    if bases:
        lines += ["", "rates:"] + [f"  {plain(b)}" for b in bases]
    for status, title in (("not_expressible", "not expressible"), ("rejected", "rejected")):
        chosen = [o for o in outcomes if o.status == status]
        if chosen:
            lines += ["", f"{title} ({len(chosen)}):"]
            lines += [f"  {plain(o.row['id'])}: {plain(o.reason)}" for o in chosen]
    return "\n".join(lines)
