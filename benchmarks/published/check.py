"""Replay published GPU memory measurements through gcbench's estimator (issue 31, item 1).

    python benchmarks/published/check.py [--method simulate|analytic] [--rows rows.toml]
    python benchmarks/published/check.py --time [--rows speed.toml]    # published step times (speed.py)

Reads rows.toml (one published number per row, with its source, quote and every setting the source states) and,
for each row that gcbench can express, predicts the figure the source published:
- allocated: torch.cuda.max_memory_allocated over the step = Estimate.peak_bytes;
- reserved: torch.cuda.max_memory_reserved, the caching allocator replayed (simulate.replay_allocator)
  where one process runs;
- device (nvidia-smi's used memory): reserved + the CUDA context + the cuBLAS workspaces, with the context the
  source itself measured (a row's context_mib) or else the card's (gpus.Gpu.context: measured where gcbench has run
  on the card, else gpus.CUDA_CONTEXT_BYTES assumed) and the
  per-card workspace size (gpus.Gpu.workspace_bytes, from
  aten/src/ATen/cuda/CublasHandlePool.cpp), both cited in gcbench/gpus.py; not expressible where reserved is not
  predicted or the card is not in gpus.GPUS.
It prints one line per predicted row (published, predicted, signed error), then
`median |error| <m>% max <x>% over <n> rows`, then the rows it cannot express and the rejected ones, one line each
with why. A test of the estimator, never a tuning set: nothing here or in gcbench is fitted to these rows.
Exit status 0 when every row was either predicted or listed with its reason; 2 on a malformed rows file.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))  # legacy.py, beside it, when this file is imported from elsewhere

import legacy  # noqa: E402  (benchmarks/published/legacy.py)
import table  # noqa: E402  (benchmarks/published/table.py)
from gcbench.errors import GcbenchError  # noqa: E402
from gcbench.text import plain  # noqa: E402

UNITS = {"GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20}
FIGURES = ("allocated", "reserved", "device")
REQUIRED = ("id", "source", "quote", "figure", "figure_source", "value", "unit", "gpu", "model", "seq",
            "micro_batch", "precision", "optimizer", "checkpointing", "sharding", "adapter", "implementation")
SHORT = {"allocated": "alloc", "reserved": "resv", "device": "smi"}
WIDTH = 80


@dataclass
class Outcome:
    """One row's result: predicted (error_pct set), not expressible (reason) or rejected (reason)."""

    row: dict[str, Any]
    status: str  # predicted | not_expressible | rejected
    published_bytes: float
    predicted_bytes: int | None = None
    reason: str | None = None

    @property
    def error_pct(self) -> float | None:
        if self.predicted_bytes is None:
            return None
        return 100.0 * (self.predicted_bytes - self.published_bytes) / self.published_bytes


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of `path`, each checked for the fields every row carries; GcbenchError naming the first bad one."""
    rows = table.read_rows(path, REQUIRED, "published rows")
    for row in rows:
        name = plain(row["id"])
        if row["unit"] not in UNITS:
            raise GcbenchError(f"{plain(path)}: {name}: unit {plain(row['unit'])!r} is not one of {', '.join(UNITS)}")
        table.check_versions(path, row)
        context = row.get("context_mib", 1)
        if isinstance(context, bool) or not isinstance(context, (int, float)) or not 0 < context < 2**20:
            raise GcbenchError(f"{plain(path)}: {name}: context_mib {plain(context)!r} is not a number of MiB")
        if "spec" in row and row["figure"] not in FIGURES:
            raise GcbenchError(f"{plain(path)}: {name}: a predicted row's figure must be one of {', '.join(FIGURES)}")
    return rows


def published_bytes(row: dict[str, Any]) -> float:
    return float(row["value"]) * UNITS[row["unit"]]


def predict(row: dict[str, Any], method: str, base: Path) -> Outcome:
    """The row's outcome: the estimator's figure for it, or why it cannot give one."""
    pub = published_bytes(row)
    if "rejected" in row:
        return Outcome(row, "rejected", pub, reason=row["rejected"])
    if "not_expressible" in row:
        return Outcome(row, "not_expressible", pub, reason=row["not_expressible"])
    fields = dict(row["spec"])
    fields["model"] = str((base / fields["model"]).resolve())
    # what the row's older torch and transformers kept for backward, where it differs from today's
    with legacy.replayed(row.get("torch"), row.get("transformers")):
        return _predicted(row, pub, fields, method)


def _predicted(row: dict[str, Any], pub: float, fields: dict[str, Any], method: str) -> Outcome:
    from gcbench.estimators import estimate
    from gcbench.spec import RunSpec

    try:
        found = estimate(RunSpec(**fields, device="cpu"), method, "cuda")
    except GcbenchError as e:
        return Outcome(row, "not_expressible", pub, reason=f"gcbench: {e}")
    except TypeError as e:  # a spec key RunSpec does not have
        raise GcbenchError(f"{plain(row['id'])}: bad spec: {plain(e)}") from None
    if row["figure"] == "allocated":
        return Outcome(row, "predicted", pub, found.peak_bytes)
    if method != "simulate":
        return Outcome(row, "not_expressible", pub, reason="reserved memory is predicted by simulate only (the "
                                                           "caching allocator replayed on the simulated step)")
    from gcbench.estimators.simulate import replay_allocator

    # the caching allocator replayed on the step (a sharded row's: rank 0's, FSDP2 itself over a fake world)
    reserved = replay_allocator(RunSpec(**fields, device="cpu"))[1].peak_reserved
    return _on_card(row, pub, reserved)


def _on_card(row: dict[str, Any], pub: float, reserved: int) -> Outcome:
    """max_memory_reserved: the replayed allocator's, plus the card's cuBLAS workspaces (allocated through the
    caching allocator, one per thread that runs matmuls: gcbench/gpus.py); nvidia-smi's figure adds the CUDA
    context."""
    from gcbench import gpus

    card = gpus.matching(row["gpu"])
    if card is None:
        return Outcome(row, "not_expressible", pub, reason=f"GPU {row['gpu']!r} is not in gcbench/gpus.py: its "
                                                           "cuBLAS workspace size is not known")
    context = 0 if row["figure"] != "device" else card.context if "context_mib" not in row else \
        int(row["context_mib"] * UNITS["MiB"])  # the source's own reading of its context, where it gives one
    return Outcome(row, "predicted", pub, gpus.max_memory_reserved(reserved, card) + context)


def summary(outcomes: list[Outcome]) -> str:
    errors = [abs(o.error_pct) for o in outcomes if o.status == "predicted"]
    if not errors:
        return "median |error| n/a max n/a over 0 rows"
    return f"median |error| {statistics.median(errors):.1f}% max {max(errors):.1f}% over {len(errors)} rows"


def _amount(nbytes: float, unit: str) -> str:
    return f"{nbytes / UNITS[unit]:.2f} {unit}"


def report(outcomes: list[Outcome], method: str) -> str:
    """The table (80 columns), the summary line, then the unexpressed and rejected rows, one line each."""
    lines = [f"Published GPU memory vs gcbench's estimate (--method {method})",
             "fig: alloc = max_memory_allocated, resv = max_memory_reserved,",
             "     smi = nvidia-smi (predicted as reserved + CUDA context + cuBLAS workspaces)",
             "", f"{'row':<34} {'fig':<5} {'published':>12} {'predicted':>12} {'error':>8}",
             "-" * WIDTH]
    for o in outcomes:
        if o.status != "predicted":
            continue
        unit = o.row["unit"]
        name = plain(o.row["id"])
        name = name if len(name) <= 34 else name[:33] + "~"
        lines.append(f"{name:<34} {SHORT[o.row['figure']]:<5} {_amount(o.published_bytes, unit):>12} "
                     f"{_amount(o.predicted_bytes, unit):>12} {o.error_pct:>+7.1f}%")
    lines += ["-" * WIDTH, summary(outcomes)]
    for status, title in (("not_expressible", "not expressible"), ("rejected", "rejected (physically impossible)")):
        chosen = [o for o in outcomes if o.status == status]
        if chosen:
            lines += ["", f"{title} ({len(chosen)}):"]
            lines += [f"  {plain(o.row['id'])}: {plain(o.reason)}" for o in chosen]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default=None, choices=("simulate", "analytic"),
                        help="the estimator (default simulate: the one every family has; --time: simulate only)")
    parser.add_argument("--rows", type=Path, default=None, help="the rows file (default rows.toml; speed.toml "
                                                                "with --time)")
    parser.add_argument("--time", action="store_true", help="the published step times, through the time model")
    args = parser.parse_args(argv)
    if args.time:
        if args.method not in (None, "simulate"):
            print("check.py: --time plays the simulated step on the card: --method simulate only", file=sys.stderr)
            return 2
        return _time(args.rows or HERE / "speed.toml")
    args.rows, args.method = args.rows or HERE / "rows.toml", args.method or "simulate"
    if importlib.util.find_spec("peft") is None:  # most predicted rows are LoRA runs: not a modelling limit
        print("check.py: the LoRA rows need peft: pip install -e '.[peft]'", file=sys.stderr)
        return 2
    try:
        rows = load_rows(args.rows)
        outcomes = [predict(row, args.method, args.rows.resolve().parent) for row in rows]
    except GcbenchError as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 2
    print(report(outcomes, args.method))
    return 0


def _time(path: Path) -> int:
    import speed  # benchmarks/published/speed.py

    try:
        rows = speed.load_rows(path)
        outcomes = [speed.predict(row, path.resolve().parent) for row in rows]
    except GcbenchError as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 2
    print(speed.report(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
