"""`gcbench estimate`'s table: one row per config and method. Narrow by design (an 80-column terminal or pipe
takes the README's examples whole); where varying levers and several models would still make it wider than the
terminal, its least useful columns are left out, and the caption says which."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich import box
from rich.table import Table

from gcbench.fields import run_field
from gcbench.results.band_words import PEAK_PREFIX, TIME_PREFIX, band_cell, peak_band_note, time_band_note
from gcbench.results.schema import LEVER_FIELDS, PHASE_SHORT, blocks_text, lever_text, policy_label
from gcbench.text import fits, markup
from gcbench.units import byte_unit, fmt_bytes
from gcbench.values import Switch

LEVERS = {name: run_field(name).heading for name in LEVER_FIELDS}  # lever -> its column's heading
# Left out first when the table is too wide: derivable from the others (B/p, grads ~ params), then the least asked
# (the method shortened to a letter instead where the rows have several).
# The step time's band goes first: a note then gives its range over the rows.
SPARE = ("ms err", "B/p", "tok/s", "grads", "err", "in", "method")  # err leaves its range in a note; "in" none


@dataclass
class _Column:
    header: str
    left: bool  # text (left) or a number (right)
    cells: list[str]


def estimate_table(rows: list[dict[str, Any]], memory_bytes: int | None = None, width: int | None = None,
                   card: str | None = None) -> Table:
    """The table `gcbench estimate` prints: one row per config and method (rows are Estimate.as_record()s: `policy`
    the name with `policy_options` beside it, or, from older code, the whole label in `policy`; a cell no method
    could predict has `peak_bytes` None and why in `not_available`). Byte columns share one unit, chosen for the
    largest peak; what all rows share goes into the title (the model, precision, optimizer...), what varies gets a
    column, the attention kernels and (mixtures of experts) the experts' matmul into the title; the caption says
    why a cell is n/a or predicted by another method than asked (`stands_in`), and how long predictions took.
    `width`: the most columns it may take (None: no limit)."""
    first, predicted_rows = rows[0], [r for r in rows if r["peak_bytes"] is not None]
    scale, unit = byte_unit(max((r["peak_bytes"] for r in predicted_rows), default=0))
    models = {markup(r["model"]) + (f" ({markup(blocks_text(r))})" if r.get("layers") else "") for r in rows}
    predicted = "torch.cuda.max_memory_allocated" if first["target"] == "cuda" else "CPU live-tensor peak"
    kernels = ", ".join(sorted({r["attention_kernel"] for r in predicted_rows}))
    experts = ", ".join(sorted({r["experts_kernel"] for r in predicted_rows if r.get("experts_kernel")}))
    varying = [f for f in LEVERS if len({str(r.get(f)) for r in rows}) > 1]
    shared = lever_text(first, leave_out=tuple(varying))
    # an encoder-decoder's target length: a column where it varies, the title where all rows share one that is set
    targets = {r.get("target_len") for r in rows}
    if len(targets) == 1 and first.get("target_len"):
        shared = " · ".join(w for w in (run_field("target_len").text(first), shared) if w)
    if len({r.get("images") for r in rows}) == 1 and first.get("images"):  # a vision-language model's
        shared = " · ".join(w for w in (run_field("images").text(first), shared) if w)
    title = (f"{', '.join(sorted(models)) + ' · ' if len(models) == 1 else ''}predicted peak of one training step "
             f"({predicted}){' · ' + markup(shared) if shared else ''} · attention: {kernels}"
             f"{' · experts: ' + experts if experts else ''}")
    sharded = any(r.get("shard") not in (None, "none") for r in rows)
    columns = _columns(rows, varying, len(models) > 1, scale, memory_bytes, len(targets) > 1)
    left_out = []
    several_methods = len({r["method"] for r in rows}) > 1
    # several methods: a config's rows differ in the method alone: shortened last, never left out (issue 48)
    for header in sorted(SPARE, key=lambda h: h == "method" and several_methods):
        if fits(_table(title, "", columns), width):
            break
        if header == "method" and several_methods:
            columns = [_Column("m", True, [r["method"][0] + ("†" if r.get("stands_in") else "") for r in rows])
                       if c.header == "method" else c for c in columns]
        elif any(c.header == header for c in columns):
            columns = [c for c in columns if c.header != header]
            left_out.append(header)
    shown = {c.header for c in columns}
    words = {"m": "m = the method: a(nalytic), s(imulate)", "activ.": "activ. = the peak less params, grads and optim",
             "in": "in = the phase that reaches the peak (opt: the optimizer step, which checkpointing cannot lower)",
             "paged": "paged = optimizer state in CUDA managed memory (bitsandbytes), not in the peak",
             "B/p": "B/p = model state bytes per parameter" + (" (over all ranks)" if sharded else ""),
             "err": "err = the peak's lowest..highest error, by this method, against GPU measurements of "
                    "configs of the same family, precision, adapter, sharding, attention, loss, head and optimizer "
                    "(results/gpu/, benchmarks/published/; -: none measured)"}
    notes = ["; ".join([f"sizes in {unit}", *(text for header, text in words.items() if header in shown)]
                       + (["sharded rows: per rank (docs/scale.md)"] if sharded else [])
                       + ([_fits_note(rows, memory_bytes, card)] if memory_bytes else []))]
    if "err" not in shown and (banded := [r for r in predicted_rows if r.get(f"{PEAK_PREFIX}_configs")]):
        notes.append(peak_band_note(banded, len(predicted_rows)))  # the err column left out: its range
    notes += _time_notes(rows, shown)
    stand_ins = sorted({r["stands_in"] for r in predicted_rows if r.get("stands_in")})
    notes += [f"† simulated instead: {markup(reason)}" for reason in stand_ins]
    notes += [f"n/a: {markup(reason)}" for reason in dict.fromkeys(r["not_available"] for r in rows
                                                                   if r["peak_bytes"] is None)]
    notes.append(_seconds_note(predicted_rows))
    if left_out:
        notes.append(f"left out at this width: {', '.join(left_out)} (--format json has every value)")
    return _table(title, "\n".join(n for n in notes if n), columns)


def _columns(rows: list[dict[str, Any]], varying: list[str], several_models: bool, scale: int,
             memory_bytes: int | None, several_targets: bool = False) -> list[_Column]:
    """Every column the rows call for, its cells rich markup."""
    columns = ([_Column("model", True, [markup(r["model"]) for r in rows])] if several_models else []) + [
        _Column("seq", False, [str(r["seq_len"]) for r in rows]),
        *([_Column("target", False, [str(r.get("target_len") or "dflt") for r in rows])] if several_targets else []),
        _Column("batch", False, [str(r["batch_size"]) for r in rows]),
        _Column("policy", True, [markup(policy_label(r)) for r in rows]),
        *(_Column(LEVERS[f], True, [markup(_lever_cell(f, r.get(f))) for r in rows]) for f in varying),
        _Column("method", True, [r["method"] + ("†" if r.get("stands_in") else "") for r in rows])]
    parts = {"params": "param_bytes", "grads": "grad_bytes", "optim.": "optimizer_bytes", "activ.": "activation_bytes"}
    na = "[dim]n/a[/]"
    columns += [_Column(header, False, [f"{r[key] / scale:.2f}" if r["peak_bytes"] is not None else na for r in rows])
                for header, key in parts.items()]
    if any(r.get("optimizer_paged_bytes") for r in rows):  # a paged optimizer's state outside the allocator
        columns.append(_Column("paged", False, [f"{(r.get('optimizer_paged_bytes') or 0) / scale:.2f}"
                                                if r["peak_bytes"] is not None else na for r in rows]))
    columns.append(_Column("peak", False, [f"[bold]{r['peak_bytes'] / scale:.2f}[/]" if r["peak_bytes"] is not None
                                           else na for r in rows]))
    columns.append(_Column("in", True, [PHASE_SHORT.get(r["peak_phase"], "-") if r["peak_bytes"] is not None else na
                                        for r in rows]))
    columns.append(_Column("B/p", False, [_per_param(r) if r["peak_bytes"] is not None else na for r in rows]))
    if any(r.get("runs_out") is not None for r in rows):  # the caching allocator replayed on the card
        columns.append(_Column("reserved", False, [
            "past" if r.get("runs_out") else f"{r['reserved_bytes'] / scale:.2f}" if r.get("reserved_bytes")
            else "-" if r["peak_bytes"] is not None else na for r in rows]))
    if any("measured_configs" in r for r in rows):  # CUDA rows: the method's errors on configs like it
        columns.append(_Column("err", False, [band_cell(r) if r["peak_bytes"] is not None else na for r in rows]))
    if any(r.get("predicted_step_ms") is not None for r in rows):  # the step's time on the named card
        # a row whose method could not predict the step shows no time either (n/a); *: the GPU waits on Python
        columns.append(_Column("ms", False, [na if r["peak_bytes"] is None else f"{r['predicted_step_ms']:.0f}"
                                             + ("*" if r.get("predicted_host_bound") else "") if _timed(r) else "-"
                                             for r in rows]))
        if any(r.get(f"{TIME_PREFIX}_configs") for r in rows):  # a note says so where none has a band
            columns.append(_Column("ms err", False, [band_cell(r, TIME_PREFIX) if _timed(r) else
                                                     na if r["peak_bytes"] is None else "-" for r in rows]))
        columns.append(_Column("tok/s", False, [na if r["peak_bytes"] is None else _rate(r["predicted_tokens_per_s"])
                                                if r.get("predicted_tokens_per_s") is not None else "-"
                                                for r in rows]))
    if memory_bytes:
        verdicts = [_fits(r, memory_bytes) for r in rows]
        columns.append(_Column("fits", True, [na if fit is None else "[green]yes[/]" if fit else "[red]no[/]"
                                              for fit in verdicts]))
    return columns


def _fits(row: dict[str, Any], memory_bytes: int) -> bool | None:
    """The row's own verdict (Estimate.fits: the replayed allocator's where it ran), else its peak against it."""
    if "fits" in row:
        return row["fits"]
    return None if row["peak_bytes"] is None else row["peak_bytes"] <= memory_bytes


def _fits_note(rows: list[dict[str, Any]], memory_bytes: int, card: str | None) -> str:
    """What the fits column compares: the peak with the memory, or, where the caching allocator was replayed on
    the card, whether cudaMalloc would run out (the reserved column: max_memory_reserved; past: it runs out).
    `card`: the --gpu the memory is what it leaves usable of; None: --gpu-memory, as given."""
    if not any(r.get("runs_out") is not None for r in rows):
        whose = f"{card} less its CUDA context and cuBLAS workspaces" if card else "--gpu-memory as given"
        return f"fits = peak <= {fmt_bytes(memory_bytes)}, {whose}"
    whose = f"{card} less its context and those workspaces" if card else "--gpu-memory as given"
    return (f"reserved = max_memory_reserved, PyTorch's caching allocator replayed on the step, its cuBLAS "
            f"workspaces included (simulate rows{'' if card else ', as on Hopper'}); fits = the step's own tensors "
            f"stay within {fmt_bytes(memory_bytes)}, {whose} (past: the allocator runs out there), else peak <= it")


def _table(title: str, caption: str, columns: list[_Column]) -> Table:
    # No padding and no outer edge: one space between columns, nothing around them.
    table = Table(title=title, caption=caption or None, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, caption_justify="left", padding=0)
    for column in columns:
        table.add_column(column.header, justify="left" if column.left else "right")
    for cells in zip(*(c.cells for c in columns)):
        table.add_row(*cells)
    return table


def _lever_cell(field: str, value: Any) -> str:
    if isinstance(run_field(field).kind, Switch):
        return "yes" if value else "no"
    return str(value)


def _per_param(row: dict[str, Any]) -> str:
    state = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    return f"{state * (row.get('nproc') or 1) / row['n_params']:.1f}" if row.get("n_params") else "-"


def _seconds_note(rows: list[dict[str, Any]]) -> str:
    """How long each method took per config ("simulate 4.9-17.4 s per config"): the cost of asking again."""
    spans = []
    for method in dict.fromkeys(r["method"] for r in rows):
        seconds = [r["seconds"] for r in rows if r["method"] == method and r.get("seconds") is not None]
        if seconds:
            low, high = min(seconds), max(seconds)
            spans.append(f"{method} {low:.2f} s" if f"{low:.2f}" == f"{high:.2f}" else
                         f"{method} {low:.2f}-{high:.2f} s")
    return f"time per prediction: {', '.join(spans)}" if spans else ""


def _rate(tokens_per_s: float) -> str:
    """Tokens/s in three significant figures, k for thousands ("31.9k")."""
    return f"{tokens_per_s / 1e3:.3g}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.3g}"


def _timed(row: dict[str, Any]) -> bool:
    """A row that shows a step time: predicted, by a method that predicted the step (its peak too)."""
    return row.get("predicted_step_ms") is not None and row["peak_bytes"] is not None


def _time_notes(rows: list[dict[str, Any]], shown: set[str]) -> list[str]:
    """What the time columns are and rest on (the card's rates: measured or assumed), or why a row has no time."""
    notes = []
    timed = [r for r in rows if _timed(r)]
    if timed and "ms" in shown:
        bound = sum(1 for r in timed if r.get("predicted_host_bound"))
        notes.append("ms = predicted step time, the step's kernels and the host issuing them (docs/methodology.md, "
                     "\"Predicting step time\")" + ("; tok/s = tokens per second" if "tok/s" in shown else "")
                     + (f"; * = host-bound, the GPU waits on Python ({bound} of {len(timed)} rows)" if bound else ""))
        notes += [f"time rates: {markup(basis)}" for basis in dict.fromkeys(r["time_basis"] for r in timed)]
        notes.append(time_band_note(timed, "ms", "ms err" in shown))
    missing = dict.fromkeys(r["time_not_available"] for r in rows if r.get("time_not_available")
                            and r["peak_bytes"] is not None)
    notes += [f"step time: {markup(reason)}" for reason in missing]
    return notes
