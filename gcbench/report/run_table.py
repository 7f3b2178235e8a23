"""`gcbench run`'s table: one record, a row per measured quantity with what it is. Imports no pandas (the other
tables read a frame: tables.py), so that a run prints its result without 0.2 s more of imports."""

from __future__ import annotations

import json
import re
from typing import Any

from rich.console import Console
from rich.table import Table

from gcbench.fields import DeviceKind
from gcbench.text import markup
from gcbench.results.schema import (PHASE_SHORT, PHASES, blocks_text, half_width, lever_text, mix_text, peak_bytes,
                                    policy_label)
from gcbench.units import fmt_bytes, fmt_change, human_count, plural


def run_table(record: dict[str, Any]) -> Table:
    """The one-run table `gcbench run` prints: memory, breakdown, time, throughput, recompute cost."""
    cuda = DeviceKind.of(record["device"]) is DeviceKind.CUDA
    env = record.get("env") or {}
    threads = record.get("threads") or env.get("torch_threads")
    where = markup(env["gpu_name"]) if env.get("gpu_name") else f"{cpu_label(env)} ({plural(threads, 'thread')})"
    # the family, where the model's name does not say it (a config.json, a Hub id)
    shape = ", ".join(w for w in ([record["family"]] if record.get("family") and record["family"] not in record["model"]
                                  else []) + [blocks_text(record)] if w)
    # the optimizer is named in the model state row; the precision and the other levers here
    levers = lever_text(record, leave_out=("optimizer",))
    world = record.get("world_size") or 1
    compiled = record.get("compile_ms") is not None
    # markup(): names from a config, a path or a Hub id are shown as they are, never read as rich tags
    target = f" · target {record['target_len']}" if record.get("target_len") else ""  # an encoder-decoder's
    target += f" · {plural(record['images'], 'image')}" if record.get("images") else ""  # a vision-language model's
    title = (f"{markup(record['model'])}{f' ({markup(shape)})' if shape else ''} · seq {record['seq_len']}{target} · "
             f"batch {record['batch_size']} · {markup(policy_label(record))} · {markup(levers)}\n{where}")  # a line
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("what it is", style="dim")
    if record["status"] != "ok":
        style = "bold yellow" if record["status"] == "oom" else "bold red"
        table.add_row("status", f"[{style}]{markup(record['status'])}[/]", markup(record.get("error") or ""))
        if record.get("predicted_peak_bytes"):
            table.add_row("predicted peak", fmt_bytes(record["predicted_peak_bytes"]),
                          f"{record.get('prediction_method')}, before the run")
        return table
    if cuda:
        table.add_row("peak memory", fmt_bytes(record["peak_allocated_bytes"]),
                      "torch.cuda.max_memory_allocated, whole step")
        table.add_row("peak reserved", fmt_bytes(record["peak_reserved_bytes"]), "allocator cache incl. fragmentation")
    elif record.get("peak_tracked_bytes") is None:  # a compiled policy's (policies/budget.py): see UNTRACKED
        table.add_row("peak memory (tracked)", "[yellow]not measured[/]", UNTRACKED if compiled else "")
    else:
        table.add_row("peak memory (tracked)", fmt_bytes(record["peak_tracked_bytes"]),
                      "peak of live tensor bytes on CPU (not an allocator)")
    measured = peak_bytes(record)
    if record.get("predicted_peak_bytes") and measured:
        error = record["predicted_peak_bytes"] / measured - 1
        table.add_row("predicted peak", fmt_bytes(record["predicted_peak_bytes"]),
                      f"{record.get('prediction_method')} before the run, {fmt_change(error)} vs measured")
    elif not record.get("predicted_peak_bytes") and not compiled:
        table.add_row("predicted peak", "[dim]not predicted[/]", "the analytic formulas do not cover this "
                      "setup; --predict simulates it before the run")
    if record.get("peak_phase"):
        table.add_row("peak reached in", f"[bold]{record['peak_phase']}[/]", _phase_text(record))
    if record.get("activation_peak_bytes") is not None:
        table.add_row("activation peak", fmt_bytes(record["activation_peak_bytes"]), "fwd+bwd peak above model state")
    table.add_row("saved activations", fmt_bytes(record["saved_activation_bytes"]), "kept for backward after forward")
    if record.get("plan_mix"):
        table.add_row("plan mix", markup(mix_text(record["plan_mix"])),
                      "blocks of each kind the plan chose for this shape")
    if record.get("offloaded_bytes") is not None:
        table.add_row("offloaded to host", fmt_bytes(record["offloaded_bytes"]), "host copies per forward (offload)")
    if record.get("compile_ms") is not None:
        table.add_row("compile time", f"{record['compile_ms'] / 1e3:.1f} s", "torch.compile, not in step time")
    if record.get("shard") not in (None, "none"):
        peaks = record.get("rank_peak_allocated_bytes") or record.get("rank_peak_tracked_bytes") or []
        table.add_row("peak per rank", " · ".join(fmt_bytes(p) for p in peaks),
                      (f"each of the {world} ranks" if world > 1 else "its one rank")
                      + " (the record's peak and model state: the largest rank's)")
    state = record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"]
    # Sharded: a rank holds 1/world of the bytes per parameter.
    per_param = f"{state * world / record['n_params']:.1f} B/param{f' over {world} ranks' if world > 1 else ''}: " \
        if record.get("n_params") else ""
    table.add_row("model state" + (" per rank" if world > 1 else ""), fmt_bytes(state),
                  f"{per_param}params {fmt_bytes(record['param_bytes'])} + grads {fmt_bytes(record['grad_bytes'])} "
                  f"+ {record['optimizer']} {fmt_bytes(record['optimizer_bytes'])}")
    if record.get("adapter") not in (None, "none") and record.get("adapter_param_bytes") is not None:
        adapters = record["adapter_param_bytes"]
        # the parts of params above: grads and optimizer state are the adapters' alone
        table.add_row("  frozen base", fmt_bytes(record["param_bytes"] - adapters), "of params: weights, buffers")
        table.add_row("  adapters", fmt_bytes(adapters), f"of params: {record['trainable_params']:,} trainable")
    if record.get("optimizer_paged_bytes") is not None:  # a paged optimizer (optimizers.py, BNB_PAGED_MIN_SIZE)
        table.add_row("paged optimizer state", fmt_bytes(record["optimizer_paged_bytes"]),
                      "CUDA managed memory (bitsandbytes): not in max_memory_allocated nor the model state above"
                      if cuda else "bitsandbytes pages nothing on CPU: all its state is in the model state above")
    shaky = "~" if record.get("timing_stable") is False else ""
    table.add_row("step time (median)", f"{shaky}{record['step_ms_median']:.1f} ms", _step_time_text(record))
    if record.get("predicted_step_ms"):  # a CUDA run on a card the time model has rates for (--predict on)
        error = record["predicted_step_ms"] / record["step_ms_median"] - 1
        table.add_row("predicted step time", f"{record['predicted_step_ms']:.1f} ms",
                      f"the simulated step played on this card, {fmt_change(error)} vs measured (docs/methodology.md)")
    if "timing_stable" in record:
        stable = record["timing_stable"]
        table.add_row("timing", "[green]stable[/]" if stable else "[bold yellow]not trusted[/]",
                      markup("; ".join(record["timing_notes"])) if not stable else _host_text(record))
    accum = record.get("grad_accum") or 1
    table.add_row("throughput", f"{record['tokens_per_s']:,.0f} tokens/s",
                  f"batch x seq{f' x {accum} micro-batches' if accum > 1 else ''}"
                  f"{f' x {world} ranks' if world > 1 else ''} / median step")
    ratio = record.get("recompute_flops_ratio")
    if record.get("flops") is None and compiled:
        table.add_row("recompute FLOPs", "[yellow]not counted[/]", UNCOUNTED)
    else:
        table.add_row("recompute FLOPs", "-" if ratio is None else f"+{ratio:.1%}",
                      f"{human_count(record['flops'], 'FLOP')} per step vs "
                      f"{human_count(record['model_flops'], 'FLOP')} (matmuls and attention)")
    if record.get("mfu") is not None:
        table.add_row("MFU", f"{record['mfu']:.1%}", "model FLOPs / step time / dense bf16 peak")
    return table


# Why a compiled policy's CPU run has no peak and no FLOP count: both are counted by dispatch modes, and torch.compile
# runs the blocks eagerly under any dispatch mode, so they would count another step than the one timed.
UNTRACKED = ("on CPU the live-tensor tracker would make torch.compile run the blocks uncompiled: another step than "
             "the one timed (a CUDA run measures its peak)")
UNCOUNTED = "the FLOP counter would make torch.compile run the blocks uncompiled: another step than the one timed"


def before_run_notes(spec: Any) -> list[str]:
    """What `gcbench run` says before it starts (a resolved.ResolvedRun): a compiling policy's minutes of
    torch.compile, and, on CPU, what it will not measure."""
    policy = spec.policy
    blocks = getattr(spec, "compile", "none") == "blocks"  # --compile blocks (compiled.py): as a compiling policy
    if not policy.compiles and not blocks:
        return []
    name = policy.name if policy.compiles else "--compile blocks"
    notes = [f"{name} compiles every block with torch.compile before the first step: half a minute to minutes on "
             "CPU while inductor's on-disk cache is cold, never counted in the step time"]
    if (policy.hidden_from_dispatch_modes or blocks) and spec.device_kind is DeviceKind.CPU:
        notes.append(f"{name} on CPU: peak memory and FLOPs are not measured (the live-tensor tracker and the "
                     "FLOP counter would make torch.compile run the blocks uncompiled); its step time and the bytes it "
                     "saves for backward are measured")
    return notes


def print_run(record: dict[str, Any], out: Any, output_format: str, console: Console, err_console: Console) -> None:
    """`gcbench run`'s output: the table, then where the record went. --format json: the record alone on stdout
    (one JSON object, as --out stores it: ensure_ascii, so no escape sequence from a name reaches a terminal), where
    it went on stderr."""
    if output_format == "json":
        console.out(json.dumps(record, default=str), highlight=False)
    else:
        console.print(run_table(record))
    (err_console if output_format == "json" else console).print(f"[dim]record appended to {markup(out)}[/]")


def cpu_label(env: dict[str, Any]) -> str:
    """"CPU" and its model's name where the record has it (env.cpu_model; not in older records)."""
    return f"CPU {cpu_name(env['cpu_model'])}" if env.get("cpu_model") else "CPU"


def cpu_name(model: str) -> str:
    """A CPU's model name for a title, as markup, without trademark signs: "Intel Xeon Gold 6338 CPU @ 2.00GHz"."""
    return markup(" ".join(re.sub(r"\s*\((?:R|TM|tm)\)", "", model).split()))


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
    return f"{peaks}{stepped}; {_advice(record)}"


def _advice(record: dict[str, Any]) -> str:
    """What can lower the step's peak: where the activations saved for backward are under half of the peak above
    model state, the rest is the step's own temporaries (a tied embedding's gradients, the logits), and checkpointing
    lowers only the saved part (a 1.7B model at seq 128: 29 MiB saved of 1.13 GiB, the same peak under none and
    full)."""
    saved, above = record.get("saved_activation_bytes"), record.get("activation_peak_bytes")
    if record["peak_phase"] == "optimizer" or saved is None or not above or 2 * saved >= above:
        return PHASE_ADVICE[record["peak_phase"]]
    return (f"saved activations are {fmt_bytes(saved)} of the {fmt_bytes(above)} above model state: checkpointing "
            "can lower that part only")


# why measuring stopped, where it was a limit ("ci" and "fixed" need no words); the default --max-time is the rule,
# not a warning
STOPS = {"max-steps": "stopped at --max-steps", "max-time": "measured for --max-time"}


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
        most = record.get("max_time_s") if record["steps_stop"] == "max-time" else None
        text += f"; {STOPS[record['steps_stop']]}" + (f" ({most:g} s)" if most else "")
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
