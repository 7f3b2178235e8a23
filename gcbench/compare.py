"""`gcbench compare OLD NEW`: the same configs measured twice, what changed, and which changes are regressions.

Records are matched by spec — device (with its torch threads on a CPU), model setup (model, layers, precision,
optimizer, attention, memory cap, seed), seq, batch and policy; how a config was measured (warm-up and measured
steps) is not part of the match. A spec found in only one of the two is listed, never compared.

A step-time change inside the noise of either side (its median's 95% interval, or its IQR for records without one)
is not a regression unless `strict`: it is listed as noise instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gcbench.errors import GcbenchError
from gcbench.results.frame import FAILED, GROUP_KEYS, policy_rank
from gcbench.results.schema import Status, half_width
from gcbench.units import byte_unit

# --fail key: (column, what it is, +1 when a rise is a regression, -1 when a fall is)
METRICS = {
    "peak": ("peak_bytes", "peak memory", +1),
    "time": ("step_ms_median", "step time", +1),
    "tokens": ("tokens_per_s", "tokens/s", -1),
}
SPEC_KEYS = [*GROUP_KEYS, "policy_label"]


def parse_thresholds(text: str | None) -> dict[str, float]:
    """'peak:5%,time:10%' -> {'peak': 0.05, 'time': 0.10}: the largest tolerated worsening, as a fraction."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*:\s*([0-9]*\.?[0-9]+)\s*%?\s*", part)
        if not m or m.group(1) not in METRICS:
            raise GcbenchError(f"--fail {text!r}: expected key:percent pairs like peak:5%,time:10% "
                               f"(keys: {', '.join(METRICS)})")
        out[m.group(1)] = float(m.group(2)) / 100
    return out


def spec_label(row: dict) -> str:
    return (f"{row['setup']} · seq {row['seq_len']} · batch {row['batch_size']} · {row['policy_label']} "
            f"· {row['device_label']}")


@dataclass
class Comparison:
    matched: pd.DataFrame  # a row per spec in both: `<column>_old`, `<column>_new`, `<key>_change` (new/old - 1)
    only_old: list[str]  # spec labels
    only_new: list[str]
    regressions: list[str]  # one sentence each; empty when no thresholds were given
    within_noise: list[str]  # changes past a threshold but inside the noise: not regressions unless strict

    @property
    def failed(self) -> bool:
        return bool(self.regressions)


THREADS = re.compile(r" · (\d+) torch threads?")


def compare_results(old: pd.DataFrame, new: pd.DataFrame, thresholds: dict[str, float],
                    strict: bool = False) -> Comparison:
    """Match two `results_frame`s by spec; a change past its threshold, or a config that ran before and now
    does not (ok -> OOM), is a regression — except a change of step time (or tokens/s) inside the noise of either
    side, unless `strict`. Relative changes only between two successful runs."""
    columns = [*SPEC_KEYS, "status", "step_ms_iqr", "step_ms_ci", *(col for col, _, _ in METRICS.values())]
    merged = old[columns].merge(new[columns], on=SPEC_KEYS, how="outer", suffixes=("_old", "_new"), indicator=True)
    label = lambda frame: [spec_label(r) for r in frame.to_dict("records")]  # noqa: E731
    only_old = label(merged[merged["_merge"] == "left_only"])
    only_new = label(merged[merged["_merge"] == "right_only"])
    matched = merged[merged["_merge"] == "both"].drop(columns="_merge").reset_index(drop=True)
    if matched.empty:
        raise GcbenchError(_nothing_in_common(old, new))
    both_ok = (matched["status_old"] == Status.OK) & (matched["status_new"] == Status.OK)
    for key, (col, _, _) in METRICS.items():
        matched[f"{key}_change"] = (matched[f"{col}_new"] / matched[f"{col}_old"] - 1).where(both_ok)
    # A step-time change within either run's own noise is noise, whatever its size in percent (tokens/s too: it is
    # batch x seq over the same median).
    noise = pd.concat([_noise_ms(matched, "old"), _noise_ms(matched, "new")], axis=1).max(axis=1)
    matched["time_within_noise"] = ((matched["step_ms_median_new"] - matched["step_ms_median_old"]).abs()
                                    <= noise) & both_ok

    regressions, within_noise = [], []
    if thresholds:
        for r in matched.to_dict("records"):
            if r["status_old"] == Status.OK and r["status_new"] != Status.OK:
                regressions.append(f"{spec_label(r)}: ran before, now {FAILED.get(r['status_new'], r['status_new'])}")
            for key, limit in thresholds.items():
                _, what, sign = METRICS[key]
                change = r[f"{key}_change"]
                if change == change and change * sign > limit:
                    line = f"{spec_label(r)}: {what} {change:+.1%} (tolerated {limit:.0%})"
                    noisy = key != "peak" and r["time_within_noise"] and not strict
                    (within_noise if noisy else regressions).append(line)
    return Comparison(matched, only_old, only_new, regressions, within_noise)


def _noise_ms(matched: pd.DataFrame, side: str) -> pd.Series:
    """One side's noise in ms: the larger distance from its median to its 95% interval, or its IQR where the record
    has no interval (fewer than 6 steps, or written before intervals were)."""
    median = matched[f"step_ms_median_{side}"]
    relative = [half_width(m, ci) for m, ci in zip(median, matched[f"step_ms_ci_{side}"])]
    half = [m * r if r is not None else float("nan") for m, r in zip(median, relative)]
    return pd.Series(half, index=matched.index).fillna(matched[f"step_ms_iqr_{side}"])


def _nothing_in_common(old: pd.DataFrame, new: pd.DataFrame) -> str:
    """Why two results share no config: when they would match but for their CPU thread counts, say so."""
    strip = lambda f: f.assign(device_label=f["device_label"].str.replace(THREADS, "", regex=True))  # noqa: E731
    if not strip(old)[SPEC_KEYS].merge(strip(new)[SPEC_KEYS], on=SPEC_KEYS).empty:
        threads = lambda f: ", ".join(sorted({m.group(1) for m in map(THREADS.search, f["device_label"]) if m}))  # noqa: E731
        return (f"the two results differ in torch threads (OLD {threads(old)}, NEW {threads(new)}): CPU step times "
                "at different thread counts measure different things, so nothing is compared; measure both with the "
                "same --threads")
    return ("the two results have no config in common (nothing to compare); specs are matched by device, model "
            "setup, seq, batch and policy")


def comparison_tables(c: Comparison, thresholds: dict[str, float], width: int | None = None) -> list[Table]:
    """One rich table per device and setup: old -> new and the relative change of each metric. Given a terminal
    `width` too narrow for all of them, the tokens/s columns are left out (tokens/s is batch x seq over the step
    time: its change mirrors the step time's)."""
    tables = []
    frame = c.matched.assign(_rank=c.matched["policy_label"].map(policy_rank))
    frame = frame.sort_values(["device_label", "setup", "seq_len", "batch_size", "_rank"])
    for (device, setup), part in frame.groupby(["device_label", "setup"], sort=False):
        table = _comparison_table(device, setup, part, thresholds, tokens=True)
        if width is not None and Console(width=100_000).measure(table).maximum > width:
            table = _comparison_table(device, setup, part, thresholds, tokens=False)
        tables.append(table)
    return tables


def _comparison_table(device: str, setup: str, part: pd.DataFrame, thresholds: dict[str, float],
                      tokens: bool) -> Table:
    scale, unit = byte_unit(part[["peak_bytes_old", "peak_bytes_new"]].max().max())
    table = Table(title=f"{setup} — {device}", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True,
                  caption="change = new / old - 1; ~ = a step-time change within either run's noise (the 95% "
                          "interval of its median, or its IQR)" + ("" if tokens else "; tokens/s left out (narrow "
                                                                                      "terminal)"),
                  caption_justify="left")
    columns = ["seq", "batch", "policy", "status", f"peak {unit}", "Δ peak", "step ms", "Δ time"]
    columns += ["tokens/s", "Δ tokens/s"] if tokens else []
    widest_policy = max(map(len, part["policy_label"]))
    for col in columns:
        table.add_column(col, justify="left" if col in ("policy", "status") else "right", no_wrap=col != "status",
                         min_width=widest_policy if col == "policy" else None)
    for r in part.to_dict("records"):
        status = r["status_new"] if r["status_old"] == r["status_new"] else \
            f"{r['status_old']} -> {r['status_new']}"
        cells = [
            str(r["seq_len"]), str(r["batch_size"]), r["policy_label"],
            Text(status, style="bold red" if r["status_new"] != Status.OK else ""),
            _pair(r["peak_bytes_old"] / scale, r["peak_bytes_new"] / scale, "{:,.2f}"),
            _change(r["peak_change"], +1, thresholds.get("peak")),
            _pair(r["step_ms_median_old"], r["step_ms_median_new"], "{:,.1f}"),
            _change(r["time_change"], +1, thresholds.get("time"), noise=r["time_within_noise"]),
        ]
        if tokens:
            cells += [_pair(r["tokens_per_s_old"], r["tokens_per_s_new"], "{:,.0f}"),
                      _change(r["tokens_change"], -1, thresholds.get("tokens"), noise=r["time_within_noise"])]
        table.add_row(*cells)
    return table


def _pair(old: float, new: float, fmt: str) -> str:
    show = lambda v: fmt.format(v) if v == v else "-"  # noqa: E731 - NaN for a run that did not finish
    return f"{show(old)} -> {show(new)}"


def _change(change: float, sign: int, limit: float | None, noise: bool = False) -> Text:
    if change != change:
        return Text("-")
    worse = change * sign
    style = "bold red" if limit is not None and worse > limit else "green" if worse < 0 else ""
    return Text(f"{change:+.1%}" + ("~" if noise else ""), style=style)
