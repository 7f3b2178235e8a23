"""The figures of predictions held against measurements, a point per config: predicted vs measured peak memory,
and predicted vs measured step time (the time model's, estimators/step_time.py, where a CUDA record carries it)."""

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


def predicted_vs_measured_time(dev: pd.DataFrame, colors: dict[str, str]) -> Drawn:
    if "predicted_step_ms" not in dev:
        return None  # no record predicted its time: the figure does not apply
    rows = dev[(dev["status"] == "ok") & dev["predicted_step_ms"].notna() & dev["step_ms_median"].notna()]
    if rows.empty:
        return None
    hi = max(rows["step_ms_median"].max(), rows["predicted_step_ms"].max()) * 1.1
    fig, [ax] = panel_figure(1, "Predicted vs measured step time", dev["device_label"].iloc[0])
    ax.plot([0, hi], [0, hi], color="black", lw=1, label="prediction = measurement")
    ax.fill_between([0, hi], [0, hi * 0.9], [0, hi * 1.1], color="grey", alpha=0.15, label="within ±10%")
    same = coincident([(None, rows)], "step_ms_median", "predicted_step_ms")
    for policy, p in sorted(rows.groupby("policy_label"), key=lambda kv: policy_rank(kv[0])):
        on = same.scatter_style(policy)
        for trusted, q in p.groupby("timing_trusted"):
            # a timing not trusted is drawn hollow, as in the other figures
            face = colors[policy] if trusted and not on else "none"
            ax.scatter(q["step_ms_median"], q["predicted_step_ms"], s=on["s"] if on else 36,
                       zorder=on["zorder"] if on else 4, facecolors=face, edgecolors=colors[policy],
                       label=policy if trusted or not p["timing_trusted"].any() else None)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (ms, median of the timed steps)")
    ax.set_ylabel("predicted step time (ms)")
    figure_legend(fig, [ax], policies=colors, notes=same.notes())
    err = (rows["predicted_step_ms"] / rows["step_ms_median"] - 1).abs()
    untrusted = int((~rows["timing_trusted"]).sum())
    hollow = f" Hollow: a timing not trusted ({untrusted} of {len(rows)})." if untrusted else ""
    return fig, ("One point per config that ran on a card the time model knows (predicted before the run from the "
                 "simulated step and the card's rates: docs/methodology.md, \"Predicting step time\"); points above "
                 f"the diagonal over-predict. Median |error| {err.median():.1%}, worst {err.max():.1%}." + hollow
                 + same.caption())
