"""What every figure of the report shares: the style, a colour per policy, the grid of panels with the device in
the title, one legend under the panels, doubling (log2) axes, and the mark of a config that did not fit."""

from __future__ import annotations

import math
import textwrap

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
         "axes.spines.right": False, "legend.fontsize": 8, "svg.fonttype": "none", "svg.hashsalt": "gcbench",
         "text.parse_math": False}  # a $ in a model's name is a dollar sign, not mathematics (nor a parse error)
# characters in one line of a panel's title (9 pt, PANEL_IN wide: a 62-character setup ran off the figure's right
# edge): longer setups wrap at their spaces rather than run into the next panel or off the figure
TITLE_CHARS = 50
CROWDED = 4  # more bars than this in a panel: policy names slanted, phase words short
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


def panel_title(ax: Axes, setup: str, detail: str) -> None:
    """A panel's title: its model setup, wrapped between its parts (" · ") to the panel's width, then what the
    panel holds (seq, batch)."""
    lines: list[str] = []
    for part in setup.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= TITLE_CHARS:
            lines[-1] += " · " + part
        else:
            lines.extend(textwrap.wrap(part, TITLE_CHARS) or [part])  # a part longer than a line is cut
    ax.set_title("\n".join(lines + [detail]))


def policy_ticks(ax: Axes, labels: list[str]) -> None:
    """One tick per policy bar; slanted and right-aligned under their bars where many would run together."""
    if len(labels) > CROWDED:
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticks(range(len(labels)), labels, rotation=15)


def figure_legend(fig: Figure, axes: list[Axes], extra: list[tuple[object, str]] = (), policies=(),
                  notes: dict[str, str] | None = None) -> None:
    """One legend for the whole figure, under the panels: each label once, the policies first in policy order;
    `notes`: a label's text in the legend where it says more than the label (Coincident.notes)."""
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
    entry_pt = 0.6 * size * max((len((notes or {}).get(k, k)) for k in seen), default=1) + 40
    ncols = max(1, min(len(seen), 4, int(fig.get_figwidth() * 72 // entry_pt)))
    texts = [(notes or {}).get(label, label) for label in seen]
    fig.legend(list(seen.values()), texts, loc="outside lower center", frameon=False, ncols=ncols)


def log2_axis(ax: Axes, values) -> None:
    ticks = sorted(set(int(v) for v in values))
    ax.set_xscale("log", base=2)  # seq and batch grids double; even one tick keeps side-by-side marks close
    ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def largest_panels(groups: list, n: int = MAX_PANELS) -> tuple[list, str]:
    """At most n panels ((key, rows) pairs, in the order given), keeping those whose configs have the most tokens
    per step, then the most records (policies) among equals."""
    if len(groups) <= n:
        return groups, ""
    ranked = sorted(range(len(groups)), key=lambda i: (groups[i][1]["tokens"].max(), len(groups[i][1])),
                    reverse=True)
    kept = sorted(ranked[:n])
    return [groups[i] for i in kept], f" Showing the {n} largest of {len(groups)} configs."


def oom_handle(hollow: bool = False) -> Line2D:
    """The legend's mark for configs that did not fit (filled) or were skipped as too large (hollow)."""
    return Line2D([], [], ls="", marker="X", markersize=9, markeredgecolor="black",
                  markerfacecolor="white" if hollow else "black")


# How the 2nd, 3rd... of policies whose marks coincide are drawn over the first (which keeps a solid line and a dot):
# a dash that lets the line under it show through its gaps, and a larger hollow mark that rings the one under it.
SAME_MARKS = [dict(marker="s", ms=8, mfc="none", mew=1.3, ls=(0, (4, 3))),
              dict(marker="D", ms=10, mfc="none", mew=1.3, ls=(2, (2, 5))),
              dict(marker="^", ms=11, mfc="none", mew=1.3, ls=(0, (1, 3))),
              dict(marker="v", ms=12, mfc="none", mew=1.3, ls=(0, (6, 2, 1, 2)))]
SAME_TOLERANCE = 0.015  # of the panel's span on each axis: closer marks are drawn on top of each other


class Coincident:
    """Policies whose marks lie on another policy's in a figure (two policies with the same peak draw as one line):
    found panel by panel before anything is drawn, then each drawn in a style of its own and named in the legend
    ("every-k:k=1 (same as full)"), so that no policy hides behind another. Positions are never moved."""

    def __init__(self) -> None:
        self.same: dict[str, dict[str, int]] = {}  # policy -> the earlier policy it lies on -> in how many panels
        self.shared: dict[tuple[str, str], int] = {}  # (policy, earlier) -> panels that draw both
        self.near: set[tuple[str, str]] = set()  # (policy, earlier) close somewhere, not equal

    def panel(self, series: dict[str, tuple[list[float], list[float]]], from_zero: bool = False) -> None:
        """One panel's marks per policy, in drawing (policy) order: x and y values. `from_zero`: the y axis starts
        at 0 (what looks close is then relative to the largest y, not to the spread of the values)."""
        xs = [x for px, _ in series.values() for x in px]
        ys = [y for _, py in series.values() for y in py]
        if not xs:
            return
        span = [(max(v) - min(v)) or abs(max(v)) or 1.0 for v in (xs, ys)]
        if from_zero:
            span[1] = max(map(abs, ys)) or 1.0
        drawn = [label for label, (px, _) in series.items() if len(px)]
        for i, label in enumerate(drawn):
            for earlier in drawn[:i]:
                self.shared[(label, earlier)] = self.shared.get((label, earlier), 0) + 1
            for earlier in drawn[:i]:
                if _same(series[label], series[earlier], span):
                    self.same.setdefault(label, {})
                    self.same[label][earlier] = self.same[label].get(earlier, 0) + 1
                    if not _same(series[label], series[earlier], span, tolerance=1e-9):
                        self.near.add((label, earlier))
                    break

    def style(self, label: str) -> dict:
        """The plot() keywords of a policy's line: its own marker and dash where it lies on another policy's."""
        if label not in self.same:
            return {"marker": "o", "ms": 4}
        # The 2nd, 3rd... policy on one policy's marks (directly or through another): each its own style.
        group = [other for other in self.same if self._first(other) == self._first(label)]
        n = group.index(label)
        return SAME_MARKS[n % len(SAME_MARKS)] | {"zorder": 4 + n}

    def _first(self, label: str) -> str:
        for _ in range(len(self.same) + 1):  # a chain of policies each on the one before (never a circle)
            if label not in self.same:
                break
            label = next(iter(self.same[label]))
        return label

    def scatter_style(self, label: str) -> dict:
        """The same for scatter(): a larger mark of another shape (the caller leaves it hollow) around the one it
        lies on; {} for a policy on no other."""
        line = self.style(label)
        if label not in self.same:
            return {}
        return {"marker": line["marker"], "s": line["ms"] ** 2 * 1.6, "linewidths": line["mew"],
                "zorder": line["zorder"] + 2}

    def notes(self) -> dict[str, str]:
        """Legend text for the policies that lie on another one's: which, whether the same or only close (within
        SAME_TOLERANCE), and in how many of the panels."""
        out = {}
        for label, on in self.same.items():
            parts = []
            for earlier, n in on.items():
                both = self.shared.get((label, earlier), n)
                how = "close to" if (label, earlier) in self.near else "same as"
                parts.append(f"{how} {earlier}" + ("" if n == both else f" in {n} of {both} panels"))
            out[label] = f"{label} ({'; '.join(parts)})"
        return out

    def caption(self) -> str:
        """A sentence for the figure's caption where some policy lies on another, else nothing."""
        if not self.same:
            return ""
        return (" Where a policy's marks lie on another's, it is drawn over them dashed, with larger hollow marks (the "
                "legend says which).")


def _same(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]], span: list[float],
          tolerance: float = SAME_TOLERANCE) -> bool:
    """Every mark of `a` lies on one of `b`'s (a shorter line on a longer one hides just as well)."""
    def near(p: tuple[float, float], q: tuple[float, float]) -> bool:
        return all(abs(u - v) <= tolerance * w for u, v, w in zip(p, q, span))

    return all(any(near(p, q) for q in zip(*b)) for p in zip(*a))


def coincident(groups: list, x: str, y: str, within: str | None = None, from_zero: bool = False) -> Coincident:
    """Which policies' marks lie on another policy's, over a figure's panels ((key, rows) each): per panel, each
    ok record's (x, y) per policy, in policy order; `within`: a column whose values are kept apart (a method);
    `from_zero`: as Coincident.panel."""
    same = Coincident()
    for _, g in groups:
        ok = g[(g["status"] == "ok") & g[x].notna() & g[y].notna()].sort_values(x)
        parts = [ok] if within is None else [part for _, part in ok.groupby(within)]
        for part in parts:
            series = {policy: (p[x].astype(float).tolist(), p[y].astype(float).tolist())
                      for policy, p in sorted(part.groupby("policy_label"), key=lambda kv: policy_rank(kv[0]))}
            same.panel(series, from_zero)
    return same


UNTRUSTED_LABEL = "pale: timing not trusted"


def pale(color: str) -> tuple[float, float, float, float]:
    """A policy's colour, faded: the fill of a point whose timing is not trusted (its edge keeps the colour)."""
    return mpl.colors.to_rgba(color, 0.3)


def pale_handle() -> Line2D:
    return Line2D([], [], ls="", marker="o", markersize=7, markerfacecolor=pale("#404040"),
                  markeredgecolor="#404040")


def fade(ax: Axes, xs, ys, color: str, hollow: bool = False, zorder: float = 5, **mark) -> None:
    """Points whose timing is not trusted drawn over their line's own markers, faded: a white underlay (none for a
    `hollow` mark, which has no inside to fade), then the colour's pale fill with its edge."""
    if not hollow:
        ax.scatter(xs, ys, facecolors="white", edgecolors="none", zorder=zorder, **mark)
    ax.scatter(xs, ys, facecolors=pale(color), edgecolors=color, zorder=zorder, **mark)
