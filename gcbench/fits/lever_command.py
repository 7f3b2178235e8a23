"""What `gcbench fit --levers` and `gcbench estimate --fit --levers` do with their options: the plan (levers.py)
made from them, every bad input one GcbenchError before anything is predicted; the plan predicted under a progress
bar, its tables printed; on a device that can run it, the winner run under the budget and measured against its
prediction. See docs/levers.md, "A plan across levers"."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, DeviceKind
from gcbench.fits.command import parse_fraction
from gcbench.fits.levers import LEVERS, LeverPlan, Row, candidate_fields, candidates, lever_space, predict_plan
from gcbench.fits.predict import spec_at
from gcbench.gpus import gpu
from gcbench.grid import one_value_each
from gcbench.results.schema import Status
from gcbench.units import fmt_bytes, parse_bytes


def make_plan(values: dict[str, tuple], levers: str, budget: int, target: str,
              global_batch: int | None) -> LeverPlan:
    """The plan of `values` (RunSpec field -> the values given) searching `levers` within `budget` bytes."""
    if "model" not in values:
        raise GcbenchError("no --model given: which model to plan for (see `gcbench models`)")
    if "seq_len" not in values:
        raise GcbenchError("--levers needs the sequence length: give --seq")
    _check_values(values)
    searched, fixed = lever_space(levers, {k: v for k, v in values.items() if k in LEVERS}, target)
    if global_batch is not None and "grad_accum" in fixed:
        raise GcbenchError(f"--batch {global_batch} (the global batch a plan reaches) and --grad-accum "
                           f"{fixed['grad_accum']} cannot both be given: give one of them")
    if global_batch is not None and "grad_accum" not in searched:
        raise GcbenchError(f"--batch {global_batch} is the global batch a plan reaches by accumulation: add "
                           "grad_accum to --levers (or leave --batch out: the largest micro-batch)")
    rest = one_value_each({k: v for k, v in values.items() if k not in LEVERS and k != "batch_size"},
                          "a plan is for one model and shape")
    fields = {**rest, **fixed, "device": "cpu"}
    fields.setdefault("policy", "none")
    plan = LeverPlan(fields, searched, budget, target, global_batch)
    plan.rows = candidates(plan, plan.refused)
    if not plan.rows:
        raise GcbenchError("--levers: no candidate to predict")
    return plan


def _check_values(values: dict[str, tuple]) -> None:
    """Each value the user gave, read by its lever's own parser: a bad one is one line and exit 2 here, before it
    could be taken for a combination the run refuses (candidates' `refused`)."""
    from gcbench.adapters import parse_adapter
    from gcbench.losses import parse_loss
    from gcbench.policies import parse_policy

    for name, parse in (("adapter", parse_adapter), ("loss", parse_loss), ("policy", parse_policy)):
        for value in values.get(name, ()):
            if isinstance(value, str):
                parse(value)


def fit_levers(spec_values: dict[str, Any], levers: str, memory: str | None, headroom: str, out: Path,
               timeout: float, isolation: str, console: Console, bar: Any) -> None:
    """`gcbench fit --levers`: the plan within --memory (on a GPU without it: its free memory) for the device's
    kind; its winner run there under the budget as a memory cap. `bar`: the progress bar (cli_options'
    PredictionBar), a context manager and an estimators Progress."""
    from gcbench.grid import parse_options

    values, _ = parse_options(spec_values, fields=tuple(n for n in BY_NAME if n != "memory_cap_bytes"))
    device = one_value_each({k: v for k, v in values.items() if k == "device"}, "").get("device", "auto")
    target = _target(device)
    if isolation not in ("process", "none"):
        raise GcbenchError(f"unknown --isolation {isolation!r} (process, none)")
    here = target == DeviceKind.CUDA and _cuda_here()
    if memory is None and not here:
        raise GcbenchError("--levers needs the budget: give --memory (e.g. --memory 24GiB)")
    total = parse_bytes(memory, "--memory") if memory is not None else _free_memory(device)
    budget = math.floor(total * (1 - parse_fraction(headroom, "--headroom")))
    batch = values.pop("batch_size", None)
    plan = make_plan({**values, "device": ("cpu",)}, levers, budget, target, batch[0] if batch else None)
    if target == DeviceKind.CPU or here:  # the plan's winner runs here: only what this machine can run is ranked
        leave_out_unrunnable(plan)
    card = _card_here() if here else None
    with bar:
        ranked = predict_plan(plan, card, bar)
    caption = [f"budget {fmt_bytes(budget)} (--memory {memory}{', less ' + headroom if headroom != '0%' else ''})"
               if memory else f"budget {fmt_bytes(budget)}: the free memory of {device}"]
    _print(plan, ranked, console, caption, card)
    winner = next((r for r in ranked if r.fits), None)
    if winner is None:
        return
    if target == DeviceKind.CUDA and not here:
        console.print("[dim]not verified: no GPU here (the plan is for --device cuda)[/]")
        return
    from gcbench.fits.lever_table import verification_lines

    record = verify(plan, winner, device if device != "auto" else ("cuda" if here else "cpu"), out, timeout,
                    isolation)
    for line in verification_lines(winner, record, out):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if record.get("status") == Status.ERROR:  # a crash, not a result: as a sweep's, exit 1
        import typer

        raise typer.Exit(1)


def leave_out_unrunnable(plan: LeverPlan) -> None:
    """Move the candidates this machine cannot run (a package their optimizer or adapter needs is not installed:
    RunSpec.check_runnable) from plan.rows to plan.unrunnable, each with why; none left is one GcbenchError."""
    runnable = []
    for row in plan.rows:
        try:
            spec_at(candidate_fields(plan, row), row.spec_fields["policy"], "batch_size", 1).check_runnable()
        except GcbenchError as e:
            row.reason = str(e)
            plan.unrunnable.append(row)
        else:
            runnable.append(row)
    if not runnable:
        raise GcbenchError(f"--levers: no candidate this machine can run: {plan.unrunnable[0].reason}")
    plan.rows = runnable


def estimate_levers(grid: dict[str, tuple], levers: str, memory: int | None, gpu_name: str | None, headroom: str,
                    target: str, console: Console, bar: Any, fit: bool = True, output_format: str = "table") -> None:
    """`gcbench estimate --fit --levers`: the plan for a GPU by name (or --gpu-memory), nothing run. `bar`: as
    fit_levers'. `fit`: whether --fit was given (--levers plans a fit: without it, one line and nothing else).
    `output_format` json: a JSON object per candidate and line on stdout (lever_table.lever_rows)."""
    if not fit:
        raise GcbenchError("--levers goes with --fit: a plan of the fastest configuration that fits")
    if (memory is None) == (gpu_name is None):
        raise GcbenchError("--levers needs the memory to fit: --gpu NAME or --gpu-memory SIZE (one of them)")
    if target not in ("cuda", "cpu"):
        raise GcbenchError(f"unknown --device {target!r} to predict for (cuda, cpu)")
    card = gpu(gpu_name) if gpu_name is not None else None
    usable = card.usable_bytes if card is not None else memory
    budget = math.floor(usable * (1 - parse_fraction(headroom, "--headroom")))
    batch = grid.pop("batch_size", (1,))
    plan = make_plan(grid, levers, budget, target, batch[0] if len(batch) == 1 and batch[0] > 1 else None)
    with bar:
        ranked = predict_plan(plan, card, bar)
    if output_format == "json":
        import json

        from gcbench.fits.lever_table import lever_rows

        for row in lever_rows(plan, ranked, card.name if card else None, _timed_on(ranked, card)):
            console.out(json.dumps(row, default=str), highlight=False)
        return
    where = card.budget_words() if card else "--gpu-memory"
    _print(plan, ranked, console, [f"budget {fmt_bytes(budget)}: {where}" + (f", less {headroom}"
                                                                              if headroom != "0%" else "")], card)


def _timed_on(ranked: list[Row], card: Any) -> str | None:
    """Where the time model's rates for `card` come from, where a row was timed on it; else None."""
    from gcbench.estimators.card_rates import rates_for

    rates = rates_for(card)
    return rates.basis if any(r.tokens_per_s for r in ranked) and not isinstance(rates, str) else None


def _print(plan: LeverPlan, ranked: list[Row], console: Console, caption: list[str], card: Any = None) -> None:
    from gcbench.estimators.bands import order_error
    from gcbench.fits.lever_table import lever_tables
    from gcbench.results.band_words import order_note

    timed_on = _timed_on(ranked, card)
    # its rows differ in levers that change the class (optimizer, adapter, loss) and in ones that do not
    order = order_note(card.name, order_error(card.name), ["within", "across"]) if timed_on and card else None
    out = console if console.is_terminal else Console(width=80)
    for table in lever_tables(plan, ranked, caption, timed_on, order):
        out.print(table)


def _target(device: str) -> str:
    if device == "auto":
        return DeviceKind.CUDA if _cuda_here() else DeviceKind.CPU
    return DeviceKind.of(device)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_memory(device: str) -> int:
    from gcbench.instruments import free_after_context

    free = free_after_context(device if device != "auto" else "cuda:0")
    if free is None:
        raise GcbenchError(f"cannot read the free memory of {device}: give --memory")
    return free


def _card_here():
    """The gpus.py entry of this machine's GPU (its step times are predicted on it), or None."""
    import torch

    from gcbench.gpus import matching

    return matching(torch.cuda.get_device_name())


def verify(plan: LeverPlan, row: Row, device: str, out: Path, timeout: float, isolation: str) -> dict[str, Any]:
    """Run `row` for real on `device` under the budget as its memory cap (as a fit's trial runs); its record is
    appended to `out` and returned."""
    from gcbench.launch import launcher
    from gcbench.results.rewrite import open_for_writing
    from gcbench.results.store import append_record

    open_for_writing(out)
    spec = spec_at({**candidate_fields(plan, row), "device": device, "memory_cap_bytes": plan.budget,
                    "grad_accum": row.accum},
                   row.spec_fields["policy"], "batch_size", row.micro_batch)
    record = launcher(isolation, timeout, models=[row.spec_fields["model"]])(spec, lambda phase: None)
    append_record(out, record)
    return record
