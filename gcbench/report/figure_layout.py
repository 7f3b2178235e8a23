"""What every figure of the report shares: the style, a colour per policy, the grid of panels with the device in
the title, one legend under the panels, doubling (log2) axes, and the mark of a config that did not fit."""

from __future__ import annotations

import math

import matplotlib as mpl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D

from gcbench.results.frame import policy_rank

Drawn = tuple[Figure, str] | str | None  # (figure, caption) | why nothing was drawn | None: does not apply
PANEL_IN = (4.4, 3.3)  # inches per panel
MAX_PANELS = 12  # larger grids show their largest configs; the caption says so
STYLE = {"font.size": 9, "axes.titlesize": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False, "legend.fontsize": 8, "svg.fonttype": "none", "svg.hashsalt": "gcbench"}
OOM_MARK = dict(marker="X", s=90, edgecolors="black", linewidths=0.8, zorder=6)


def policy_colors(labels) -> dict[str, str]:
    """The same colour for a policy in every figure of a report; `none`, the baseline, is dark grey."""
    palette = [c for i, c in enumerate(mpl.colormaps["tab10"].colors) if i != 7]  # tab10's grey is for `none`
    ordered = sorted(set(labels) - {"none"}, key=policy_rank)
    return {"none": "#404040"} | {p: mpl.colors.to_hex(palette[i % len(palette)]) for i, p in enumerate(ordered)}


def panel_figure(n: int, title: str, device: str, legend_cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure of n panels, three to a row, titled with what it shows and the device it was measured on."""
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(max(PANEL_IN[0] * ncols, 7.0), PANEL_IN[1] * nrows + 1.4), layout="constrained")
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{device}", fontsize=11, fontweight="bold")
    return fig, axes[:n]


def figure_legend(fig: Figure, axes: list[Axes], extra: list[tuple[object, str]] = (), policies=()) -> None:
    """One legend for the whole figure, under the panels: each label once, the policies first in policy order."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    for handle, label in extra:
        seen.setdefault(label, handle)
    order = list(seen)
    seen = dict(sorted(seen.items(), key=lambda kv: (0, *policy_rank(kv[0])) if kv[0] in policies
                       else (1, order.index(kv[0]), "")))
    # As many columns as the figure's width holds for its longest label (about 0.6 em per character + the mark).
    size = FontProperties(size=mpl.rcParams["legend.fontsize"]).get_size_in_points()
    entry_pt = 0.6 * size * max(map(len, seen), default=1) + 40
    ncols = max(1, min(len(seen), 4, int(fig.get_figwidth() * 72 // entry_pt)))
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", frameon=False, ncols=ncols)


def log2_axis(ax: Axes, values) -> None:
    ticks = sorted(set(int(v) for v in values))
    ax.set_xscale("log", base=2)  # seq and batch grids double; even one tick keeps side-by-side marks close
    ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def largest_panels(groups: list, n: int = MAX_PANELS) -> tuple[list, str]:
    """At most n panels, keeping the configs with the most tokens per step."""
    if len(groups) <= n:
        return groups, ""
    return groups[-n:], f" Showing the {n} largest of {len(groups)} configs."


def oom_handle(hollow: bool = False) -> Line2D:
    """The legend's mark for configs that did not fit (filled) or were skipped as too large (hollow)."""
    return Line2D([], [], ls="", marker="X", markersize=9, markeredgecolor="black",
                  markerfacecolor="white" if hollow else "black")
