"""Predictions made beforehand, on another machine: a run looks its own up instead of predicting it.

`gcbench validate --predict` predicts every config of the GPU plan on a CPU machine (a llama-7b simulation takes
seconds of CPU per config: no reason to spend lent GPU time on it) into a JSON Lines file, committed with the plan;
`gcbench validate` points its runs at that file through GCBENCH_PREDICTIONS. A config missing from the file, or a
file made by other predictor code (its digest differs), is predicted as usual.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gcbench.fields import RUN_FIELDS, Role
from gcbench.results.schema import config_key

PREDICTIONS_ENV = "GCBENCH_PREDICTIONS"
# What a prediction does not depend on: where and how long the config runs.
NOT_PREDICTED_BY = tuple(f.name for f in RUN_FIELDS if f.role in (Role.DEVICE, Role.LENGTH))
PREDICTION_FIELDS = ("predicted_peak_bytes", "prediction_method", "predicted_peak_phase",
                     "predicted_peak_bytes_simulate", "predicted_peak_bytes_analytic", "predicted_step_ms_by_card")
# The code a prediction follows from: the predictors and what they run (models, policies, the step, its losses and
# adapters, optimizers, the trackers and what the host tells the time model), and the cards' figures (budgets, rates).
_SOURCES = ("estimators", "policies", "models.py", "blocks.py", "modality.py", "step.py", "losses.py", "liger_model.py",
            "adapters.py", "nf4.py", "optimizers.py", "presets.py", "fsdp.py", "measure.py", "heap.py", "host_work.py",
            "gpus.py")

# Under estimators/ but read by no prediction: the error bands `estimate` shows beside its rows (rewritten by
# benchmarks/error_bands.py after each GPU window, which would otherwise make the stored predictions stale)
_NOT_PREDICTORS = ("bands.py", "measured_bands.py")


def prediction_key(record: Mapping[str, Any], target: str) -> str:
    return f"{target}|{config_key(record, ignore=NOT_PREDICTED_BY)}"


@functools.cache
def code_digest() -> str:
    """A digest of the predictor code (its source files' bytes), so that stored predictions made by other code are
    not taken for this code's."""
    return digest_of(Path(__file__).resolve().parent.parent)


def digest_of(package: Path) -> str:
    """code_digest of the gcbench package at `package`."""
    digest = hashlib.sha256()
    for name in _SOURCES:
        path = package / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if file.name in (Path(__file__).name, *_NOT_PREDICTORS) and file.parent.name == "estimators":
                continue  # this file looks predictions up; the bands are shown beside them: none makes one
            digest.update(file.relative_to(package).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def stored_row(record: Mapping[str, Any], target: str, predictions: Mapping[str, Any]) -> dict[str, Any]:
    """One line of the predictions file: the config's key, the code digest, its prediction fields."""
    return {"key": prediction_key(record, target), "digest": code_digest(),
            **{k: predictions[k] for k in PREDICTION_FIELDS if k in predictions}}


@functools.cache
def _table(path: str) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return table
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("digest") == code_digest() and isinstance(row.get("key"), str):
            table[row["key"]] = {k: row[k] for k in PREDICTION_FIELDS if k in row}
    return table


def stored_prediction(record: Mapping[str, Any], target: str, path: str | Path | None = None) -> dict[str, Any] | None:
    """The prediction fields stored for this config in `path` (default: the file GCBENCH_PREDICTIONS names), or
    None."""
    path = path or os.environ.get(PREDICTIONS_ENV)
    if not path:
        return None
    return _table(str(path)).get(prediction_key(record, target))
