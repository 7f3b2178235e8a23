"""The figure of `gcbench fit`'s answers: throughput at each policy's largest fitting size against the memory
budget, one line per policy (the frontier a user picks a card and a policy from)."""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes

from gcbench.report.figure_layout import (MAX_PANELS, OOM_MARK, UNTRUSTED_LABEL, Coincident, Drawn, figure_legend,
                                          fade, oom_handle, pale_handle, panel_figure, panel_title)
from gcbench.results.frame import SIZE_WORDS, as_int, fit_summary, given, policy_rank
from gcbench.units import byte_unit


def fit_frontier(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    summary = fit_summary(dev)
    if summary.empty:
        return None  # no `gcbench fit` records: the figure does not apply
    groups = list(summary.groupby(["fit_setup", "vary", "fixed"], sort=False))
    note = f" Showing {MAX_PANELS} of {len(groups)} setups." if len(groups) > MAX_PANELS else ""
    groups = groups[:MAX_PANELS]
    scale, unit = byte_unit(summary["budget_bytes"].max())
    fig, axes = panel_figure(len(groups), "Throughput at the largest size that fits, vs memory budget",
                             dev["device_label"].iloc[0])
    none_fit = paired_any = shaky = tied = False
    same = Coincident()
    for _, g in groups:
        fits = g[g["maximum"].notna()]
        same.panel({policy: (p["budget_bytes"].astype(float).tolist(), p["rate"].astype(float).tolist())
                    for policy, p in sorted(fits.groupby("policy"), key=lambda kv: policy_rank(kv[0]))},
                   from_zero=True)
    for ax, ((setup, vary, fixed), g) in zip(axes, groups):
        word = SIZE_WORDS[vary]
        labels: list[tuple[float, float, str, str]] = []
        one_budget = g["budget_bytes"].nunique() == 1  # then a label names its policy: x tells nothing apart
        for policy, p in sorted(g.groupby("policy"), key=lambda kv: policy_rank(kv[0])):
            fits = p[p["maximum"].notna()]
            ax.plot(fits["budget_bytes"] / scale, fits["rate"].astype(float), color=colors[policy], label=policy,
                    **same.style(policy))
            labels += [(r["budget_bytes"] / scale, float(r["rate"]),
                        (f"{policy}: " if one_budget else "") + f"{as_int(r['maximum'])}", colors[policy])
                       for _, r in fits.iterrows()]
            faded = fits[[_shaky(r) for _, r in fits.iterrows()]]
            if len(faded):  # the line's own marker, faded as every figure fades a timing not trusted
                shaky = True
                fade(ax, faded["budget_bytes"] / scale, faded["rate"].astype(float), colors[policy], zorder=4, s=40)
            best, even = fits[fits["best"]], fits[fits["tied"]]
            ax.scatter(best["budget_bytes"] / scale, best["rate"].astype(float), s=130, facecolors="none",
                       edgecolors="black", linewidths=1.2, zorder=5, label="fastest at its budget")
            ax.scatter(even["budget_bytes"] / scale, even["rate"].astype(float), s=130, facecolors="none",
                       edgecolors="black", linewidths=1.0, linestyles="--", zorder=5)
            tied |= len(even) > 0
            nothing = p[p["maximum"].isna() & ~p["stopped"]]  # a stopped search has no answer to draw
            if len(nothing):
                none_fit = True
                ax.scatter(nothing["budget_bytes"] / scale, [0] * len(nothing), color=colors[policy], clip_on=False,
                           **OOM_MARK)
        paired_any |= bool(g["rate_paired"].any())
        budgets = sorted(set(g["budget_bytes"] / scale))
        ax.set_xticks(budgets, [f"{b:,.4g}" for b in budgets])
        ax.set_xlim(budgets[0] - 0.15 * (budgets[-1] - budgets[0] or budgets[0]),
                    budgets[-1] + (0.25 if len(budgets) > 1 else 0.6) * (budgets[-1] - budgets[0] or budgets[0]))
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * 1.08)
        _placed_labels(ax, labels)
        panel_title(ax, setup, f"largest {word} (the numbers) at {fixed}")
        ax.set_xlabel(f"memory budget ({unit})")
        ax.set_ylabel("throughput (tokens/s)")
    extra = [(oom_handle(), "nothing fit (drawn at 0)")] if none_fit else []
    extra += [(pale_handle(), UNTRUSTED_LABEL)] if shaky else []
    extra += [(axes[0].scatter([], [], s=130, facecolors="none", edgecolors="black", linewidths=1.0, linestyles="--"),
               "not told apart from the fastest")] if tied else []
    figure_legend(fig, axes, extra, colors, same.notes())
    how = ("paired tokens/s where one search timed all of a budget's winners interleaved, else each run's own"
           if paired_any else "each run's own tokens/s")
    return fig, (f"One point per policy and budget, at the largest size that ran (the number beside it; the "
                 f"fit table gives the size above it and what it did); y = {how}; ringed = the fastest at its "
                 f"budget" + ("; dashed ring = not told apart from it (a rerun may order them the other way)"
                              if tied else "") + ("; a pale point's own timing is not trusted" if shaky else "")
                 + ". Higher is better." + note + same.caption())


def _shaky(row: pd.Series) -> bool:
    """A point whose y is its run's own tokens/s, a timing not trusted."""
    return not row["rate_paired"] and given(row["timing_trusted"]) and not row["timing_trusted"]


def _placed_labels(ax: Axes, labels: list[tuple[float, float, str, str]]) -> None:
    """Text labels (x, y, text, colour) right of their points: those at one x spread apart as little as keeps them
    from overlapping (around their points, not piled above them) and inside the panel, each joined to its point by
    a thin line where it had to move."""
    x0, x1 = ax.get_xlim()
    top = ax.get_ylim()[1]
    gap = 0.065 * top  # a label's height, and some air, at the panel's usual size
    for x in sorted({x for x, *_ in labels}):
        here = sorted((lab for lab in labels if lab[0] == x), key=lambda lab: lab[1])
        for (_, y, text, color), placed in zip(here, spread([lab[1] for lab in here], gap, gap / 2, top - gap / 2)):
            moved = abs(placed - y) > 0.25 * gap
            ax.annotate(text, (x, y), xytext=(x + 0.07 * (x1 - x0), placed), fontsize=7, color=color, va="center",
                        arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6, "shrinkA": 0, "shrinkB": 4}
                        if moved else None)


def spread(wanted: list[float], gap: float, low: float, high: float) -> list[float]:
    """Positions for labels wanted at `wanted` (ascending): at least `gap` apart, within [low, high] where they fit,
    and each block of labels that had to move centred on the mean of where its labels wanted to be."""
    blocks: list[list] = []  # [first index, last index + 1, position of the first]
    for i, y in enumerate(wanted):
        blocks.append([i, i + 1, y])
        while len(blocks) > 1 and blocks[-2][2] + (blocks[-2][1] - blocks[-2][0]) * gap > blocks[-1][2]:
            first, end = blocks[-2][0], blocks[-1][1]
            mean = sum(wanted[first:end]) / (end - first)
            blocks[-2:] = [[first, end, mean - (end - first - 1) * gap / 2]]
    placed = [start + k * gap for first, end, start in blocks for k in range(end - first)]
    n = len(placed)
    placed = [max(p, low + i * gap) for i, p in enumerate(placed)]
    return [min(p, high - (n - 1 - i) * gap) for i, p in enumerate(placed)]
