"""Showing results to people: unit conversion for display, rich tables."""

from __future__ import annotations

from typing import Any

from rich.table import Table



def fmt_bytes(n: float | None) -> str:
    """Binary units (GiB = 2**30), scaled to stay readable for tiny and 7B models alike."""
    if n is None:
        return "-"
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_count(n: float | None, unit: str = "") -> str:
    if n is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".strip()


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
        table.add_row("peak memory", fmt_bytes(record["peak_allocated_bytes"]), "torch.cuda.max_memory_allocated, whole step")
        table.add_row("peak reserved", fmt_bytes(record["peak_reserved_bytes"]), "allocator cache incl. fragmentation")
    else:
        table.add_row("peak memory (tracked)", fmt_bytes(record["peak_tracked_bytes"]),
                      "peak of live tensor bytes on CPU (not an allocator)")
    table.add_row("activation peak", fmt_bytes(record["activation_peak_bytes"]), "fwd+bwd peak above model state")
    table.add_row("saved activations", fmt_bytes(record["saved_activation_bytes"]), "kept for backward after forward")
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


def policy_label(record: dict[str, Any]) -> str:
    opts = record.get("policy_options") or {}
    return record["policy"] + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
