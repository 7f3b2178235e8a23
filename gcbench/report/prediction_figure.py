"""The figure of predictions held against measurements: predicted vs measured peak memory, a point per config."""

from __future__ import annotations

import pandas as pd
from matplotlib.lines import Line2D

from gcbench.report.figure_layout import Drawn, coincident, figure_legend, panel_figure
from gcbench.results.frame import policy_rank
from gcbench.units import byte_unit


def predicted_vs_measured(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    rows = dev[(dev["status"] == "ok") & dev["predicted_peak_bytes"].notna() & dev["peak_bytes"].notna()]
    if rows.empty:
        return None  # records without predictions: the figure simply does not apply
    scale, unit = byte_unit(max(rows["peak_bytes"].max(), rows["predicted_peak_bytes"].max()))
    fig, [ax] = panel_figure(1, "Predicted vs measured peak memory", dev["device_label"].iloc[0])
    hi = max(rows["peak_bytes"].max(), rows["predicted_peak_bytes"].max()) / scale * 1.1
    ax.plot([0, hi], [0, hi], color="black", lw=1, label="prediction = measurement")
    ax.fill_between([0, hi], [0, hi * 0.9], [0, hi * 1.1], color="grey", alpha=0.15, label="within ±10%")
    methods = rows["prediction_method"].fillna("unnamed method") if "prediction_method" in rows \
        else pd.Series("unnamed method", index=rows.index)
    markers = dict(zip(sorted(set(methods)), "os^Dv"))
    same = coincident([(None, rows.assign(_method=methods))], "peak_bytes", "predicted_peak_bytes",
                      within="_method")
    for (policy, method), p in sorted(rows.groupby(["policy_label", methods]), key=lambda kv: policy_rank(kv[0][0])):
        # The shape says the method here: a policy on another one's point is a larger ring of that shape.
        on = same.scatter_style(policy)
        ax.scatter(p["peak_bytes"] / scale, p["predicted_peak_bytes"] / scale, label=policy,
                   **({"s": 36, "zorder": 4, "color": colors[policy]} | ({"s": on["s"], "zorder": on["zorder"],
                                                                          "facecolors": "none",
                                                                          "edgecolors": colors[policy]} if on else {})),
                   marker=markers[method])
    if len(markers) > 1:  # say which shape is which method; with one method the caption names it
        ax.legend([Line2D([], [], ls="", marker=m, color="grey") for m in markers.values()],
                  [f"method: {name}" for name in markers], loc="upper left", frameon=False)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel(f"measured peak ({unit}) — {dev['peak_label'].iloc[0]}")
    ax.set_ylabel(f"predicted peak ({unit})")
    figure_legend(fig, [ax], policies=colors, notes=same.notes())
    err = rows["prediction_error"].abs()
    return fig, (f"One point per config that ran; points above the diagonal over-predict. Prediction method: "
                 f"{', '.join(markers)}. Median |error| {err.median():.1%}, worst {err.max():.1%}."
                 + same.caption())
