"""What `gcbench fit` and `gcbench estimate --fit` make of their options: the validated FitSpec (every bad input one
GcbenchError, before anything runs) and the rows of predicted fits. The CLI prints; nothing here does."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console

from gcbench.errors import GcbenchError
from gcbench.fits.fit import DEFAULT_BATCH_RANGE, DEFAULT_POLICIES, DEFAULT_SEQ_LO, VARY, Fit, FitSpec, \
    canonical_policy
from gcbench.estimators.bands import order_error, time_band_fields
from gcbench.estimators.estimates import Progress
from gcbench.fits.predict import predict_each, spec_at
from gcbench.gpus import gpu, max_memory_reserved
from gcbench.grid import RUN_OPTIONS, one_value_each
from gcbench.fields import ESTIMATE_SIZES, RUN_FIELDS, default_precision, run_field
from gcbench.resolved import ResolvedRun, resolve, runnable_defaults
from gcbench.results.band_words import order_note, time_band_note
from gcbench.spec import RunSpec
from gcbench.text import markup
from gcbench.units import fmt_bytes, parse_bytes


def parse_fraction(text: str, what: str) -> float:
    """'5%' or '0.05' -> 0.05, within [0, 1)."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise GcbenchError(f"{what} {text!r}: give a percentage such as 5% (or a fraction such as 0.05)") from None
    if not 0 <= value < 1:
        hint = f": a number without % is a fraction; for {raw} percent write {raw}%" if 1 <= value < 100 and \
            not raw.endswith("%") else ""
        raise GcbenchError(f"{what} {text!r} must be at least 0% and below 100%{hint}")
    return value


def fit_range(text: str | None, vary: str, values: dict[str, Any]) -> tuple[int, int]:
    """--range LO..HI, or the default of what --vary searches: batch 1..4096, seq 16..the model's longest."""
    if text is None:
        if vary == "batch_size":
            return DEFAULT_BATCH_RANGE
        config = resolve(RunSpec(**{**values, "seq_len": DEFAULT_SEQ_LO, "policy": "none"})).config
        longest = getattr(config, "max_position_embeddings", None) or 131_072
        return DEFAULT_SEQ_LO, int(longest)
    lo, sep, hi = text.partition("..")
    try:
        lo_value, hi_value = int(lo), int(hi)
    except ValueError:
        raise GcbenchError(f"--range {text!r}: give LO..HI, two integers such as 1..256") from None
    if not sep or lo_value < 1 or hi_value < lo_value:
        raise GcbenchError(f"--range {text!r} is empty: LO..HI with 1 <= LO <= HI")
    try:
        run_field(vary).parse(hi_value)  # the size's own bounds (a batch below 2**31)
    except GcbenchError as e:
        raise GcbenchError(f"--range {text!r}: {e}") from None
    return lo_value, hi_value


def fit_job(values: dict[str, tuple], vary: str, range_: str | None, multiple_of: int, memory: str | None,
            headroom: str, out: Path, timeout: float, isolation: str, paired: bool,
            console: Console | None) -> tuple[Fit, dict[str, Any]]:
    """The Fit the options describe (values: RunSpec field -> its values, as parse_options gives them), and the
    fields every trial shares."""
    if vary not in VARY:
        raise GcbenchError(f"unknown --vary {vary!r} (batch, seq)")
    field_name = VARY[vary]
    if "model" not in values:
        raise GcbenchError("no --model given: which model to fit (see `gcbench models`)")
    if field_name in values:
        raise GcbenchError(f"--{run_field(field_name).flag} is what --vary {vary} searches: give its range "
                           f"with --range LO..HI")
    values = dict(values)
    policies = values.pop("policy", None)
    fields = one_value_each(values, "gcbench fit searches one setup; the policies take several values")
    policies, refused = _policies(policies, fields)
    for line in refused if console is not None else ():
        console.print(f"[dim]{markup(line)}[/]")
    if field_name == "batch_size" and "seq_len" not in fields:
        raise GcbenchError("--vary batch needs the sequence length: give --seq")
    fields.setdefault("batch_size", 1)
    if isolation not in ("process", "none"):
        raise GcbenchError(f"unknown --isolation {isolation!r} (process, none)")
    if multiple_of < 1:
        raise GcbenchError(f"--multiple-of must be at least 1, got {multiple_of}")
    try:  # the sweep's rule (nan, 0 and negatives refused; inf: no limit)
        timeout = RUN_OPTIONS["timeout"][1].parse(timeout)
    except GcbenchError as e:
        raise GcbenchError(f"--timeout: {e}") from None
    fields.pop(field_name, None)
    lo, hi = fit_range(range_, field_name, fields)
    if -(-lo // multiple_of) * multiple_of > hi:
        raise GcbenchError(f"--range {lo}..{hi} holds no multiple of {multiple_of}")
    spec = FitSpec(fields, tuple(policies), field_name, lo, hi, multiple_of,
                   parse_bytes(memory, "--memory") if memory is not None else None,
                   parse_fraction(headroom, "--headroom"), out, timeout, isolation, paired)
    try:
        job = Fit(spec, console=console)
    except GcbenchError as e:  # each policy at both ends of the range is checked first: name the range
        given = f"--range {range_}" if range_ is not None else f"the default range {lo}..{hi}"
        raise GcbenchError(f"{e} ({given})" if f"--{run_field(field_name).flag} " in str(e) else str(e)) from None
    return job, fields


def _policies(given: tuple[str, ...] | None, fields: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the policies to fit, a line for each default left out): those given, else the defaults the model runs (a
    T5 no group policy, an encoder-decoder no plan)."""
    return (list(given), []) if given is not None else runnable_defaults(DEFAULT_POLICIES, fields)


def fit_method(methods: list[str]) -> str | None:
    """The one method `estimate --fit` predicts each policy's sizes by, from --method: one asked for is used for
    every policy (analytic refuses a policy or family it has no formulas for); both (the default) leave it to
    each policy: analytic where it knows it, else simulate."""
    unknown = [m for m in methods if m not in ("analytic", "simulate")]
    if unknown or not methods:
        raise GcbenchError(f"--method {','.join(methods)!r}: analytic, simulate or both, comma-separated")
    return methods[0] if len(set(methods)) == 1 else None


def predicted_fits(grid: dict[str, tuple], memory: int | None, gpu_name: str | None, vary: str, headroom: str,
                   device: str, progress: Progress | None = None, methods: list[str] | None = None,
                   bands: bool = True) -> tuple[list[dict[str, Any]], str, str, list[str]]:
    """(rows, the varied field, title, caption) of `gcbench estimate --fit`: per policy the largest size predicted
    to fit, its peak, the next size's peak, and with a named GPU the predicted step time and tokens/s, and (`bands`)
    that time's measured error band. `progress`: told of each size predicted and each policy done; `methods`:
    --method's (fit_method). The title and caption are rich markup (the model's name escaped)."""
    if vary not in VARY:
        raise GcbenchError(f"unknown --vary {vary!r} (batch, seq)")
    method = fit_method(methods or ["analytic", "simulate"])
    if (memory is None) == (gpu_name is None):
        raise GcbenchError("--fit needs the memory to fit: --gpu NAME or --gpu-memory SIZE (one of them)")
    card = gpu(gpu_name) if gpu_name is not None else None
    usable = card.usable_bytes if card is not None else memory
    cap = math.floor(usable * (1 - parse_fraction(headroom, "--headroom")))
    field_name = VARY[vary]
    if field_name in grid:
        whole = "batch {}..{}".format(*DEFAULT_BATCH_RANGE) if vary == "batch" else \
            f"seq {DEFAULT_SEQ_LO}..the model's longest"
        raise GcbenchError(f"--{run_field(field_name).flag} is what --vary {vary} searches (its whole range: {whole})")
    policies = grid.pop("policy", None)
    fields = one_value_each(grid, "--fit predicts one setup; the policies take several values")
    policies, refused = _policies(policies, fields)  # the defaults left out are named in the caption
    policies = [canonical_policy(p, cap) for p in policies]
    fields = {**ESTIMATE_SIZES, **fields}
    fixed = {k: v for k, v in fields.items() if k != field_name}  # what every prediction shares
    lo, hi = fit_range(None, field_name, fixed)
    rows = []
    for policy, found in zip(policies, predict_each(fixed, policies, field_name, lo, hi, cap, device, progress,
                                                    method, replay=device == "cuda" and method == "simulate")):
        spec_fields = {**fields, field_name: found.value} if found.value else fields
        tokens = spec_fields["seq_len"] * spec_fields["batch_size"] * fields.get("grad_accum", 1)
        step, timed = _step_time(fixed, policy, field_name, found, device, card)
        step_s, host_bound = (step.step_ms / 1e3, step.host_bound) if step else (None, None)
        # the setup too, each row read alone (--format json): the model, sizes and levers, the size found in its field
        rows.append({**fields, field_name: found.value, "vary": field_name,
                     "policy": policy, "value": found.value, "peak": found.estimate.peak_bytes
                     if found.estimate else None, "next_peak": found.next_peak, "step_s": step_s,
                     "tokens_per_s": tokens / step_s if step_s else None, "method": found.method,
                     "predictions": found.predictions, "flops": found.flops, "budget_bytes": cap,
                     "range_top": found.value == hi,  # the search's top fits: a larger size may fit too
                     # the allocator replayed (--method simulate): its reserved peak, and the allocated peak's answer
                     **({"reserved": max_memory_reserved(found.reserved, card) if found.reserved else None,
                         "allocated_only": found.allocated_only}
                        if found.allocated_only is not None else {}),
                     "gpu": card.name if card else None, "time_basis": step.basis if step else None,
                     # the step time's measured error band on the card (estimators/bands.py), which its regime picks
                     **({"predicted_host_bound": host_bound, **time_band_fields(timed, card.name, host_bound)}
                        if bands and card and device == "cuda" else {})})
    where = card.budget_words() if card else f"--gpu-memory {fmt_bytes(memory)}"
    caption = [f"budget {fmt_bytes(cap)}: {where}" + (f", less {headroom} headroom" if cap < usable else ""),
               "PREDICTED, nothing ran: peaks by the method in `by`; step s = the size found simulated and its step "
               "played on the card (docs/methodology.md, \"Predicting step time\")" if card else
               "PREDICTED, nothing ran: peaks by the method in `by`; step time needs --gpu (its rates)"]
    caption += [f"time rates: {basis}" for basis in dict.fromkeys(r["time_basis"] for r in rows if r["time_basis"])]
    if bands and (timed_rows := [r for r in rows if r["step_s"]]):
        caption.append(time_band_note(timed_rows, "step s", False))
        if len(timed_rows) > 1:  # the fastest is named below: how far such an order holds
            caption.append(order_note(card.name, order_error(card.name), ["within"]))  # one setup: one class
    caption += refused
    if rows and not any(r["value"] for r in rows):  # what a user can change next, not given yet (docs/levers.md)
        cuda = device == "cuda"
        may = [f"an adapter (--adapter lora{', qlora' if cuda else ''})"] if fields.get("adapter", "none") == "none" \
            else []
        may += [f"a lighter optimizer (--optimizer {'adamw8bit, ' if cuda else ''}adafactor)"] \
            if fields.get("optimizer", "adamw") in ("adamw", "adamw-loop", "adamw-fused") else []
        may.append("a shorter --seq" if field_name == "batch_size" else "a smaller --batch")
        caption.append(f"nothing fits: {', '.join(may[:-1])}{' or ' if len(may) > 1 else ''}{may[-1]} may; "
                       "--levers auto searches them")
    if any(r["range_top"] for r in rows):  # seq's top is the model's longest: nothing longer runs
        caption.append(f"{vary} (top) = " + ("the top of the range searched fits: the largest batch that fits may be "
                                             "larger" if vary == "batch" else "the model's longest sequence fits"))
    by_allocated = device == "cuda" and method != "simulate"  # no allocator replayed: the peak alone decides
    if by_allocated and any(r["value"] for r in rows):
        caption.append("peaks are max_memory_allocated: the caching allocator reserves more, and its segments can "
                       "run out a size or more below max batch; --method simulate replays it on the card, size by "
                       "size (seconds to minutes per policy)")
    best = max((r for r in rows if r["tokens_per_s"]), key=lambda r: r["tokens_per_s"], default=None)
    if best is not None:  # the command last, alone on its line: the CLI prints it outside the table (`fit_command`)
        caption += [f"predicted fastest: {best['policy']} at {vary} {best['value']}"
                    + (" by its allocated peak" if by_allocated else "")
                    + "; measure it on the card with:",
                    fit_command({**fields, "policy": best["policy"]}, field_name, headroom if cap < usable else None)]
    title = f"{fields['model']} · largest {vary} predicted to fit · " + (
        f"seq {fields['seq_len']}" if field_name == "batch_size" else f"batch {fields['batch_size']}")
    return rows, field_name, markup(title), [markup(line) for line in caption]


def fit_command(fields: dict[str, Any], field_name: str, headroom: str | None) -> str:
    """The `gcbench fit` that measures `fields`' setup on the card, searching `field_name`: a line a shell runs as
    printed (every given option spelt out, each value quoted for the shell)."""
    words = ["gcbench", "fit"]
    for declared in RUN_FIELDS:
        value = fields.get(declared.name)
        if value is not None and declared.name not in (field_name, "device", "memory_cap_bytes"):
            words += [f"--{declared.flag}", shlex.quote(declared.kind.show(value))]
    return " ".join(words + (["--vary", "seq"] if field_name == "seq_len" else [])
                    + (["--headroom", shlex.quote(headroom)] if headroom else []))


def command_apart(caption: list[str]) -> tuple[list[str], str | None]:
    """(the caption, its `gcbench fit` command, or None) of `predicted_fits`: a terminal wraps a long command inside
    a table's caption and pads it with spaces; printed apart, it is one line a user can paste."""
    if caption and caption[-1].startswith("gcbench fit "):
        return caption[:-1], caption[-1]
    return caption, None


def _step_time(fixed: dict[str, Any], policy: str, field_name: str, found: Any, device: str,
               card: Any) -> tuple[Any, ResolvedRun | None]:
    """(the step on `card` (step_time.Step), the config timed) of the size found, by the time model
    (estimators/step_time.py): its simulation (the search's, where it simulated that size); (None, None) without a
    card, a size, or a CUDA target."""
    from gcbench.estimators import estimate
    from gcbench.estimators.card_rates import rates_for

    rates = rates_for(card)
    if card is None or found.value is None or device != "cuda" or isinstance(rates, str):
        return None, None
    fields = {**fixed, "device": "cpu", "memory_cap_bytes": None,
              "precision": fixed.get("precision") or default_precision(device)}
    try:
        spec = spec_at(fields, policy, field_name, found.value)
        work = estimate(spec, "simulate", device).work
    except GcbenchError:
        return None, None
    if work is None:
        return None, None
    return work.time(rates), spec
