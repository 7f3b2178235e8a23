"""The report's figures (matplotlib without pyplot: no global state, no GUI backend).

Every figure names its device in the title, puts units on both axes and has a legend for every mark, so it can be
read without the docs. One function per figure; each gets one device's rows of `results_frame` and returns a
Figure, or a string saying why there is nothing to draw.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib as mpl
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from gcbench.report.analysis import pareto_front
from gcbench.report.figure_layout import (CROWDED, OOM_MARK, STYLE, UNTRUSTED_LABEL, Drawn, coincident, fade,
                                          figure_legend, largest_panels, log2_axis, oom_handle, pale, pale_handle,
                                          panel_figure, panel_title, policy_colors, policy_ticks)
from gcbench.report.fit_figures import fit_frontier
from gcbench.report.prediction_figure import predicted_vs_measured, predicted_vs_measured_time
from gcbench.report.run_table import UNTRACKED
from gcbench.results.frame import given, policy_rank, without_fit_trials
from gcbench.units import byte_unit, fmt_bytes, plural

PNG_DPI = 90  # modest: the figures are embedded in report.html
PHASE_WORDS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}  # as the tables' "peak in" column
STATE_COLORS = {"params": "#4c72b0", "grads": "#8fb0de", "optimizer state": "#dd8452", "activations": "#55a868"}


@dataclass(frozen=True)
class FigureFile:
    """One written figure (paths relative to the report directory), or one not drawn (`png` None, caption why)."""

    key: str
    title: str
    caption: str
    png: str | None = None
    svg: str | None = None


def _focus(setup_rows: pd.DataFrame, need_baseline: bool) -> tuple[int, int] | None:
    """The (seq, batch) one bar chart shows for a setup: most policies that ran, then the most tokens."""
    best = None
    for (seq, batch), g in setup_rows.groupby(["seq_len", "batch_size"]):
        ok = g[g["status"] == "ok"]
        if ok.empty or (need_baseline and not ok["has_baseline"].any()):
            continue
        key = (len(ok), seq * batch, seq)
        if best is None or key > best[0]:
            best = (key, (seq, batch))
    return best[1] if best else None


def _limits(rows: pd.DataFrame) -> list[tuple[float, str, str]]:
    """Horizontal lines a peak must stay under: (bytes, label, linestyle)."""
    lines = []
    for value in sorted(set(rows["device_memory_bytes"].dropna())):
        lines.append((value, f"device memory ({fmt_bytes(value)})", "--"))
    for value in sorted(set(rows["memory_cap_bytes"].dropna())):
        lines.append((value, f"memory cap ({fmt_bytes(value)})", ":"))
    return lines


def peak_vs_seq(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    groups = sorted(dev.groupby(["setup", "batch_size"]), key=lambda kv: kv[0])
    if not groups:
        return "no records"
    groups, note = largest_panels(groups)
    scale, unit = byte_unit(max([dev["peak_bytes"].max(skipna=True) or 0,
                                 *[v for v, _, _ in _limits(dev)]]))
    fig, axes = panel_figure(len(groups), "Peak memory vs sequence length, per checkpoint policy",
                             dev["device_label"].iloc[0])
    legend_marks: dict[str, dict] = {}
    same = coincident(groups, "seq_len", "peak_bytes", from_zero=True)
    for ax, ((setup, batch), g) in zip(axes, groups):
        for policy, p in sorted(g.groupby("policy_label"), key=lambda kv: policy_rank(kv[0])):
            ok = p[p["status"] == "ok"].sort_values("seq_len")
            ax.plot(ok["seq_len"], ok["peak_bytes"] / scale, color=colors[policy], label=policy, **same.style(policy))
        limits = _limits(g)
        for value, label, style in limits:
            ax.axhline(value / scale, color="crimson", ls=style, lw=1.2, label=label)
        failed = g[g["status"].isin(["oom", "skipped"])]
        if len(failed):
            top = g["peak_bytes"].max(skipna=True)
            # Where the config would be: at least at the memory limit it hit; without a known limit, above the data.
            y = min(v for v, _, _ in limits) / scale if limits else ((top if top == top else scale) * 1.1) / scale
            where = " (drawn at the memory limit)" if limits else ""
            ranked = sorted(failed["policy_label"].unique(), key=policy_rank)
            for (policy, status), f in failed.groupby(["policy_label", "status"]):
                i = ranked.index(policy)
                shift = 2 ** (0.1 * (i - (len(ranked) - 1) / 2))  # side by side, not on top of each other
                hollow = status == "skipped"  # the sweep skipped it: larger than a config that ran out of memory
                mark = OOM_MARK | ({"color": "white", "edgecolors": colors[policy]} if hollow
                                   else {"color": colors[policy]})
                ax.scatter(f["seq_len"] * shift, [y] * len(f), **mark)
                legend_marks["skipped: larger than a config that ran out of memory" if hollow
                             else f"OOM: did not fit{where}"] = hollow
        log2_axis(ax, g["seq_len"])
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * 1.08)
        panel_title(ax, setup, f"batch {batch}")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(f"peak memory ({unit})\n{dev['peak_label'].iloc[0]}")
    extra = [(oom_handle(hollow), label) for label, hollow in sorted(legend_marks.items())]
    figure_legend(fig, axes, extra, colors, same.notes())
    return fig, "One line per policy; lower is better." + note + same.caption()


def time_vs_peak(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    ok = dev[(dev["status"] == "ok") & dev["peak_bytes"].notna() & dev["step_ms_median"].notna()]
    if ok.empty:
        return "no successful runs"
    groups = sorted(ok.groupby(["setup", "seq_len", "batch_size"]), key=lambda kv: (kv[1]["tokens"].iloc[0], kv[0]))
    groups, note = largest_panels(groups)
    groups = sorted(groups, key=lambda kv: kv[0])
    scale, unit = byte_unit(ok["peak_bytes"].max())
    fig, axes = panel_figure(len(groups), "Step time vs peak memory, with the Pareto frontier",
                             dev["device_label"].iloc[0])
    same = coincident(groups, "peak_bytes", "step_ms_median")
    for ax, ((setup, seq, batch), g) in zip(axes, groups):
        g = g.reset_index(drop=True)
        front = g.iloc[pareto_front(zip(g["peak_bytes"], g["step_ms_median"]))]
        ax.plot(front["peak_bytes"] / scale, front["step_ms_median"], drawstyle="steps-post", ls="--", color="grey",
                lw=1, zorder=2, label="Pareto frontier (no policy both smaller and faster)")
        for policy, p in sorted(g.groupby("policy_label"), key=lambda kv: policy_rank(kv[0])):
            on_front = p.index.isin(front.index)
            trusted = p["timing_trusted"].to_numpy(dtype=bool)
            # A policy on another one's point: a larger hollow mark of its own shape around that point.
            on = same.scatter_style(policy)
            legend_mark = {"s": 46} | on | ({"facecolors": "none", "edgecolors": colors[policy]} if on
                                            else {"color": colors[policy]})
            ax.scatter([], [], label=policy, **legend_mark)  # the legend's mark: solid, or as the ring
            ax.scatter(p["peak_bytes"] / scale, p["step_ms_median"], **({"s": 46, "zorder": 4, "linewidths": 1.2}
                                                                        | on),
                       facecolors=[("none" if on else colors[policy]) if t else pale(colors[policy])
                                   for t in trusted],
                       edgecolors=["black" if f else colors[policy] if not t or on else "none"
                                   for f, t in zip(on_front, trusted)])
        panel_title(ax, setup, f"seq {seq} x batch {batch}")
        ax.set_xlabel(f"peak memory ({unit})\n{dev['peak_label'].iloc[0]}")  # one line ran past a third panel
        ax.set_ylabel("step time, median (ms)")
        ax.margins(0.15)
    untrusted = not all(g["timing_trusted"].all() for _, g in groups)
    figure_legend(fig, axes, [(pale_handle(), UNTRUSTED_LABEL)] if untrusted else [], colors, same.notes())
    return fig, ("One point per policy; points ringed in black are on the Pareto frontier (lower-left is better)."
                 + (" A pale point's step time is not trusted (noisy steps or a busy machine)." if untrusted
                    else "") + note + same.caption())


def _pct(fraction: Any) -> float | None:
    return fraction * 100 if given(fraction) else None


def relative_cost(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    panels = []
    for setup, rows in sorted(dev.groupby("setup"), key=lambda kv: kv[0]):
        focus = _focus(rows, need_baseline=True)
        if focus is not None:
            g = rows[(rows["seq_len"] == focus[0]) & (rows["batch_size"] == focus[1]) & (rows["policy"] != "none")]
            if len(g):
                panels.append((setup, focus, g))
    if not panels:
        return "no seq x batch with a successful `none` baseline and another policy to compare with it"
    fig, axes = panel_figure(len(panels), "Relative cost of each checkpoint policy vs no checkpointing (none)",
                             dev["device_label"].iloc[0])
    ok = dev[dev["status"] == "ok"]
    paired = ok["time_x_paired"].all() if len(ok) else False
    how = "paired" if paired else "unpaired" if not ok["time_x_paired"].any() else "paired where marked"
    # Each bar's value, None where the record lacks it (a compiled CPU run has no peak and no FLOP count): no bar.
    bars = [("peak memory saved", "#55a868", lambda r: _pct(1 - r["peak_x_none"]) if given(r["peak_x_none"]) else None),
            (f"step time added ({how})", "#dd8452", lambda r: _pct(r["time_x"] - 1) if given(r["time_x"]) else None),
            ("FLOPs added by recompute", "#8c8c8c", lambda r: _pct(r["recompute_flops_ratio"]))]
    untrusted_seen = False
    for ax, (setup, (seq, batch), g) in zip(axes, panels):
        g = g.assign(_rank=g["policy_label"].map(policy_rank)).sort_values("_rank")
        policies = list(g["policy_label"])
        width = 0.26
        for j, (label, color, value) in enumerate(bars):
            xs, ys, records = [], [], []
            for i, r in enumerate(g.to_dict("records")):
                # A time ratio against another baseline than none would be a different bar: left out.
                if r["status"] == "ok" and (j != 1 or r["time_x_vs"] == "none") and value(r) is not None:
                    xs.append(i + (j - 1) * width)
                    ys.append(value(r))
                    records.append(r)
            if not xs:  # no record has this value (a compiled CPU run's peak): no bar, no legend entry
                continue
            yerr = _ratio_errors(records) if j == 1 else None
            drawn = ax.bar(xs, ys, width, color=color, label=label, hatch="//" if j == 2 else None,
                           edgecolor="white" if j != 2 else "#555555", linewidth=0.5, yerr=yerr,
                           error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "#333333"})
            trusted = [bool(r["ratio_trusted"]) if j == 1 else True for r in records]
            for patch, ok_ in zip(drawn.patches, trusted):
                if not ok_:
                    patch.set_hatch("xx")
                    patch.set_alpha(0.45)
                    untrusted_seen = True
            labels = [("" if t else "~") + f"{y:.0f}%" for y, t in zip(ys, trusted)]
            if yerr is None:
                ax.bar_label(drawn, labels=labels, fontsize=7, padding=1)
            else:  # above the error bar, not on it
                for x, y, low, high, text in zip(xs, ys, *yerr, labels):
                    ax.annotate(text, (x, y + high if y >= 0 else y - low), textcoords="offset points",
                                xytext=(0, 2 if y >= 0 else -2), ha="center", va="bottom" if y >= 0 else "top",
                                fontsize=7)
        for i, r in enumerate(g.to_dict("records")):
            if r["status"] != "ok":
                ax.text(i, 0, FAILED_TEXT.get(r["status"], r["status"]), ha="center", va="bottom", color="#b00020",
                        fontweight="bold")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlim(-0.6, len(policies) - 0.4)  # a policy's three bars keep their width where some are missing
        policy_ticks(ax, policies)
        ax.set_xlabel("checkpoint policy")
        ax.set_ylabel("% of the value under policy none")
        panel_title(ax, setup, f"seq {seq} x batch {batch}")
        ax.margins(y=0.15)
    extra = [(Patch(facecolor="#dd8452", alpha=0.45, hatch="xx", edgecolor="white"),
              "~ timing not trusted (noisy steps or a busy machine)")] if untrusted_seen else []
    figure_legend(fig, axes, extra, policies=colors)
    return fig, ("Per model setup, the seq x batch where the most policies ran. Memory saved: 1 - peak / none's "
                 "peak. Time added: " + ("the median of per-round step-time ratios to none, measured interleaved in "
                                         "one process, with its 95% interval as error bars" if paired else
                                         "median step time / none's - 1 (separate runs; paired where the bar has "
                                         "error bars)") + ". FLOPs added: recomputed FLOPs / none's FLOPs.")


def _ratio_errors(records: list[dict]) -> list[list[float]] | None:
    """Error bars (percentage points below, above) of paired ratios from their 95% intervals; 0 where unpaired."""
    lows, highs = [], []
    for r in records:
        ci = r.get("time_ratio_ci")
        paired = bool(r["time_x_paired"]) and isinstance(ci, list)
        lows.append((r["time_x"] - ci[0]) * 100 if paired else 0.0)
        highs.append((ci[1] - r["time_x"]) * 100 if paired else 0.0)
    return [lows, highs] if any(lows) or any(highs) else None


FAILED_TEXT = {"oom": "OOM", "timeout": "timeout", "error": "error"}


def memory_breakdown(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    panels = []
    for setup, rows in sorted(dev.groupby("setup"), key=lambda kv: kv[0]):
        focus = _focus(rows, need_baseline=False)
        if focus is not None:
            panels.append((setup, focus, rows[(rows["seq_len"] == focus[0]) & (rows["batch_size"] == focus[1])]))
    if not panels:
        return "no successful runs"
    scale, unit = byte_unit(max(p[2]["peak_bytes"].max() for p in panels))
    fig, axes = panel_figure(len(panels), "Memory breakdown per policy", dev["device_label"].iloc[0])
    parts = [("params", "param_bytes"), ("grads", "grad_bytes"), ("optimizer state", "optimizer_bytes"),
             ("activations", "activation_peak_bytes")]
    shortened = False
    for ax, (setup, (seq, batch), g) in zip(axes, panels):
        g = g.assign(_rank=g["policy_label"].map(policy_rank)).sort_values("_rank")
        records = g.to_dict("records")
        crowded = len(records) > CROWDED
        shortened |= crowded
        bottom = [0.0] * len(records)
        for label, col in parts:
            heights = [r[col] / scale if r["status"] == "ok" and given(r[col]) else 0 for r in records]
            ax.bar(range(len(records)), heights, 0.6, bottom=bottom, color=STATE_COLORS[label], label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for i, r in enumerate(records):
            if r["status"] == "ok" and given(r["peak_bytes"]):
                ax.scatter(i, r["peak_bytes"] / scale, marker="_", s=500, color="black", linewidths=2, zorder=5,
                           label="measured peak, whole step (incl. optimizer step)")
                if isinstance(r.get("peak_phase"), str):
                    words = PHASE_SHORT[r["peak_phase"]] if crowded else f"peak in\n{PHASE_WORDS[r['peak_phase']]}"
                    ax.annotate(words, (i, r["peak_bytes"] / scale), xytext=(0, 5), textcoords="offset points",
                                ha="center", va="bottom", fontsize=8,
                                color="#b00020" if r["peak_phase"] == "optimizer" else "black")
            else:
                ax.text(i, 0, FAILED_TEXT.get(r["status"], r["status"]), ha="center", va="bottom",
                        color="#b00020", fontweight="bold")
        policy_ticks(ax, [r["policy_label"] for r in records])
        ax.set_xlabel("checkpoint policy")
        ax.set_ylabel(f"memory ({unit})")
        panel_title(ax, setup, f"seq {seq} x batch {batch}")
        ax.margins(y=0.12 if crowded else 0.22)  # room for the phase label above the tallest bar
    figure_legend(fig, axes, policies=colors)
    return fig, (f"Per model setup, the seq x batch where the most policies ran. Activations = forward+backward "
                 f"peak above model state ({dev['peak_label'].iloc[0]}); the black tick is the whole step's peak, "
                 f"labelled with the phase that reached it: a peak in the optimizer step (red) is one no "
                 f"checkpointing policy can lower." + (" In panels of many policies the phase is fwd (forward), "
                                                       "bwd (backward) or opt (optimizer step)." if shortened else ""))


def throughput_vs_batch(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    everything = sorted(dev.groupby(["setup", "seq_len"]), key=lambda kv: kv[0])
    groups = [(key, g) for key, g in everything if (g["status"] == "ok").any()]
    if not groups:
        return "no successful runs"
    several = dev["setup"].nunique() > 1
    nothing_ran = [f"seq {seq}" + (f" of {setup}" if several else "") for (setup, seq), g in everything
                   if not (g["status"] == "ok").any()]
    groups, note = largest_panels(groups)
    fig, axes = panel_figure(len(groups), "Throughput vs batch size, per checkpoint policy",
                             dev["device_label"].iloc[0])
    oom_seen = untrusted = False
    same = coincident(groups, "batch_size", "tokens_per_s", from_zero=True)
    for ax, ((setup, seq), g) in zip(axes, groups):
        ranked = sorted(g.loc[g["status"] == "oom", "policy_label"].unique(), key=policy_rank)
        for policy, p in sorted(g.groupby("policy_label"), key=lambda kv: policy_rank(kv[0])):
            ok = p[p["status"] == "ok"].sort_values("batch_size")
            style = same.style(policy)
            ax.plot(ok["batch_size"], ok["tokens_per_s"], color=colors[policy], label=policy, **style)
            shaky = ok[~ok["timing_trusted"]]
            if len(shaky):
                untrusted = True
                fade(ax, shaky["batch_size"], shaky["tokens_per_s"], colors[policy], hollow=policy in same.same,
                     zorder=style.get("zorder", 5) + 1, marker=style["marker"], s=max(30, style["ms"] ** 2))
            oom = p[p["status"] == "oom"]
            if len(oom):
                oom_seen = True
                shift = 2 ** (0.1 * (ranked.index(policy) - (len(ranked) - 1) / 2))  # side by side
                ax.scatter(oom["batch_size"] * shift, [0] * len(oom), color=colors[policy], clip_on=False,
                           **OOM_MARK)
        log2_axis(ax, g["batch_size"])
        ax.set_ylim(bottom=0)
        panel_title(ax, setup, f"seq {seq}")
        ax.set_xlabel("batch size (samples per step)")
        ax.set_ylabel("throughput (tokens/s)")
    extra = [(oom_handle(), "OOM: did not fit (drawn at 0)")] if oom_seen else []
    extra += [(pale_handle(), UNTRUSTED_LABEL)] if untrusted else []
    figure_legend(fig, axes, extra, colors, same.notes())
    skipped = f" Not drawn, nothing ran: {', '.join(nothing_ran)}." if nothing_ran else ""
    return fig, ("Tokens per second = batch x seq / median step time; higher is better." + note + skipped
                 + same.caption())


# (file stem, title, function): the order is the report's order
FIGURES: list[tuple[str, str, Callable]] = [
    ("1-peak-vs-seq", "Peak memory vs sequence length", peak_vs_seq),
    ("2-time-vs-peak", "Step time vs peak memory (Pareto frontier)", time_vs_peak),
    ("3-relative-cost", "Relative cost vs none", relative_cost),
    ("4-memory-breakdown", "Memory breakdown", memory_breakdown),
    ("5-throughput-vs-batch", "Throughput vs batch size", throughput_vs_batch),
    ("6-predicted-vs-measured", "Predicted vs measured peak memory", predicted_vs_measured),
    ("7-fit-frontier", "Throughput at the largest fit vs memory budget", fit_frontier),
    ("8-predicted-vs-measured-time", "Predicted vs measured step time", predicted_vs_measured_time),
]
# Figures of every record; the others draw grids of runs and sweeps, without a fit's trials (figure 7 has them).
ALL_RECORDS = {"6-predicted-vs-measured", "7-fit-frontier"}
# Figures of peaks: a run that has none (compiled blocks on CPU, run_table.UNTRACKED) is left out of them, not drawn
# as a panel without a line or a bar of model state alone.
PEAK_FIGURES = {"1-peak-vs-seq", "2-time-vs-peak", "4-memory-breakdown"}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write_figures(frame: pd.DataFrame, root: Path, folder: str = "figures") -> dict[str, list[FigureFile]]:
    """Draw every figure for every device into root/folder as PNG and SVG; per device label, what was written
    (or why a figure was not drawn). File names carry the device when there is more than one."""
    (root / folder).mkdir(parents=True, exist_ok=True)
    colors = policy_colors([*frame["policy_label"], *frame["fit_policy"].dropna()])
    several = frame["device_label"].nunique() > 1
    written: dict[str, list[FigureFile]] = {}
    for device, dev in frame.groupby("device_label", sort=False):
        files = written.setdefault(device, [])
        for stem, title, draw in FIGURES:
            name = f"{stem}-{slug(device)}" if several else stem
            rows = dev if stem in ALL_RECORDS else without_fit_trials(dev)
            if "oom_limit" in rows:  # an oom not run (the host's free memory then, a plan's budget): not a result
                rows = rows[~rows["oom_limit"].isin(["free", "plan"])]
            if rows.empty:
                files.append(FigureFile(stem, title, "nothing measured here: only configs not run, or `gcbench fit` "
                                        "trials (figure 7 and the fit table)"))
                continue
            unmeasured = (rows["status"] == "ok") & rows["peak_bytes"].isna() & (stem in PEAK_FIGURES)
            compiled = "compile" in rows and bool((rows.loc[unmeasured, "compile"] == "blocks").all())
            rows = rows[~unmeasured]
            without = (f"{plural(int(unmeasured.sum()), 'successful run')} without a peak"
                       + (f": {UNTRACKED}" if compiled else "") if unmeasured.any() else "")
            if without and not (rows["status"] == "ok").any():
                files.append(FigureFile(stem, title, f"no run here has a peak ({without})"))
                continue
            with mpl.rc_context(STYLE):
                result = draw(rows, colors)
                if result is None:
                    continue
                if isinstance(result, str):
                    files.append(FigureFile(stem, title, result))
                    continue
                fig, caption = result
                caption += f" Left out: {without}." if without else ""
                png, svg = f"{folder}/{name}.png", f"{folder}/{name}.svg"
                fig.savefig(root / png, dpi=PNG_DPI, metadata={"Software": None})
                # The SVG keeps the layout the PNG's draw computed: constrained layout, half of a save's time, once
                fig.set_layout_engine("none")
                fig.savefig(root / svg, metadata={"Date": None})
            files.append(FigureFile(stem, f"{title} — {device}", caption, png, svg))
    return written
