"""Showing results to people: unit conversion for display, rich tables, and the `gcbench report` document
(report.md and a self-contained report.html; the figures themselves live in figures.py)."""

from __future__ import annotations

import base64
import html
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gcbench.errors import GcbenchError
from gcbench.results.schema import peak_bytes, policy_label
from gcbench.units import byte_unit, fmt_bytes, human_count



def run_table(record: dict[str, Any]) -> Table:
    """The one-run table `gcbench run` prints: memory, breakdown, time, throughput, recompute cost."""
    cuda = str(record["device"]).startswith("cuda")
    env = record.get("env") or {}
    where = env.get("gpu_name") or f"CPU ({env.get('torch_threads')} threads)"
    title = (f"{record['model']} ({record.get('n_layers')} blocks) · seq {record['seq_len']} · batch "
             f"{record['batch_size']} · {policy_label(record)} · {record['precision']} · {where}")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("what it is", style="dim")
    if record["status"] != "ok":
        table.add_row("status", f"[bold red]{record['status']}[/]", record.get("error") or "")
        return table
    if cuda:
        table.add_row("peak memory", fmt_bytes(record["peak_allocated_bytes"]),
                      "torch.cuda.max_memory_allocated, whole step")
        table.add_row("peak reserved", fmt_bytes(record["peak_reserved_bytes"]), "allocator cache incl. fragmentation")
    else:
        table.add_row("peak memory (tracked)", fmt_bytes(record["peak_tracked_bytes"]),
                      "peak of live tensor bytes on CPU (not an allocator)")
    measured = peak_bytes(record)
    if record.get("predicted_peak_bytes"):
        error = record["predicted_peak_bytes"] / measured - 1
        table.add_row("predicted peak", fmt_bytes(record["predicted_peak_bytes"]),
                      f"{record.get('prediction_method')} before the run, {error:+.1%} vs measured")
    table.add_row("activation peak", fmt_bytes(record["activation_peak_bytes"]), "fwd+bwd peak above model state")
    table.add_row("saved activations", fmt_bytes(record["saved_activation_bytes"]), "kept for backward after forward")
    if record.get("offloaded_bytes") is not None:
        table.add_row("offloaded to host", fmt_bytes(record["offloaded_bytes"]), "host copies per forward (offload)")
    if record.get("compile_ms") is not None:
        table.add_row("compile time", f"{record['compile_ms'] / 1e3:.1f} s", "torch.compile, not in step time")
    state = record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"]
    table.add_row("model state", fmt_bytes(state),
                  f"params {fmt_bytes(record['param_bytes'])} + grads {fmt_bytes(record['grad_bytes'])} "
                  f"+ {record['optimizer']} {fmt_bytes(record['optimizer_bytes'])}")
    table.add_row("step time (median)", f"{record['step_ms_median']:.1f} ms",
                  f"IQR {record['step_ms_iqr']:.1f} ms over {len(record['step_ms'])} steps")
    table.add_row("throughput", f"{record['tokens_per_s']:,.0f} tokens/s", "batch x seq / median step")
    ratio = record.get("recompute_flops_ratio")
    table.add_row("recompute FLOPs", "-" if ratio is None else f"+{ratio:.1%}",
                  f"{human_count(record['flops'], 'FLOP')} per step vs {human_count(record['model_flops'], 'FLOP')}")
    if record.get("mfu") is not None:
        table.add_row("MFU", f"{record['mfu']:.1%}", "model FLOPs / step time / dense bf16 peak")
    return table




def estimate_table(rows: list[dict[str, Any]], memory_bytes: int | None = None) -> Table:
    """The table `gcbench estimate` prints: one row per config and method (rows are Estimate.as_record()s).
    Byte columns share one unit, chosen for the largest peak; what all rows share goes into the title."""
    from rich import box

    first = rows[0]
    scale, unit = byte_unit(max(r["peak_bytes"] for r in rows))
    models = {r["model"] + (f" ({r['layers']} blocks)" if r.get("layers") else "") for r in rows}
    predicted = "torch.cuda.max_memory_allocated" if first["target"] == "cuda" else "CPU live-tensor peak"
    kernels = ", ".join(sorted({r["attention_kernel"] for r in rows}))
    title = (f"{', '.join(sorted(models)) + ' · ' if len(models) == 1 else ''}predicted peak of one training step "
             f"({predicted}) · {first['precision']} · {first['optimizer']} · attention: {kernels}")
    caption = (f"{unit}; activ. = everything else at the peak; * = peak in the optimizer step (its temporaries)"
               + (f"; fits = peak <= {fmt_bytes(memory_bytes)}" if memory_bytes else ""))
    table = Table(title=title, caption=caption, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = (["model"] if len(models) > 1 else []) + ["seq", "batch", "policy", "method", "params", "grads",
                                                        "optim.", "activ.", "peak"]
    for col in columns + (["fits"] if memory_bytes else []) + ["time"]:
        table.add_column(col, justify="left" if col in ("model", "policy", "method", "fits") else "right")
    for r in rows:
        cells = [str(r["model"])] if len(models) > 1 else []
        cells += [str(r["seq_len"]), str(r["batch_size"]), r["policy"], r["method"]]
        cells += [f"{r[k] / scale:.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
        cells.append(f"{r['activation_bytes'] / scale:.2f}" + ("*" if r["peak_phase"] == "optimizer step" else ""))
        cells.append(f"[bold]{r['peak_bytes'] / scale:.2f}[/]")
        if memory_bytes:
            cells.append("[green]yes[/]" if r["peak_bytes"] <= memory_bytes else "[red]no[/]")
        cells.append(f"{r['seconds']:.2f}s")
        table.add_row(*cells)
    return table


# ---- many records: the tables and the document of `gcbench report` --------------------------------------------

PEAK_LABELS = {"cpu": "tracked live-tensor peak (CPU)", "cuda": "torch.cuda.max_memory_allocated (CUDA)"}
# `x none` ratios are taken inside these groups and never across them: a device, a model setup, one seq and batch.
GROUP_KEYS = ["device_label", "setup", "seq_len", "batch_size"]
# Columns the report reads. A file of OOMs only has none of the measurements, so they are added empty.
EXPECTED = ["peak_allocated_bytes", "peak_tracked_bytes", "activation_peak_bytes", "fwd_bwd_peak_bytes",
            "param_bytes", "grad_bytes", "optimizer_bytes", "step_ms_median", "step_ms_iqr", "tokens_per_s",
            "recompute_flops_ratio", "predicted_peak_bytes", "predicted_peak_bytes_simulate",
            "predicted_peak_bytes_analytic", "layers", "attn", "memory_cap_bytes", "seed", "error",
            "env.gpu_name", "env.gpu_memory_bytes", "env.cpu", "env.cpu_count", "env.torch_threads", "env.gcbench"]
ENV_ROWS = [  # (label, column) of the environment table; rows without any value are left out
    ("gcbench", "env.gcbench"), ("git commit", "env.git_sha"), ("python", "env.python"), ("torch", "env.torch"),
    ("transformers", "env.transformers"), ("platform", "env.platform"), ("CPU", "env.cpu"),
    ("CPU cores", "env.cpu_count"), ("torch threads", "env.torch_threads"), ("GPU", "env.gpu_name"),
    ("GPU memory", "env.gpu_memory_bytes"), ("driver", "env.driver"), ("CUDA", "env.cuda"),
    ("float32 matmul precision", "env.float32_matmul_precision"), ("TF32 matmul", "env.allow_tf32_matmul"),
    ("PYTORCH_CUDA_ALLOC_CONF", "env.pytorch_cuda_alloc_conf"),
]
FAILED = {"oom": "OOM", "timeout": "timeout", "error": "error", "skipped": "skipped"}


def _given(value: Any) -> bool:
    """Not None and not a pandas NaN (JSON null becomes either, depending on the column)."""
    return value is not None and not (isinstance(value, float) and value != value)


def _int(value: Any) -> int:
    return int(value)  # NaN-padded integer columns come back as floats; labels want "2", not "2.0"


def load_results(paths: Iterable[str | Path]) -> tuple[pd.DataFrame, list[str]]:
    """`load()` for a report: (DataFrame, warnings as one-line strings). No records at all is a GcbenchError;
    an empty file beside files with records is only a warning (a sweep may have just started it)."""
    from gcbench.results.frame import load
    from gcbench.results.store import result_files

    files = result_files(paths)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load(*files)
    notes = [str(w.message) for w in caught]
    if df.empty:
        raise GcbenchError(f"no records in {', '.join(map(str, files))} (empty results)")
    empty = sorted({str(f) for f in files} - set(df["source"]))
    notes += [f"{f}: no records (empty file), left out" for f in empty]
    return df, notes


def device_label(row: dict[str, Any]) -> str:
    """What the numbers were measured on; records with different labels are never compared or averaged."""
    if str(row["device"]).startswith("cuda"):
        return str(row["env.gpu_name"]) if _given(row.get("env.gpu_name")) else str(row["device"])
    cpu = row.get("env.cpu") if _given(row.get("env.cpu")) else ""
    cores = f" · {_int(row['env.cpu_count'])} cores" if _given(row.get("env.cpu_count")) else ""
    n = _int(row["env.torch_threads"]) if _given(row.get("env.torch_threads")) else None
    threads = f" · {n} torch thread{'s' if n != 1 else ''}" if n is not None else ""
    return f"CPU {cpu}{cores}{threads}".replace("  ", " ")


def setup_label(row: dict[str, Any]) -> str:
    """Everything but seq, batch and policy that defines a config: model, layers, precision, optimizer, ..."""
    parts = [str(row["model"])]
    if _given(row.get("layers")):
        parts.append(f"{_int(row['layers'])} layers")
    parts += [str(row["precision"]), str(row["optimizer"])]
    if _given(row.get("attn")):
        parts.append(f"attn {row['attn']}")
    if _given(row.get("memory_cap_bytes")):
        parts.append(f"memory cap {fmt_bytes(row['memory_cap_bytes'])}")
    if _given(row.get("seed")) and row["seed"] != 0:
        parts.append(f"seed {_int(row['seed'])}")
    return " · ".join(parts)


def policy_rank(label: str) -> tuple[int, str]:
    """Sort key: none first (the baseline), full next, the rest by name."""
    return ({"none": 0, "full": 1}.get(label, 2), label)


def results_frame(df: pd.DataFrame) -> pd.DataFrame:
    """`load()`'s DataFrame made ready to report: device and setup labels, the peak this device can measure
    (`peak_bytes`), model state, and `x none` ratios. A config recorded twice keeps its latest record — results
    are never averaged; `attrs["superseded"]` counts the records that were replaced."""
    if df.empty:
        raise GcbenchError("no records to report")
    frame = df.reindex(columns=list(dict.fromkeys([*df.columns, *EXPECTED]))).reset_index(drop=True)
    records = frame.to_dict("records")
    cuda = frame["device"].astype(str).str.startswith("cuda")
    frame["device_kind"] = cuda.map({True: "cuda", False: "cpu"})
    frame["device_label"] = [device_label(r) for r in records]
    frame["setup"] = [setup_label(r) for r in records]
    frame["peak_bytes"] = frame["peak_allocated_bytes"].where(cuda, frame["peak_tracked_bytes"]).astype(float)
    frame["peak_label"] = frame["device_kind"].map(PEAK_LABELS)
    frame["state_bytes"] = frame["param_bytes"] + frame["grad_bytes"] + frame["optimizer_bytes"]
    frame["tokens"] = frame["seq_len"] * frame["batch_size"]
    frame["device_memory_bytes"] = frame["env.gpu_memory_bytes"].where(cuda).astype(float)
    superseded = frame.duplicated([*GROUP_KEYS, "policy_label", "schema_version"], keep="last")
    frame = frame[~superseded]

    ok_none = frame[(frame["policy"] == "none") & (frame["status"] == "ok")]
    baseline = ok_none.set_index(GROUP_KEYS)[["peak_bytes", "step_ms_median"]].add_suffix("_none")
    frame = frame.join(baseline, on=GROUP_KEYS)
    frame["has_baseline"] = frame["peak_bytes_none"].notna()
    frame["peak_x_none"] = frame["peak_bytes"] / frame["peak_bytes_none"]
    frame["step_x_none"] = frame["step_ms_median"] / frame["step_ms_median_none"]
    frame["prediction_error"] = frame["predicted_peak_bytes"] / frame["peak_bytes"] - 1

    frame = frame.assign(_rank=frame["policy_label"].map(policy_rank))
    frame = frame.sort_values(["device_label", "setup", "seq_len", "batch_size", "_rank"]).drop(columns="_rank")
    frame = frame.reset_index(drop=True)
    frame.attrs["superseded"] = int(superseded.sum())
    return frame


def pareto_front(points: Iterable[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (smaller is better on both; e.g. peak
    bytes and step ms), ordered by the first coordinate. Of identical points only the first is kept."""
    pts = list(points)
    order = sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1], i))
    front, best_y = [], float("inf")
    for i in order:
        if pts[i][1] < best_y:  # sorted by x: only a strictly smaller y escapes domination
            front.append(i)
            best_y = pts[i][1]
    return front


@dataclass
class Grid:
    """A table of display strings: one shape for the terminal (rich), report.md and report.html."""

    headers: list[str]
    rows: list[list[str]]
    title: str = ""
    caption: str = ""
    numeric: set[int] = field(default_factory=set)  # right-aligned columns
    section_ends: set[int] = field(default_factory=set)  # rows after which a group ends (a rule in the terminal)
    optional: list[int] = field(default_factory=list)  # columns a narrow terminal leaves out, least useful first


def results_grid(part: pd.DataFrame) -> Grid:
    """The results table of one device and setup: a row per (seq, batch, policy), `x none` within each seq x batch."""
    scale, unit = byte_unit(part["peak_bytes"].max())
    predicted = part["predicted_peak_bytes"].notna().any()
    headers = ["seq", "batch", "policy", "status", f"peak {unit}", "peak x none", f"act. {unit}",
               "step ms", "IQR ms", "time x none", "tokens/s", "recompute FLOPs"]
    if predicted:
        headers += [f"predicted peak {unit}", "prediction error"]
    size = lambda v: f"{v / scale:,.2f}" if _given(v) else "-"  # noqa: E731

    def ratio(v: Any, r: dict) -> str:
        if r["status"] != "ok":
            return "-"
        return f"{v:.2f}x" if _given(v) else "n/a"

    rows, ends = [], set()
    records = part.to_dict("records")
    for i, r in enumerate(records):
        ok = r["status"] == "ok"
        row = [str(r["seq_len"]), str(r["batch_size"]), r["policy_label"], FAILED.get(r["status"], r["status"]),
               size(r["peak_bytes"]), ratio(r["peak_x_none"], r), size(r["activation_peak_bytes"]),
               f"{r['step_ms_median']:,.1f}" if ok else "-", f"{r['step_ms_iqr']:,.1f}" if ok else "-",
               ratio(r["step_x_none"], r),
               f"{r['tokens_per_s']:,.0f}" if ok else "-",
               f"+{r['recompute_flops_ratio']:.1%}" if ok and _given(r["recompute_flops_ratio"]) else "-"]
        if predicted:
            row += [size(r["predicted_peak_bytes"]),
                    f"{r['prediction_error']:+.1%}" if ok and _given(r["prediction_error"]) else "-"]
        rows.append(row)
        nxt = records[i + 1] if i + 1 < len(records) else None
        if nxt is None or (nxt["seq_len"], nxt["batch_size"]) != (r["seq_len"], r["batch_size"]):
            ends.add(i)
    caption = (f"peak = {part['peak_label'].iloc[0]}; act. = activations, the fwd+bwd peak above model state; "
               f"step ms = median step time; "
               f"x none = ratio to the `none` policy at the same seq and batch; IQR = spread of the measured step "
               f"times (a time ratio within it is noise); FLOPs include recompute.")
    if ((part["status"] == "ok") & ~part["has_baseline"]).any():
        caption += (" n/a: no successful `none` run at that seq and batch, so the ratio is unavailable "
                    "(absolute numbers shown).")
    if predicted:
        caption += " prediction error = predicted / measured peak - 1."
    optional = [headers.index(h) for h in ("IQR ms", f"predicted peak {unit}", "tokens/s", "prediction error",
                                           "recompute FLOPs") if h in headers]
    return Grid(headers, rows, title=part["setup"].iloc[0], caption=caption,
                numeric=set(range(4, len(headers))) | {0, 1}, section_ends=ends, optional=optional)


def largest_fit_grid(dev: pd.DataFrame) -> Grid:
    """Per setup and policy: the largest config (most tokens per step) that ran, and the smallest that did not fit."""
    scale, unit = byte_unit(dev["peak_bytes"].max())
    rows, shown_setup = [], None
    for (setup, policy), g in sorted(dev.groupby(["setup", "policy_label"]), key=lambda kv: (kv[0][0],
                                                                                             policy_rank(kv[0][1]))):
        ok = g[g["status"] == "ok"].sort_values(["tokens", "seq_len"])
        oom = g[g["status"] == "oom"].sort_values(["tokens", "seq_len"])
        best = ok.iloc[-1] if len(ok) else None
        first_oom = oom.iloc[0] if len(oom) else None
        rows.append([
            "" if setup == shown_setup else setup, policy,
            f"seq {best['seq_len']} x batch {best['batch_size']} ({best['tokens']:,} tokens)" if best is not None
            else "nothing fit",
            f"{best['peak_bytes'] / scale:,.2f}" if best is not None and _given(best["peak_bytes"]) else "-",
            f"seq {first_oom['seq_len']} x batch {first_oom['batch_size']}" if first_oom is not None else "-",
            f"{len(ok)} / {len(g)}",
        ])
        shown_setup = setup  # each setup named once, on its first row
    return Grid(["setup", "policy", "largest config that fit", f"its peak {unit}", "smallest OOM", "ran ok"], rows,
                caption="Among the configs tried (tokens per step = seq x batch).", numeric={3, 5})


PREDICTION_METHODS = ("simulate", "analytic")


def prediction_grid(part: pd.DataFrame) -> Grid | None:
    """For one device and setup: per measured config, each prediction method's error against the measured peak,
    then the median and worst absolute error per method; None when no record carries per-method predictions."""
    columns = [f"predicted_peak_bytes_{m}" for m in PREDICTION_METHODS]
    ok = part[(part["status"] == "ok") & part["peak_bytes"].notna() & part[columns].notna().any(axis=1)]
    if ok.empty:
        return None
    scale, unit = byte_unit(ok["peak_bytes"].max())
    errors = {m: ok[f"predicted_peak_bytes_{m}"] / ok["peak_bytes"] - 1 for m in PREDICTION_METHODS}
    pct = lambda v: f"{round(v, 3) or 0.0:+.1%}" if _given(v) else "-"  # noqa: E731 - never "-0.0%"
    rows = [[str(r["seq_len"]), str(r["batch_size"]), r["policy_label"], f"{r['peak_bytes'] / scale:,.2f}",
             *(pct(errors[m][i]) for m in PREDICTION_METHODS)] for i, r in ok.iterrows()]
    for label, stat in (("median |error|", "median"), ("worst |error|", "max")):
        rows.append(["", "", label, "", *(f"{getattr(errors[m].abs(), stat)():.1%}" if errors[m].notna().any()
                                          else "-" for m in PREDICTION_METHODS)])
    return Grid(["seq", "batch", "policy", f"measured {unit}", *(f"{m} error" for m in PREDICTION_METHODS)], rows,
                title=f"prediction error · {part['setup'].iloc[0]}",
                caption=f"error = predicted / measured peak - 1, measured = {part['peak_label'].iloc[0]}; median and "
                        "worst over the configs each method predicts; - = the method cannot predict this policy "
                        "(analytic knows the block-grouping ones).",
                numeric={0, 1, 3, 4, 5}, section_ends={len(rows) - 3})


def environment_grid(dev: pd.DataFrame) -> Grid:
    """The machine and software of one device's records; differing values are all listed, never hidden."""
    rows = []
    for label, col in ENV_ROWS:
        if col not in dev:
            continue
        values = [v for v in dict.fromkeys(dev[col].tolist()) if _given(v)]
        if not values:
            continue
        if col == "env.gpu_memory_bytes":
            values = [fmt_bytes(v) for v in values]
        elif col in ("env.cpu_count", "env.torch_threads"):
            values = [str(_int(v)) for v in values]
        rows.append([label, " / ".join(map(str, values)) + (" (differs between records)" if len(values) > 1 else "")])
    return Grid(["", "value"], rows)


def grid_grid(dev: pd.DataFrame) -> Grid:
    """The grid that was run on one device: setups, seq lengths, batch sizes, policies, statuses."""
    sources = sorted(set(dev["source"]))
    statuses = dev["status"].value_counts()
    rows = [
        ["model setups", "; ".join(sorted(set(dev["setup"])))],
        ["sequence lengths (tokens)", ", ".join(map(str, sorted(set(dev["seq_len"]))))],
        ["batch sizes", ", ".join(map(str, sorted(set(dev["batch_size"]))))],
        ["policies", ", ".join(sorted(set(dev["policy_label"]), key=policy_rank))],
        ["configs", f"{len(dev)}: " + ", ".join(f"{n} {FAILED.get(s, s)}" for s, n in statuses.items())],
        ["results files", ", ".join(sources)],
    ]
    return Grid(["", "value"], rows)


def rich_table(grid: Grid, width: int | None = None) -> Table:
    """The grid as a rich Table. Given a terminal `width`, the grid's optional columns are left out (least useful
    first) until the table fits without breaking numbers apart; report.md and report.html keep every column."""
    hidden: list[int] = []
    while True:
        table = _rich_table(grid, hidden)
        if width is None or len(hidden) == len(grid.optional):
            return table
        # The natural (unwrapped) width: measured on an unbounded console, since a bounded one clamps to its width.
        if Console(width=100_000).measure(table).maximum <= width:
            return table
        hidden.append(grid.optional[len(hidden)])


def _rich_table(grid: Grid, hidden: list[int]) -> Table:
    shown = [i for i in range(len(grid.headers)) if i not in hidden]
    table = Table(title=grid.title or None, caption=grid.caption or None, header_style="bold",
                  caption_justify="left")
    for i in shown:
        numeric = i in grid.numeric
        # Numbers never wrap; their headers break after the first word instead ("peak\nx none").
        header = grid.headers[i].replace(" ", "\n", 1) if numeric else grid.headers[i]
        # Short labels (policies, statuses) stay on one line; long ones (setups, notes) may wrap.
        widest = max((len(row[i]) for row in grid.rows), default=0)
        table.add_column(header, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold",
                         min_width=None if numeric or widest > 16 else max(widest, len(header)))
    for i, row in enumerate(grid.rows):
        cells = [Text(row[j], style="bold red") if row[j] in FAILED.values() else Text(row[j]) for j in shown]
        table.add_row(*cells, end_section=i in grid.section_ends and i != len(grid.rows) - 1)
    return table


def terminal_tables(frame: pd.DataFrame, width: int | None = None) -> list[Table | str]:
    """What `gcbench report` prints: per device a heading line, a results table per setup, the largest fits.
    `width`: the terminal's, so that narrow terminals get the essential columns only."""
    out: list[Table | str] = []
    for dev_label, dev in frame.groupby("device_label", sort=False):
        out.append(f"[bold]{dev_label}[/] — {len(dev)} configs; peak memory = {dev['peak_label'].iloc[0]}")
        for _, part in dev.groupby("setup", sort=False):
            out.append(rich_table(results_grid(part), width))
        fits = largest_fit_grid(dev)
        fits.title = "largest config that fit, per policy"
        out.append(rich_table(fits, width))
        for _, part in dev.groupby("setup", sort=False):
            predictions = prediction_grid(part)
            if predictions is not None:
                out.append(rich_table(predictions, width))
    if frame.attrs.get("superseded"):
        out.append(f"[dim]{frame.attrs['superseded']} repeated record(s) of the same config superseded by a later "
                   f"one (latest kept, never averaged)[/]")
    return out


# ---- the shareable document: a list of blocks rendered to Markdown and to self-contained HTML ------------------

@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str  # may use `code` and **bold**


@dataclass
class Image:
    png: str  # relative to the report directory
    svg: str
    title: str
    caption: str


Block = Heading | Para | Grid | Image


def report_blocks(frame: pd.DataFrame, figures: dict[str, list], sources: list[str]) -> list[Block]:
    """The report's content: what was run where, the tables, the figures, the largest config that fit."""
    from gcbench import __version__

    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu_only = (frame["device_kind"] == "cpu").all()
    blocks: list[Block] = [
        Heading("gcbench report" + (" — CPU measurements" if cpu_only else ""), 1),
        Para(f"{len(frame)} configs from {', '.join(f'`{s}`' for s in sources)}; written {now} by gcbench "
             f"{__version__}. Each device has its own section: numbers from different devices are never compared "
             "or averaged, and `x none` ratios compare a policy with the `none` policy at the same device, model "
             "setup, sequence length and batch size. Memory in binary units (GiB = 2^30 bytes); step time is the "
             "median of the measured steps."),
    ]
    if frame.attrs.get("superseded"):
        blocks.append(Para(f"{frame.attrs['superseded']} repeated record(s) of the same config were superseded "
                           "by a later record (the latest is kept; records are never averaged)."))
    for dev_label, dev in frame.groupby("device_label", sort=False):
        cpu = dev["device_kind"].iloc[0] == "cpu"
        blocks.append(Heading(f"{dev_label}" + (" — CPU measurements" if cpu else "")))
        if cpu:
            blocks.append(Para("**CPU run.** Step times are CPU times, not GPU times. Peak memory is the "
                               "*tracked live-tensor peak (CPU)*: the most bytes of tensors alive at once, "
                               "counted by gcbench; CPU has no allocator peak like CUDA's `max_memory_allocated`."))
        else:
            blocks.append(Para("Peak memory is `torch.cuda.max_memory_allocated` over the whole training step."))
        blocks += [Heading("Environment", 3), environment_grid(dev), Heading("Grid", 3), grid_grid(dev),
                   Heading("Results", 3)]
        for _, part in dev.groupby("setup", sort=False):
            blocks.append(results_grid(part))
        blocks += [Heading("Largest config that fit, per policy", 3), largest_fit_grid(dev)]
        predictions = [g for _, part in dev.groupby("setup", sort=False) if (g := prediction_grid(part))]
        if predictions:
            blocks += [Heading("Prediction error per method", 3), *predictions]
        blocks.append(Heading("Figures", 3))
        for fig in figures.get(dev_label, []):
            if fig.png is None:
                blocks.append(Para(f"*{fig.title}*: not drawn — {fig.caption}"))
            else:
                blocks.append(Image(fig.png, fig.svg, fig.title, fig.caption))
    return blocks


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(blocks: list[Block]) -> str:
    out = []
    for b in blocks:
        match b:
            case Heading():
                out.append("#" * b.level + " " + b.text)
            case Para():
                out.append(b.text)
            case Grid():
                lines = [f"**{b.title}**\n"] if b.title else []
                lines.append("| " + " | ".join(map(_md_cell, b.headers)) + " |")
                lines.append("|" + "|".join("---:" if i in b.numeric else "---" for i in range(len(b.headers))) + "|")
                lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
                if b.caption:
                    lines.append(f"\n*{b.caption}*")
                out.append("\n".join(lines))
            case Image():
                out.append(f"![{b.title}]({b.png})\n\n*{b.caption}* ([SVG]({b.svg}))")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", text)


HTML_STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1280px; margin: 2em auto;
       padding: 0 1.5em; color: #1d1d1f; }
h1 { border-bottom: 2px solid #333; padding-bottom: .2em; }
h2 { margin-top: 2.2em; border-bottom: 1px solid #ccc; padding-bottom: .15em; }
h3 { margin-top: 1.6em; }
code { background: #f2f2f2; padding: 0 .25em; border-radius: 3px; }
table { border-collapse: collapse; margin: .6em 0 .3em; font-size: 13px; }
th, td { padding: .25em .7em; border-bottom: 1px solid #e2e2e2; }
td { white-space: nowrap; }
div.wide { overflow-x: auto; }
th { background: #f6f6f6; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.end td { border-bottom: 2px solid #aaa; }
td.bad { color: #b00020; font-weight: 600; }
caption { caption-side: top; text-align: left; font-weight: 600; padding: .3em 0; }
p.caption { font-size: 13px; color: #555; margin-top: .2em; }
figure { margin: 1.4em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 13px; color: #444; }
"""


def render_html(blocks: list[Block], root: Path) -> str:
    """One self-contained HTML file: the PNG figures are embedded (base64), the SVGs stay beside it."""
    title = next((b.text for b in blocks if isinstance(b, Heading)), "gcbench report")
    out = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
           f"<style>{HTML_STYLE}</style></head><body>"]
    for b in blocks:
        match b:
            case Heading():
                out.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
            case Para():
                out.append(f"<p>{_inline_html(b.text)}</p>")
            case Grid():
                bad, end = ' class="bad"', ' class="end"'
                cls = lambda i: ' class="num"' if i in b.numeric else ""  # noqa: E731
                rows = []
                for r, row in enumerate(b.rows):
                    cells = "".join(f"<td{bad if c in FAILED.values() else cls(i)}>{html.escape(c)}</td>"
                                    for i, c in enumerate(row))
                    rows.append(f"<tr{end if r in b.section_ends else ''}>{cells}</tr>")
                caption = f"<caption>{html.escape(b.title)}</caption>" if b.title else ""
                head = "".join(f"<th{cls(i)}>{html.escape(h)}</th>" for i, h in enumerate(b.headers))
                out.append(f"<div class=\"wide\"><table>{caption}<thead><tr>{head}</tr></thead>"
                           f"<tbody>{''.join(rows)}</tbody></table></div>")
                if b.caption:
                    out.append(f"<p class=\"caption\">{_inline_html(b.caption)}</p>")
            case Image():
                data = base64.b64encode((root / b.png).read_bytes()).decode()
                out.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{html.escape(b.title)}\">"
                           f"<figcaption><b>{html.escape(b.title)}.</b> {_inline_html(b.caption)}</figcaption>"
                           "</figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(frame: pd.DataFrame, out: Path) -> list[Path]:
    """Write report.md, report.html and figures/ into `out`. Everything is made in a scratch directory first and
    moved in at the end: a failure leaves no half-written report (an earlier report stays as it was)."""
    from gcbench.figures import write_figures

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and not out.is_dir():
            raise GcbenchError(f"--out {str(out)!r} is a file, not a directory")
        scratch = Path(tempfile.mkdtemp(prefix=".gcbench-report-", dir=out.parent))
    except OSError as e:
        raise GcbenchError(f"cannot write the report to {str(out)!r}: {e.strerror or e}") from None
    try:
        figures = write_figures(frame, scratch, "figures")
        blocks = report_blocks(frame, figures, sorted(set(frame["source"])))
        (scratch / "report.md").write_text(render_markdown(blocks))
        (scratch / "report.html").write_text(render_html(blocks, scratch))
        out.mkdir(exist_ok=True)
        shutil.rmtree(out / "figures", ignore_errors=True)  # a figure of an earlier report must not linger
        for name in ("figures", "report.md", "report.html"):
            os.replace(scratch / name, out / name)
    except OSError as e:
        raise GcbenchError(f"cannot write the report to {str(out)!r}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [out / "report.md", out / "report.html", *sorted((out / "figures").iterdir())]
