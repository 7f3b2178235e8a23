"""`gcbench compare OLD NEW`: the same configs measured twice, what changed, and which changes are regressions.

Records are matched by spec — device (with its torch threads on a CPU), model setup (model, layers, precision,
optimizer, attention, memory cap, seed), seq, batch and policy; how a config was measured (warm-up and measured
steps) is not part of the match. A spec found in only one of the two is listed, never compared.

Peak memory is exact: compared as it is. Step times are compared only where both runs trust theirs: one that either
run marks not comparable (CPU jobs side by side, CPU ranks) or not trusted (timing_stable false: noisy steps, a busy
host) is listed as not compared, with why. A step-time change is a regression only past its threshold and clear of
both runs' noise (results.stats.clearly_different on the medians' 95% intervals, recomputed for correlated steps
from the raw steps every record keeps), unless `strict`: inside the noise it is listed as noise instead.

By ratio (`by="ratio"`), a policy's step time is compared relative to its own results' baseline policy at the same
seq and batch (time_ratio, timed paired where the sweep did so): the number a machine's load shifts least.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gcbench.errors import GcbenchError
from gcbench.results.frame import FAILED, GROUP_KEYS, given, latest_per_group, policy_rank
from gcbench.results.schema import NoteKind, Status, note_kinds, timing_notes_of
from gcbench.results.stats import Stats, clearly_different
from gcbench.text import fits, markup, option_lines, plain
from gcbench.units import byte_unit, fmt_change

# --fail key: (column, what it is, +1 when a rise is a regression, -1 when a fall is)
METRICS = {
    "peak": ("peak_bytes", "peak memory", +1),
    "time": ("step_ms_median", "step time", +1),
    "tokens": ("tokens_per_s", "tokens/s", -1),
}
# a table's metric: (column, its format, its --fail key, +1 when a rise is worse); its change is <metric>_change
CELLS = {"peak": ("peak_bytes", "{:,.2f}", "peak", +1), "time": ("step_ms_median", "{:,.1f}", "time", +1),
         "ratio": ("time_x", "{:,.2f}x", "time", +1), "tokens": ("tokens_per_s", "{:,.0f}", "tokens", -1)}
SPEC_KEYS = [*GROUP_KEYS, "policy_label"]
BY = ("time", "ratio")  # --by: each config's own step time, or its time relative to its results' baseline policy
# Notes that make a step time another kind of number than a sequential run's (each record says so): never compared.
NOT_COMPARABLE = (NoteKind.SIDE_BY_SIDE, NoteKind.CPU_RANKS)
SIDES = {"old": "OLD", "new": "NEW"}
NOT_COMPARED, NOISE = "?", "~"  # how a step-time change is marked in the tables


def parse_thresholds(text: str | None, strict: bool = False) -> dict[str, float]:
    """'peak:5%,time:10%' -> {'peak': 0.05, 'time': 0.10}: the largest tolerated worsening, as a fraction. An
    empty --fail, or --strict without one, is refused: a check that checks nothing would pass."""
    if text is not None and not text.strip():
        raise GcbenchError("--fail: empty; give thresholds such as peak:5%,time:10%")
    if not text:
        if strict:
            raise GcbenchError("--strict goes with --fail: it fails changes inside the noise too")
        return {}
    out = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*:\s*([0-9]*\.?[0-9]+)\s*%?\s*", part)
        if not m or m.group(1) not in METRICS:
            raise GcbenchError(f"--fail {text!r}: expected key:percent pairs like peak:5%,time:10% "
                               f"(keys: {', '.join(METRICS)})")
        if m.group(1) in out:
            raise GcbenchError(f"--fail {text!r}: {m.group(1)} given twice")
        out[m.group(1)] = float(m.group(2)) / 100
    return out


def spec_label(row: dict) -> str:
    return (f"{row['setup']} · seq {row['seq_len']} · batch {row['batch_size']} · {row['policy_label']} "
            f"· {row['device_label']}")


@dataclass
class Comparison:
    matched: pd.DataFrame  # a row per spec in both: `<column>_old`, `<column>_new`, `<key>_change` (new/old - 1),
    # ratio_change (of time_x), time_why_not (why the step times were not compared, or None), time_mark (? ~ or "")
    only_old: list[str]  # spec labels
    only_new: list[str]
    regressions: list[str]  # one sentence each; empty when no thresholds were given
    within_noise: list[str]  # changes past a threshold but inside the noise: not regressions unless strict
    not_compared: list[str] = field(default_factory=list)  # "spec: why" for step times not compared
    by: str = "time"

    @property
    def failed(self) -> bool:
        return bool(self.regressions)


THREADS = re.compile(r" · (\d+) torch threads?")


def compare_results(old: pd.DataFrame, new: pd.DataFrame, thresholds: dict[str, float],
                    strict: bool = False, by: str = "time") -> Comparison:
    """Match two `results_frame`s by spec; a regression is a config that ran before and now does not (ok -> OOM),
    a peak past its threshold, or a step time (tokens/s) past its threshold and clear of both runs' noise (inside
    it too when `strict`). Step times either run marks not comparable or not trusted are never compared: listed in
    `not_compared` with why. `by`: "time" compares each config's median step time, "ratio" its time relative to
    its results' baseline policy at the same seq and batch. Relative changes only between two successful runs."""
    if by not in BY:
        raise GcbenchError(f"--by {by!r}: expected one of {', '.join(BY)}")
    columns = [*SPEC_KEYS, "status", "timing_trusted", "timing_notes", "timing_note_kinds", "time_x", "time_x_vs",
               "ratio_trusted", "time_lo", "time_hi", "ratio_lo", "ratio_hi",
               *(col for col, _, _ in METRICS.values())]
    old, new = _with_bounds(old)[columns], _with_bounds(new)[columns]
    merged = old.merge(new, on=SPEC_KEYS, how="outer", suffixes=("_old", "_new"), indicator=True)
    label = lambda frame: [spec_label(r) for r in frame.to_dict("records")]  # noqa: E731
    only_old = label(merged[merged["_merge"] == "left_only"])
    only_new = label(merged[merged["_merge"] == "right_only"])
    matched = merged[merged["_merge"] == "both"].drop(columns="_merge").reset_index(drop=True)
    if matched.empty:
        raise GcbenchError(_nothing_in_common(old, new))
    both_ok = (matched["status_old"] == Status.OK) & (matched["status_new"] == Status.OK)
    for key, (col, _, _) in METRICS.items():  # a change from 0 is no relative change (+inf%): not compared
        matched[f"{key}_change"] = (matched[f"{col}_new"] / matched[f"{col}_old"] - 1).where(
            both_ok & (matched[f"{col}_old"] > 0))
    # The baseline's own ratio is 1 by definition: nothing to compare by ratio.
    matched["ratio_change"] = (matched["time_x_new"] / matched["time_x_old"] - 1).where(
        both_ok & (matched["policy_label"] != matched["time_x_vs_new"]))
    rows = matched.to_dict("records")
    matched["time_why_not"] = [_why_not_compared(r, by) if ok else None for r, ok in zip(rows, both_ok)]
    clear = [ok and _clearly_changed(r, by) for r, ok in zip(rows, both_ok)]
    matched["time_mark"] = [NOT_COMPARED if given(why) else "" if is_clear or not ok else NOISE
                            for why, is_clear, ok in zip(matched["time_why_not"], clear, both_ok)]

    regressions, within_noise, not_compared = [], [], []
    for r in matched.to_dict("records"):
        if r["status_old"] == Status.OK and r["status_new"] != Status.OK:
            regressions.append(f"{spec_label(r)}: ran before, now {FAILED.get(r['status_new'], r['status_new'])}")
        if given(r["time_why_not"]):
            not_compared.append(f"{spec_label(r)}: {r['time_why_not']}")
        for key, limit in thresholds.items():
            _, what, sign = METRICS[key]
            change = r[f"{key}_change"]
            if key != "peak" and given(r["time_why_not"]):
                continue
            if key != "peak" and by == "ratio":  # tokens/s relative to the baseline's is the inverse time ratio
                change = r["ratio_change"] if key == "time" else 1 / (1 + r["ratio_change"]) - 1
                what = f"{what} relative to {r['time_x_vs_new']}"
            if change == change and change * sign > limit:
                line = f"{spec_label(r)}: {what} {change:+.1%} (tolerated {limit:.0%})"
                noisy = key != "peak" and r["time_mark"] == NOISE and not strict
                (within_noise if noisy else regressions).append(line)
    return Comparison(matched, only_old, only_new, regressions, within_noise, not_compared, by)


def _with_bounds(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with the bounds of each step time (time_lo, time_hi, ms) and of each time ratio (ratio_lo,
    ratio_hi): a step time's median's 95% interval recomputed from its raw steps (results.stats: made for
    correlated steps; the steps' range where they cannot bound it; the stored interval, or the IQR, for a record
    without steps); a paired ratio's stored 95% interval; an unpaired ratio's two medians' intervals combined."""
    frame = frame.reindex(columns=list(dict.fromkeys([*frame.columns, "step_ms", "time_x_paired"])))
    bounds = [_time_bounds(r) for r in frame.to_dict("records")]
    frame = frame.assign(time_lo=[lo for lo, _ in bounds], time_hi=[hi for _, hi in bounds])
    base = latest_per_group(frame[(frame["policy"] == "none") & (frame["status"] == Status.OK)])
    joined = frame.join(base.set_index(GROUP_KEYS)[["step_ms_median", "time_lo", "time_hi"]].add_suffix("_base"),
                        on=GROUP_KEYS)
    ratio = [_ratio_bounds(r) for r in joined.to_dict("records")]
    return frame.assign(ratio_lo=[lo for lo, _ in ratio], ratio_hi=[hi for _, hi in ratio])


def _time_bounds(r: dict[str, Any]) -> tuple[float, float]:
    median = r["step_ms_median"]
    if not given(median):
        return math.nan, math.nan
    if isinstance(r["step_ms"], list) and r["step_ms"]:
        s = Stats.of(r["step_ms"])
        scale = median / s.median if s.median else 1.0  # the record's median is its steps' (kept as stored)
        if s.ci is None:
            # Too few or too correlated steps to bound their median at 95%: the interval would be wider than
            # min..max, so the whole range on each side of the median stands in for it. A change past that (a
            # step time twice as long) is still a change, not noise.
            spread = s.max - s.min
            return (s.median - spread) * scale, (s.median + spread) * scale
        return s.ci[0] * scale, s.ci[1] * scale
    if isinstance(r.get("step_ms_ci"), list) and len(r["step_ms_ci"]) == 2:
        return r["step_ms_ci"][0], r["step_ms_ci"][1]
    iqr = r["step_ms_iqr"] if given(r.get("step_ms_iqr")) else 0.0
    return median - iqr, median + iqr


def _ratio_bounds(r: dict[str, Any]) -> tuple[float, float]:
    ratio = r["time_x"]
    if not given(ratio):
        return math.nan, math.nan
    if _yes(r["time_x_paired"]):
        ci = r["time_ratio_ci"]
        return (ci[0], ci[1]) if isinstance(ci, list) and len(ci) == 2 else (math.nan, math.nan)
    t, b = r["step_ms_median"], r["step_ms_median_base"]
    if not (given(b) and t and b):
        return math.nan, math.nan
    down = math.hypot(1 - r["time_lo"] / t, r["time_hi_base"] / b - 1)  # this step faster, the baseline's slower
    up = math.hypot(r["time_hi"] / t - 1, 1 - r["time_lo_base"] / b)
    return ratio * (1 - down), ratio * (1 + up)


def _clearly_changed(r: dict[str, Any], by: str) -> bool:
    """Whether old and new differ past both runs' noise (step times, or time ratios `by` ratio)."""
    value, bound = ("time_x", "ratio") if by == "ratio" else ("step_ms_median", "time")
    old, new = r[f"{value}_old"], r[f"{value}_new"]
    lo_old, hi_old, lo_new, hi_new = (r[f"{bound}_{end}_{side}"] for side in SIDES for end in ("lo", "hi"))
    if not all(given(v) for v in (old, new, lo_old, hi_old, lo_new, hi_new)):
        return False
    return clearly_different(old, (lo_old, hi_old), new, (lo_new, hi_new))


def _why_not_compared(r: dict[str, Any], by: str) -> str | None:
    """Why the step times of a matched pair (both ok) are not compared; None when they are."""
    notes = {side: {"timing_notes": r[f"timing_notes_{side}"], "timing_note_kinds": r[f"timing_note_kinds_{side}"]}
             for side in SIDES}
    apart = {side: [n.kind.words for n in timing_notes_of(record) if n.kind in NOT_COMPARABLE]
             for side, record in notes.items()}
    if any(apart.values()):
        return f"not comparable: {_per_side(apart)}"
    if by == "ratio":
        missing = [SIDES[side] for side in SIDES if not given(r[f"time_x_{side}"])]
        if missing:
            return f"no time ratio in {' and '.join(missing)} (no baseline policy ran at this seq and batch)"
        if r["time_x_vs_old"] != r["time_x_vs_new"]:
            return f"ratios to different policies ({r['time_x_vs_old']} in OLD, {r['time_x_vs_new']} in NEW)"
        shaky = [SIDES[side] for side in SIDES if not _yes(r[f"ratio_trusted_{side}"])]
        return (f"time ratio not trusted in {' and '.join(shaky)} (a paired ratio's 95% interval past +-10%, or an "
                "unpaired one of timings not trusted)") if shaky else None
    untrusted = {side: note_kinds(record) or ["timing not trusted"] for side, record in notes.items()
                 if not _yes(r[f"timing_trusted_{side}"])}
    return f"timing not trusted: {_per_side(untrusted)}" if untrusted else None


def _yes(value: Any) -> bool:
    """A flag from a merged frame: True, False, or missing (NaN for a side without the column): missing is no."""
    return given(value) and bool(value)


def _per_side(reasons: dict[str, list[str]]) -> str:
    """Each side's reasons in words: "CPU jobs side by side (OLD and NEW)", "OLD: ...; NEW: ..."."""
    texts = {side: ", ".join(dict.fromkeys(words)) for side, words in reasons.items() if words}
    if len(texts) == 2 and len(set(texts.values())) == 1:
        return f"{texts['old']} (OLD and NEW)"
    return "; ".join(f"{SIDES[side]}: {text}" for side, text in texts.items())


def _nothing_in_common(old: pd.DataFrame, new: pd.DataFrame) -> str:
    """Why two results share no config: when they would match but for their CPU thread counts, say so."""
    strip = lambda f: f.assign(device_label=f["device_label"].str.replace(THREADS, "", regex=True))  # noqa: E731
    if not strip(old)[SPEC_KEYS].merge(strip(new)[SPEC_KEYS], on=SPEC_KEYS).empty:
        threads = lambda f: ", ".join(  # noqa: E731
            sorted({m.group(1) for m in map(THREADS.search, f["device_label"]) if m}))
        return (f"the two results differ in torch threads (OLD {threads(old)}, NEW {threads(new)}): CPU step times "
                "at different thread counts measure different things, so nothing is compared; measure both with the "
                "same --threads")
    return ("the two results have no config in common (nothing to compare); specs are matched by device, model "
            "setup, seq, batch and policy")


def print_comparison(console: Console, c: Comparison, thresholds: dict[str, float], fail: str | None) -> None:
    """What `gcbench compare` shows: a table per device and setup, the specs and step times not compared (and
    why), the changes inside the noise and the regressions (the command exits 1 when `c.failed`)."""
    for table in comparison_tables(c, thresholds, console.width):
        console.print(table)
    for title, specs in (("only in OLD (not compared)", c.only_old), ("only in NEW (not compared)", c.only_new)):
        if specs:
            console.print(f"[bold]{title}:[/] {len(specs)}")
            for spec in specs:
                _print_label(console, spec, "  ")
    if c.not_compared:
        console.print(f"[bold]step times not compared (never a regression):[/] {len(c.not_compared)}")
        skipped = c.matched[c.matched["time_why_not"].map(given)]
        one_table = c.matched[["setup", "device_label"]].drop_duplicates().shape[0] == 1  # its title names them
        for why, part in skipped.groupby("time_why_not", sort=False):  # one reason, then its specs
            console.print(f"  {markup(why)}:")
            for r in part.to_dict("records"):
                label = f"seq {r['seq_len']} · batch {r['batch_size']} · {r['policy_label']}" if one_table \
                    else spec_label(r)
                _print_label(console, label, "    ")
    noisy = f"[yellow]{len(c.within_noise)} change(s) past --fail {markup(fail)} but inside the noise of a run (not " \
        "failed; --strict fails them):[/]"
    worse = f"[bold red]{len(c.regressions)} regression(s) past --fail {markup(fail)}:[/]"
    for lines, head in ((c.within_noise, noisy), (c.regressions, worse)):
        for line in [head, *(f"  {markup(line)}" for line in lines)] if lines else []:
            console.print(line)
    if thresholds and not c.regressions:
        line, complete = verdict(c, thresholds, fail)
        console.print(f"[{'green' if complete else 'yellow'}]{markup(line)}[/]")


def verdict(c: Comparison, thresholds: dict[str, float], fail: str | None) -> tuple[str, bool]:
    """The line a comparison without regressions ends with, and whether it checked everything: how many of the
    configs in both runs each threshold was checked on (a step time only where both runs trust theirs), and the
    configs in OLD that NEW lacks. "No regression" over configs never checked would claim what was not tested."""
    m, n = c.matched, len(c.matched)
    timed = ~m["time_why_not"].map(given)
    # a threshold was checked where its change is a number: both ran ok and both have the value (a compiled CPU run
    # has no peak), and for a time, where both runs' times may be compared
    checked = {key: int((m["peak_change"].notna() if key == "peak" else
                         timed & m["ratio_change" if c.by == "ratio" else f"{key}_change"].notna()).sum())
               for key in thresholds}
    # a config that failed in both runs (out of memory twice, as a sweep records it) has nothing to compare
    failed = int(((m["status_old"] != Status.OK) & (m["status_new"] != Status.OK)).sum())
    parts = [f"{METRICS[key][1]} checked on {k} of {n}" for key, k in checked.items()]
    complete = all(k + failed == n for k in checked.values()) and not c.only_old
    line = (f"no regression past --fail {fail} in the {n} config(s) of both runs ({', '.join(parts)}"
            + (f"; {failed} failed in both" if failed else "") + ")")
    if c.only_old:
        line += f"; {len(c.only_old)} config(s) only in OLD not checked"
    return line, complete


def _print_label(console: Console, label: str, indent: str) -> None:
    """A spec's label after `indent`, broken after a ' · ' into lines of the console's width, each later line two
    spaces further in: a label wrapped by the terminal ran past 80 columns or restarted at the margin (issue 48)."""
    words, hang = label.split(" · "), indent + "  "
    lines = [indent + words[0]]
    for word in words[1:]:  # room kept on each line for the ' ·' that ends it where the next word does not fit
        if len(lines[-1]) + len(" · ") + len(word) + len(" ·") > console.width:
            lines[-1] += " ·"
            lines.append(hang + word)
        else:
            lines[-1] += " · " + word
    for line in lines:
        console.print(markup(line), highlight=False)


def comparison_tables(c: Comparison, thresholds: dict[str, float], width: int | None = None) -> list[Table]:
    """One rich table per device and setup: old -> new and the relative change of each metric. Given a terminal
    `width` too narrow for all of them, the tokens/s columns are left out (tokens/s is batch x seq over the step
    time: its change mirrors the step time's), then policy labels take a line per part, then peaks and times are
    two tables: every number whole."""
    tables = []
    frame = c.matched.assign(_rank=c.matched["policy_label"].map(policy_rank))
    frame = frame.sort_values(["device_label", "setup", "seq_len", "batch_size", "_rank"])
    time = "ratio" if c.by == "ratio" else "time"
    for (device, setup), part in frame.groupby(["device_label", "setup"], sort=False):
        make = lambda metrics, narrow=False: _comparison_table(  # noqa: E731
            device, setup, part, thresholds, metrics, c.by, narrow)
        for tried in ([make(("peak", time, "tokens"))] if c.by == "time" else [],
                      [make(("peak", time))], [make(("peak", time), narrow=True)]):
            if tried and fits(tried[0], width):
                tables += tried
                break
        else:
            tables += [make(("peak",), narrow=True), make((time,), narrow=True)]
    return tables


def _caption(part: pd.DataFrame, tokens: bool, by: str) -> str:
    noise = ("~ = a change within the two ratios' noise (their 95% intervals)" if by == "ratio" else
             "~ = a step-time change within the two runs' noise (their medians' 95% intervals, for correlated steps)")
    parts = ["change = new / old - 1", noise]
    if by == "ratio":
        parts.insert(0, "time ratio = step time / its baseline policy's at the same seq and batch (none, or the "
                        "cheapest that ran; paired where timed so)")
    if (part["time_mark"] == NOT_COMPARED).any():
        parts.append("? = step times not compared (listed below, with why)")
    if by == "time" and not tokens:
        parts.append("tokens/s left out (narrow terminal)")
    return "; ".join(parts)


def _comparison_table(device: str, setup: str, part: pd.DataFrame, thresholds: dict[str, float],
                      metrics: tuple[str, ...], by: str = "time", narrow: bool = False) -> Table:
    """The table of `metrics` (peak, time, ratio, tokens: old -> new and the change of each) beside the columns
    that name a config; `narrow`: policy labels a line per part."""
    scale, unit = byte_unit(part[["peak_bytes_old", "peak_bytes_new"]].max().max())
    tokens = "tokens" in metrics
    # the device on a line of its own: rich cut a letter where one long title wrapped at the table's full width
    table = Table(title=f"{markup(setup)}\n{markup(device)}", header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=0, collapse_padding=True,
                  caption=_caption(part, tokens, by) if by in metrics or "time" in metrics else None,
                  caption_justify="left")
    names = {"peak": f"peak {unit}", "ratio": "time ratio", "time": "step ms", "tokens": "tokens/s"}
    columns = ["seq", "batch", "policy", "status", *(h for m in metrics for h in (names[m], f"Δ {m}"))]
    # a long policy label (plan:memory=24GiB,allow_offload=false) takes a line per option: its column leaves the
    # numbers their room at 80 columns
    widest_policy = max(len(x) for p in part["policy_label"] for x in _policy_lines(plain(p), narrow).splitlines())
    for col in columns:
        table.add_column(col, justify="left" if col in ("policy", "status") else "right", no_wrap=col != "status",
                         min_width={"policy": widest_policy, "status": len("status")}.get(col))
    for r in part.to_dict("records"):
        status = r["status_new"] if r["status_old"] == r["status_new"] else \
            f"{r['status_old']} -> {r['status_new']}"
        cells = [str(r["seq_len"]), str(r["batch_size"]), Text(_policy_lines(plain(r["policy_label"]), narrow)),
                 Text(plain(status), style="bold red" if r["status_new"] != Status.OK else "")]  # Text: as is
        for metric in metrics:
            col, fmt, limit, sign = CELLS[metric]
            unit_of = scale if metric == "peak" else 1
            cells += [_pair(r[f"{col}_old"] / unit_of, r[f"{col}_new"] / unit_of, fmt),
                      _change(r[f"{metric}_change"], sign, thresholds.get(limit), r["time_mark"] if limit != "peak"
                              else "")]
        table.add_row(*cells)
    return table


def _policy_lines(label: str, narrow: bool = False) -> str:
    """A policy label as a table cell: past 20 characters, a line per option (`plan:memory=24GiB,` then
    `allow_offload=false`); `narrow`: past 8, a line per part (`offload:`, `what=inputs,`, `k=1`)."""
    return option_lines(label, 8, ":,") if narrow else option_lines(label, 20)


def _pair(old: float, new: float, fmt: str) -> str:
    show = lambda v: fmt.format(v) if given(v) else "-"  # noqa: E731 - NaN for a run that did not finish
    return f"{show(old)} -> {show(new)}"


def _change(change: float, sign: int, limit: float | None, mark: str = "") -> Text:
    if change != change:
        return Text("-")
    worse = change * sign
    past = limit is not None and worse > limit
    style = ("bold red" if not mark else "yellow" if mark == NOISE else "dim") if past else \
        "green" if worse < 0 and not mark else ""
    return Text(f"{fmt_change(change)}{mark}", style=style)
