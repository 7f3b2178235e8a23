"""Write gcbench/estimators/measured_bands.py: each method's prediction errors against every GPU measurement kept in
the repository, grouped by class (gcbench/estimators/bands.py), for the error band `gcbench estimate` shows.

The measurements: the ok single-process records under results/gpu/ (max_memory_allocated; FSDP2 on one rank
included) and the published rows of benchmarks/published/rows.toml whose figure is max_memory_allocated. Each is
predicted as `estimate` predicts it, with each method that can; a method that cannot express a config adds
nothing to its class. The step time's bands (TIME_BANDS): each ok single-process record's median step against the
time model's step on the card it ran on (benchmarks/time_accuracy.py's records and predictions). Rerun after a GPU
window or a change to the estimators; the bands are a record, not a tuning set.

    python benchmarks/error_bands.py          # needs gcbench[peft]; about 2 minutes on 2 cores
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

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


def time_errors() -> list[tuple[TimeClass, float, str]]:
    """(class, signed error %, the config) of each GPU record's predicted step time, on the card it ran on; a
    record on a card without the time model's rates adds nothing."""
    found = []
    for folder in gpu_folders(ROOT):
        for record in time_accuracy.records(folder):
            step, _, _ = time_accuracy.predict(record)
            card = matching(record["env"]["gpu_name"])
            if step is not None and card is not None:
                spec = resolve(spec_of(record))
                error = 100 * (step.step_ms / record["step_ms_median"] - 1)
                found.append((time_class_of(spec, card.name, step.host_bound), error, config_key(spec.as_record())))
        print(f"{len(found)} step times: {folder.name}", file=sys.stderr, flush=True)
    return found


def time_bands(found: list[tuple[TimeClass, float, str]]) -> dict[TimeClass, Band]:
    """bands() of the step times, each counting its configs: a config measured twice adds both errors, once."""
    configs: dict[TimeClass, set[str]] = {}
    for key, _, config in found:
        configs.setdefault(key, set()).add(config)
    return {key: dataclasses.replace(band, configs=len(configs[key]))
            for key, band in bands((key, error) for key, error, _ in found).items()}


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


def module_text(table: dict[Class, Band], times: dict[TimeClass, Band], sources: list[str]) -> str:
    lines = ['"""Written by benchmarks/error_bands.py (do not edit by hand): the errors of `estimate` against the GPU',
             "measurements kept in the repository, per class (gcbench/estimators/bands.py): configs, median |error| %,",
             'lowest and highest signed error %. From ' + ", ".join(sources) + '.',
             "BANDS: the peak (max_memory_allocated); TIME_BANDS: the step time, on the card the records ran on.",
             '"""', "", "BANDS = {"]
    lines += [f"    {key!r}: ({b.configs}, {b.median_abs_pct}, {b.low_pct}, {b.high_pct})," for key, b in table.items()]
    lines += ["}", "", "TIME_BANDS = {"]
    lines += [f"    {key!r}: ({b.configs}, {b.median_abs_pct}, {b.low_pct}, {b.high_pct})," for key, b in times.items()]
    return "\n".join(lines + ["}", ""])


def main() -> None:
    found = record_errors() + published_errors()
    timed = time_errors()
    table = bands((key, error) for key, error, _ in found)
    times = time_bands(timed)
    sources = sorted({f"results/gpu/{s}" if s != "published" else "benchmarks/published" for _, _, s in found})
    OUT.write_text(module_text(table, times, sources))
    for key, band in [*table.items(), *times.items()]:
        print(" ".join(key), band)
    print(f"{len(found)} predictions in {len(table)} classes, {len(timed)} step times in {len(times)} classes -> "
          f"{OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    if importlib.util.find_spec("peft") is None:
        sys.exit("error_bands.py: the LoRA records and rows need peft: pip install -e '.[peft]'")
    main()
