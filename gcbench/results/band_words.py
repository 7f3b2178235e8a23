"""What a row says of the error band beside a prediction (gcbench/estimators/bands.py): its fields' names, and the
words a table or a caption puts around them. Read by the tables of `estimate` and of `estimate --fit`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PEAK_PREFIX = "measured"  # the peak's band: measured_configs, measured_error_low_pct, measured_error_high_pct
TIME_PREFIX = "measured_time"  # the step time's: measured_time_configs, measured_time_error_low_pct, ...


def span(low: float, high: float) -> str:
    """'-0.4..+0.6%', or one figure where both are the same."""
    return f"{low:+.1f}%" if low == high else f"{low:+.1f}..{high:+.1f}%"


def band_cell(row: dict[str, Any], prefix: str = PEAK_PREFIX) -> str:
    """The row's band (`prefix`: the peak's or the step time's) as span() gives it, or '-' where nothing like it
    was measured."""
    if not row.get(f"{prefix}_configs"):
        return "-"
    return span(row[f"{prefix}_error_low_pct"], row[f"{prefix}_error_high_pct"])


def _over_rows(banded: Sequence[dict[str, Any]], rows: int, prefix: str) -> tuple[str, str, list[str]]:
    """(the band's range over `banded`, 'these' or 'this', how many of `rows` have a band where not all)."""
    low = min(r[f"{prefix}_error_low_pct"] for r in banded)
    high = max(r[f"{prefix}_error_high_pct"] for r in banded)
    some = [f"{len(banded)} of {rows} rows, the others none measured"] if len(banded) < rows else []
    return span(low, high), "these" if len(banded) > 1 else "this", some


def peak_band_note(banded: Sequence[dict[str, Any]], predicted: int) -> str:
    """The peak's error band over `banded` (rows with one, of `predicted` rows with a peak), where the table left
    its `err` column out: each row's is its method's, the range is over the methods shown."""
    band, these, some = _over_rows(banded, predicted, PEAK_PREFIX)
    return (f"err: {band}, the peak's error against GPU measurements of configs like {these} ("
            + "; ".join([*some, "results/gpu/, benchmarks/published/", "each row's in --format json"]) + ")")


def time_band_note(timed: Sequence[dict[str, Any]], column: str, shown: bool) -> str:
    """How far the predicted step times of `timed` (rows with a time, in the column headed `column`) were from GPU
    measurements of configs like them on this card: the `ms err` column's meaning where it is `shown`, else the
    range over the rows; or that nothing like them was measured on it."""
    banded = [r for r in timed if r.get(f"{TIME_PREFIX}_configs")]
    if not banded:
        return (f"{column}: no step of configs like these measured on this card yet (results/gpu/): how far the "
                "time is off is unknown")
    if shown:
        return ("ms err = the step time's lowest..highest error against GPU measurements on this card of configs of "
                "the same family, precision, adapter, sharding, attention, loss, head and optimizer (negative: "
                "predicted too fast; results/gpu/; -: none measured)")
    band, these, some = _over_rows(banded, len(timed), TIME_PREFIX)
    return (f"{column} err: {band} against measured steps of configs like {these} on this card ("
            + "; ".join([*some, "negative: predicted too fast", "results/gpu/", "each row's in --format json"]) + ")")


ORDER_SCOPES = {"within": "of one class (policies, sizes)", "across": "of two classes (optimizers, adapters, losses)"}


def order_note(card: str, figures: Mapping[str, tuple[int, float, float]] | None, scopes: Sequence[str]) -> str:
    """What the records of `card` say of an order between two predicted step times (bands.order_error's figures,
    those of `scopes`: "within" a class, "across" two), or that none do yet."""
    found = [(ORDER_SCOPES[scope], *(figures or {})[scope]) for scope in scopes if scope in (figures or {})]
    if not found:
        return f"order: no two steps measured in one window on {card} yet say how far a predicted order holds there"
    parts = [f"{what}: a median {median:g}%, over {p90:g}% for 1 pair in 10 ({pairs} pairs)"
             for what, pairs, median, p90 in found]
    apart = max(p90 for *_, p90 in found)
    return (f"order: on {card}'s records the predicted ratio of two steps measured in one window was off, for configs "
            f"{'; '.join(parts)}: configs predicted less than {apart:g}% apart may swap when measured")
