"""Write gcbench/estimators/measured_bands.py: each method's prediction errors against every GPU measurement kept in
the repository, grouped by class (gcbench/estimators/bands.py), for the error band `gcbench estimate` shows.

The measurements: the ok single-process records under results/gpu/ (max_memory_allocated; FSDP2 on one rank
included) and the published rows of benchmarks/published/rows.toml whose figure is max_memory_allocated. Each is
predicted as `estimate` predicts it, with each method that can; a method that cannot express a config adds
nothing to its class. The step time's bands (TIME_BANDS): each ok single-process record's median step against the
time model's step on the card it ran on (benchmarks/time_accuracy.py's records and predictions); and per card how far
the predicted ratio of two records' steps of one results file was from the measured one (ORDER_ERRORS), what an
order between two predictions can be trusted to. Rerun after a GPU window or a change to the estimators; the bands
are a record, not a tuning set.

    python benchmarks/error_bands.py          # needs gcbench[peft]; about 2 minutes on 2 cores
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from gcbench.errors import GcbenchError
from gcbench.estimators import estimate
from gcbench.estimators.bands import Band, Class, TimeClass, bands, class_of, time_class_of
from gcbench.gpus import matching
from gcbench.resolved import resolve
from gcbench.results.schema import config_key
from gcbench.spec import RunSpec

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(HERE / "published")]
import check  # noqa: E402  (benchmarks/published/check.py)
from reserved_accuracy import gpu_folders, records, spec_of  # noqa: E402
import time_accuracy  # noqa: E402

METHODS = ("simulate", "analytic")
OUT = ROOT / "gcbench" / "estimators" / "measured_bands.py"


def record_errors() -> list[tuple[Class, float, str]]:
    """(class, signed error %, what was measured) of each GPU record and method."""
    found = []
    for folder in gpu_folders(ROOT):
        for record in records(folder):
            spec = resolve(spec_of(record))
            for method in METHODS:
                try:
                    predicted = estimate(spec, method).peak_bytes
                except GcbenchError:
                    continue
                measured = record["peak_allocated_bytes"]
                found.append((class_of(spec, method), 100 * (predicted / measured - 1), folder.name))
            print(f"{len(found)}: {folder.name}", file=sys.stderr, flush=True)
    return found


class Timed(NamedTuple):
    """One GPU record's step time, predicted and measured, on the card it ran on."""

    key: TimeClass
    error: float  # signed, percent
    config: str  # config_key
    card: str
    window: str  # its results file and the commit that made it: records of one window ran one after another
    predicted_ms: float
    measured_ms: float


def time_errors() -> list[Timed]:
    """Each GPU record's predicted step time, on the card it ran on; a record on a card without the time model's
    rates adds nothing."""
    found = []
    for folder in gpu_folders(ROOT):
        for record in time_accuracy.records(folder):
            step, _, _ = time_accuracy.predict(record)
            card = matching(record["env"]["gpu_name"])
            if step is not None and card is not None:
                spec = resolve(spec_of(record))
                measured = record["step_ms_median"]
                found.append(Timed(time_class_of(spec, card.name, step.host_bound),
                                   100 * (step.step_ms / measured - 1), config_key(spec.as_record()), card.name,
                                   f"{folder.name}/{record['_file']} at {record['env'].get('git_sha')}",
                                   step.step_ms, measured))
        print(f"{len(found)} step times: {folder.name}", file=sys.stderr, flush=True)
    return found


def time_bands(found: list[Timed]) -> dict[TimeClass, Band]:
    """bands() of the step times, each counting its configs: a config measured twice adds both its errors to the
    band and one to the count."""
    configs: dict[TimeClass, set[str]] = {}
    for t in found:
        configs.setdefault(t.key, set()).add(t.config)
    return {key: dataclasses.replace(band, configs=len(configs[key]))
            for key, band in bands((t.key, t.error) for t in found).items()}


def order_errors(found: list[Timed]) -> dict[str, dict[str, tuple[int, float, float]]]:
    """Per card, how far the predicted ratio of two records' step times was from the measured one, over every pair
    of records of one window (one results file, one commit: one machine state, one after another): by how much one
    ratio exceeds the other (max(q, 1/q) - 1 of q = predicted ratio / measured ratio, percent: the same whichever
    record comes first). Apart for pairs of one class (policies and sizes: what estimate --fit orders) and of two
    (other optimizers, adapters, losses: what the plan across levers orders too): {"within": ..., "across": ...},
    each (pairs, median, 90th percentile by nearest rank). What an order between two predictions can be trusted to;
    the records' own spread is in it too."""
    by_card: dict[str, dict[str, list[float]]] = {}
    for a, b in itertools.combinations(found, 2):
        if a.card == b.card and a.window == b.window:
            q = (a.predicted_ms / b.predicted_ms) / (a.measured_ms / b.measured_ms)
            scope = "within" if a.key == b.key else "across"
            by_card.setdefault(a.card, {}).setdefault(scope, []).append(100 * (max(q, 1 / q) - 1))
    return {card: {scope: (len(xs), round(statistics.median(xs), 1), round(sorted(xs)[math.ceil(0.9 * len(xs)) - 1], 1))
                   for scope, xs in sorted(scopes.items(), reverse=True)}
            for card, scopes in sorted(by_card.items())}


def published_errors() -> list[tuple[Class, float, str]]:
    """(class, signed error %, source) of each published max_memory_allocated row and method."""
    path = HERE / "published" / "rows.toml"
    found = []
    for row in check.load_rows(path):
        if "spec" not in row or row["figure"] != "allocated":
            continue
        fields = dict(row["spec"])
        fields["model"] = str((path.parent / fields["model"]).resolve())
        spec = resolve(RunSpec(**fields, device="cpu"))
        for method in METHODS:
            outcome = check.predict(row, method, path.parent)
            if outcome.status == "predicted":
                found.append((class_of(spec, method), outcome.error_pct, "published"))
        print(f"{len(found)}: {row['id']}", file=sys.stderr, flush=True)
    return found


def module_text(table: dict[Class, Band], times: dict[TimeClass, Band],
                orders: dict[str, dict[str, tuple[int, float, float]]], sources: list[str]) -> str:
    lines = ['"""Written by benchmarks/error_bands.py (do not edit by hand): the errors of `estimate` against the GPU',
             "measurements kept in the repository, per class (gcbench/estimators/bands.py): configs, median |error| %,",
             'lowest and highest signed error %. From ' + ", ".join(sources) + '.',
             "BANDS: the peak (max_memory_allocated); TIME_BANDS: the step time, on the card the records ran on;",
             "ORDER_ERRORS: per card, the predicted ratio of two records' step times of one window against the",
             "measured one, for pairs within a class and across two (pairs, median and 90th percentile, %).",
             '"""', "", "BANDS = {"]
    lines += [_entry(key, (b.configs, b.median_abs_pct, b.low_pct, b.high_pct)) for key, b in table.items()]
    lines += ["}", "", "TIME_BANDS = {"]
    lines += [_entry(key, (b.configs, b.median_abs_pct, b.low_pct, b.high_pct)) for key, b in times.items()]
    lines += ["}", "", "ORDER_ERRORS = {"]
    lines += [_entry(card, figures) for card, figures in orders.items()]
    return "\n".join(lines + ["}", ""])


def _entry(key: object, value: object) -> str:
    """One dict entry, its value on a line of its own where both would pass 120 characters."""
    line = f"    {key!r}: {value!r},"
    return line if len(line) <= 120 else f"    {key!r}:\n        {value!r},"


def main() -> None:
    found = record_errors() + published_errors()
    timed = time_errors()
    table = bands((key, error) for key, error, _ in found)
    times = time_bands(timed)
    sources = sorted({f"results/gpu/{s}" if s != "published" else "benchmarks/published" for _, _, s in found})
    orders = order_errors(timed)
    OUT.write_text(module_text(table, times, orders, sources))
    for key, band in [*table.items(), *times.items()]:
        print(" ".join(key), band)
    for card, scopes in orders.items():
        for scope, (pairs, median, p90) in scopes.items():
            print(f"{card}: the predicted ratio of two steps of one window, pairs {scope} classes: {pairs}, median "
                  f"{median}%, p90 {p90}%")
    print(f"{len(found)} predictions in {len(table)} classes, {len(timed)} step times in {len(times)} classes -> "
          f"{OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    if importlib.util.find_spec("peft") is None:
        sys.exit("error_bands.py: the LoRA records and rows need peft: pip install -e '.[peft]'")
    main()
