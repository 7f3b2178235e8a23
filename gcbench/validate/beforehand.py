"""What the plan reads of the predictions made beforehand on a CPU machine (validate --predict, committed in
benchmarks/gpu/predicted/): a sweep config's stored prediction, a fit's `estimate --fit` rows per card. Where a file
is missing or unreadable, nothing: the plan then prices by its stated assumptions (cost.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gcbench.estimators.stored import stored_prediction
from gcbench.resolved import ResolvedRun
from gcbench.validate.plan import Step


def fit_rows(path: Path) -> list[dict]:
    """The rows of an estimate-fit-<step>-<card>.json made beforehand; none where it is missing or unreadable."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def predicted_fit_sizes(predicted: Path, step: Step, card: str) -> dict[str, int]:
    """Per policy, the size past the largest batch `estimate --fit` predicted for this step on `card`
    (predicted/estimate-fit-<step>-<card>.json; another card's where this one has none): where its trials are
    expected."""
    own = predicted / f"estimate-fit-{step.name}-{card}.json"
    found = [own] if own.exists() else sorted(predicted.glob(f"estimate-fit-{step.name}-*.json"))
    return {str(row.get("policy")): row["value"] + 1 for row in (fit_rows(found[0]) if found else [])
            if isinstance(row.get("value"), int)}


def fit_steps(predicted: Path, step: Step, card: str) -> dict[tuple, tuple[int, float]]:
    """(model, layers, seq, policy) -> (the largest batch, its step seconds) of the fit's estimate --fit rows for
    `card`: the time model's step there."""
    o = step.options
    return {(o["model"], o.get("layers"), int(o["seq"]), str(row.get("policy"))): (row["value"], float(row["step_s"]))
            for row in fit_rows(predicted / f"estimate-fit-{step.name}-{card}.json")
            if isinstance(row.get("value"), int) and row["value"] > 0 and _seconds(row.get("step_s"))}


def stored_step_s(spec: ResolvedRun, predicted: Path, card: str) -> float | None:
    """The time model's step on `card` stored for a sweep config (its predicted_step_ms_by_card), or None."""
    stored = stored_prediction(spec.as_record(), "cuda", predicted / "predictions.jsonl") or {}
    ms = (stored.get("predicted_step_ms_by_card") or {}).get(card)
    return ms / 1e3 if _seconds(ms) else None


def _seconds(value: object) -> bool:
    """A time the plan can price by: a finite number above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
