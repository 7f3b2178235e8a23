"""Tables for the terminal (rich): one run (`gcbench run`), predictions (`gcbench estimate`), and the report's
grids (`gcbench report`), which leave out their least useful columns on a narrow terminal."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gcbench.report.cells import PHASE_SHORT, Grid, fit_grids, largest_fit_grid, prediction_grid, results_grid
from gcbench.results.frame import FAILED
from gcbench.fields import DeviceKind, run_field
from gcbench.values import Switch
from gcbench.results.schema import LEVER_FIELDS, PHASES, half_width, lever_text, mix_text, peak_bytes, policy_label
from gcbench.units import byte_unit, fmt_bytes, human_count


def run_table(record: dict[str, Any]) -> Table:
    """The one-run table `gcbench run` prints: memory, breakdown, time, throughput, recompute cost."""
    cuda = DeviceKind.of(record["device"]) is DeviceKind.CUDA
    env = record.get("env") or {}
    threads = record.get("threads") or env.get("torch_threads")
    where = env.get("gpu_name") or f"CPU ({threads} thread{'s' if threads != 1 else ''})"
    blocks = record.get("n_layers") or record.get("layers")
    # the family, where the model's name does not say it (a config.json, a Hub id)
    shape = ", ".join(([record["family"]] if record.get("family") and record["family"] not in record["model"]
                       else []) + ([f"{blocks} blocks"] if blocks else []))
    # the optimizer is named in the model state row; the precision and the other levers here
    levers = lever_text(record, leave_out=("optimizer",))
    world = record.get("world_size") or 1
    title = (f"{record['model']}{f' ({shape})' if shape else ''} · seq {record['seq_len']} · batch "
             f"{record['batch_size']} · {policy_label(record)} · {levers} · {where}")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("what it is", style="dim")
    if record["status"] != "ok":
        style = "bold yellow" if record["status"] == "oom" else "bold red"
        table.add_row("status", f"[{style}]{record['status']}[/]", escape(record.get("error") or ""))
        if record.get("predicted_peak_bytes"):
            table.add_row("predicted peak", fmt_bytes(record["predicted_peak_bytes"]),
                          f"{record.get('prediction_method')}, before the run")
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
    if record.get("peak_phase"):
        table.add_row("peak reached in", f"[bold]{record['peak_phase']}[/]", _phase_text(record))
    table.add_row("activation peak", fmt_bytes(record["activation_peak_bytes"]), "fwd+bwd peak above model state")
    table.add_row("saved activations", fmt_bytes(record["saved_activation_bytes"]), "kept for backward after forward")
    if record.get("plan_mix"):
        table.add_row("plan mix", mix_text(record["plan_mix"]), "blocks of each kind the plan chose for this shape")
    if record.get("offloaded_bytes") is not None:
        table.add_row("offloaded to host", fmt_bytes(record["offloaded_bytes"]), "host copies per forward (offload)")
    if record.get("compile_ms") is not None:
        table.add_row("compile time", f"{record['compile_ms'] / 1e3:.1f} s", "torch.compile, not in step time")
    if record.get("shard") not in (None, "none"):
        peaks = record.get("rank_peak_allocated_bytes") or record.get("rank_peak_tracked_bytes") or []
        table.add_row("peak per rank", " · ".join(fmt_bytes(p) for p in peaks),
                      f"each of the {world} ranks (the record's peak and model state: the largest rank's)")
    state = record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"]
    # Sharded: a rank holds 1/world of the bytes per parameter.
    per_param = f"{state * world / record['n_params']:.1f} B/param{f' over {world} ranks' if world > 1 else ''}: " \
        if record.get("n_params") else ""
    table.add_row("model state" + (" per rank" if world > 1 else ""), fmt_bytes(state),
                  f"{per_param}params {fmt_bytes(record['param_bytes'])} + grads {fmt_bytes(record['grad_bytes'])} "
                  f"+ {record['optimizer']} {fmt_bytes(record['optimizer_bytes'])}")
    shaky = "~" if record.get("timing_stable") is False else ""
    table.add_row("step time (median)", f"{shaky}{record['step_ms_median']:.1f} ms", _step_time_text(record))
    if "timing_stable" in record:
        stable = record["timing_stable"]
        table.add_row("timing", "[green]stable[/]" if stable else "[bold yellow]not trusted[/]",
                      escape("; ".join(record["timing_notes"])) if not stable else _host_text(record))
    accum = record.get("grad_accum") or 1
    table.add_row("throughput", f"{record['tokens_per_s']:,.0f} tokens/s",
                  f"batch x seq{f' x {accum} micro-batches' if accum > 1 else ''}"
                  f"{f' x {world} ranks' if world > 1 else ''} / median step")
    ratio = record.get("recompute_flops_ratio")
    table.add_row("recompute FLOPs", "-" if ratio is None else f"+{ratio:.1%}",
                  f"{human_count(record['flops'], 'FLOP')} per step vs {human_count(record['model_flops'], 'FLOP')}")
    if record.get("mfu") is not None:
        table.add_row("MFU", f"{record['mfu']:.1%}", "model FLOPs / step time / dense bf16 peak")
    return table


PHASE_ADVICE = {
    "forward": "activations hold the peak: checkpointing can lower it",
    "backward": "activations hold the peak: checkpointing can lower it",
    "optimizer": "the optimizer step holds it: checkpointing cannot lower it (docs/levers.md)",
}


def _phase_text(record: dict[str, Any]) -> str:
    """Each phase's peak, and what can lower the step's."""
    peaks = " · ".join(f"{PHASE_SHORT[phase]} {fmt_bytes(record[f'{phase}_peak_bytes'])}"
                       for phase in PHASES if record.get(f"{phase}_peak_bytes"))
    stepped = "; the optimizer steps inside backward" if record.get("optim_in_backward") else ""
    return f"{peaks}{stepped}; {PHASE_ADVICE[record['peak_phase']]}"


STOPS = {"max-steps": "--max-steps reached", "max-time": "--max-time reached"}  # "ci" and "fixed" need no words


def _step_time_text(record: dict[str, Any]) -> str:
    """IQR, steps, the median's interval and why measuring stopped."""
    n, iqr = len(record["step_ms"]), record["step_ms_iqr"]
    text = f"IQR {iqr:.1f} ms"
    if record.get("step_ms_rel_iqr") is not None:
        text += f" ({record['step_ms_rel_iqr']:.1%})"
    text += f" over {n} step{'s' if n != 1 else ''}"
    half = half_width(record["step_ms_median"], record.get("step_ms_ci"))
    if half is not None:
        text += f"; median +-{half:.1%} (95%)"
    if record.get("steps_stop") in STOPS:
        text += f"; {STOPS[record['steps_stop']]}"
    return text


def _host_text(record: dict[str, Any]) -> str:
    cores = len(record["cpu_affinity"]) if record.get("cpu_affinity") else record.get("cpus_logical")
    others = record.get("other_cpu_cores")
    load = record.get("load_1m_before")
    text = "spread within the limit"
    if others is not None and cores:
        used = min(record.get("threads") or 1, cores) if DeviceKind.of(record["device"]) is DeviceKind.CPU else 1
        text += f"; others used {others:.1f} core{'s' if others >= 1.05 else ''}, the run left {cores - used} of {cores} free"
    if load is not None:
        text += f"; load {load:.1f}"
    return text


LEVERS = {name: run_field(name).heading for name in LEVER_FIELDS}  # lever -> its column's heading


def _lever_cell(field: str, value: Any) -> str:
    if isinstance(run_field(field).kind, Switch):
        return "yes" if value else "no"
    return str(value)


def estimate_table(rows: list[dict[str, Any]], memory_bytes: int | None = None) -> Table:
    """The table `gcbench estimate` prints: one row per config and method (rows are Estimate.as_record()s: `policy`
    the name with `policy_options` beside it, or, from older code, the whole label in `policy`; a cell no method
    could predict has `peak_bytes` None and why in `not_available`). Byte columns share one unit, chosen for the
    largest peak; what all rows share goes into the title (the model, precision, optimizer...), what varies gets a
    column; the caption says why a cell is n/a or predicted by another method than asked (`stands_in`)."""
    first, predicted_rows = rows[0], [r for r in rows if r["peak_bytes"] is not None]
    scale, unit = byte_unit(max((r["peak_bytes"] for r in predicted_rows), default=0))
    models = {r["model"] + (f" ({r['layers']} blocks)" if r.get("layers") else "") for r in rows}
    predicted = "torch.cuda.max_memory_allocated" if first["target"] == "cuda" else "CPU live-tensor peak"
    kernels = ", ".join(sorted({r["attention_kernel"] for r in predicted_rows}))
    varying = [f for f in LEVERS if len({str(r.get(f)) for r in rows}) > 1]
    shared = lever_text(first, leave_out=tuple(varying))
    title = (f"{', '.join(sorted(models)) + ' · ' if len(models) == 1 else ''}predicted peak of one training step "
             f"({predicted}){' · ' + shared if shared else ''} · attention: {kernels}")
    sharded = any(r.get("shard") not in (None, "none") for r in rows)
    notes = [f"{unit}; activ. = everything else at the peak; in = the phase that reaches the peak (opt: the "
             f"optimizer step, which checkpointing cannot lower); B/p = model state bytes per parameter"
             + ("; sharded rows: per rank, B/p over all ranks (docs/scale.md)" if sharded else "")
             + (f"; fits = peak <= {fmt_bytes(memory_bytes)}" if memory_bytes else "")]
    stand_ins = sorted({r["stands_in"] for r in predicted_rows if r.get("stands_in")})
    notes += [f"† simulated instead: {escape(reason)}" for reason in stand_ins]
    notes += [f"n/a: {escape(reason)}" for reason in dict.fromkeys(r["not_available"] for r in rows
                                                                   if r["peak_bytes"] is None)]
    # no padding: the box puts one space between columns, so that a grid with a lever or two fits 80 columns
    table = Table(title=title, caption="\n".join(notes), header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption_justify="left", padding=0)
    columns = (["model"] if len(models) > 1 else []) + ["seq", "batch", "policy"] + [LEVERS[f] for f in varying] \
        + ["method", "params", "grads", "optim.", "activ.", "peak", "in", "B/p"]
    left = {"model", "policy", "method", "fits", "in", *(LEVERS[f] for f in varying)}
    for col in columns + (["fits"] if memory_bytes else []) + ["time"]:
        table.add_column(col, justify="left" if col in left else "right")
    for r in rows:
        cells = [str(r["model"])] if len(models) > 1 else []
        cells += [str(r["seq_len"]), str(r["batch_size"]), policy_label(r)]
        cells += [_lever_cell(f, r.get(f)) for f in varying]
        cells.append(r["method"] + ("†" if r.get("stands_in") else ""))
        if r["peak_bytes"] is None:
            table.add_row(*cells, *["[dim]n/a[/]"] * (7 + bool(memory_bytes)), "-")
            continue
        cells += [f"{r[k] / scale:.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")]
        cells.append(f"[bold]{r['peak_bytes'] / scale:.2f}[/]")
        cells.append(PHASE_SHORT.get(r["peak_phase"], "-"))
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        cells.append(f"{state * (r.get('nproc') or 1) / r['n_params']:.1f}" if r.get("n_params") else "-")
        if memory_bytes:
            cells.append("[green]yes[/]" if r["peak_bytes"] <= memory_bytes else "[red]no[/]")
        cells.append(f"{r['seconds']:.2f}s")
        table.add_row(*cells)
    return table


def rich_table(grid: Grid, width: int | None = None) -> Table:
    """The grid as a rich Table. Given a terminal `width`, the grid's optional columns are left out (least useful
    first) until the table fits without breaking numbers apart; report.md and report.html keep every column."""
    hidden: list[int] = []
    # The natural (unwrapped) width: measured on an unbounded console, since a bounded one clamps to its width.
    fits = lambda t: width is None or Console(width=100_000).measure(t).maximum <= width  # noqa: E731
    while True:
        table = _rich_table(grid, hidden)
        if fits(table):
            return table
        if len(hidden) == len(grid.optional):
            # The essential columns alone are still too wide: drop the vertical rules (as the sweep summary does).
            return _rich_table(grid, hidden, compact=True)
        hidden.append(grid.optional[len(hidden)])


def _rich_table(grid: Grid, hidden: list[int], compact: bool = False) -> Table:
    shown = [i for i in range(len(grid.headers)) if i not in hidden]
    light = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if compact else {}
    table = Table(title=grid.title or None, caption=grid.caption or None, header_style="bold",
                  caption_justify="left", **light)
    for i in shown:
        numeric = i in grid.numeric
        # Numbers never wrap; their headers break after the first word instead ("peak\nx none").
        header = grid.headers[i].replace(" ", "\n", 1) if numeric else grid.headers[i]
        # Short labels (policies, statuses) stay on one line; long ones (setups, notes) and headers may wrap.
        widest = max((len(row[i]) for row in grid.rows), default=0)
        longest_word = max(map(len, header.split()), default=0)
        table.add_column(header, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold",
                         min_width=None if numeric or widest > 16 else max(widest, longest_word))
    for i, row in enumerate(grid.rows):
        cells = [Text(row[j], style="bold red") if row[j].rstrip("*") in FAILED.values() else Text(row[j])
                 for j in shown]
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
        if (largest := largest_fit_grid(dev)) is not None:
            largest.title = "largest config that fit, per policy"
            out.append(rich_table(largest, width))
        out += [rich_table(grid, width) for grid in fit_grids(dev)]
        for _, part in dev.groupby("setup", sort=False):
            predictions = prediction_grid(part)
            if predictions is not None:
                out.append(rich_table(predictions, width))
    if frame.attrs.get("superseded"):
        out.append(f"[dim]{frame.attrs['superseded']} repeated record(s) of the same config superseded by a later "
                   f"one (latest kept, never averaged)[/]")
    return out
