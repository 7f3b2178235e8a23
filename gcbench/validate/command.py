"""`gcbench validate`: its options (the Typer command cli.py registers) and what it does with them: one of import,
predict, dry run, or run (then archive). Every bad input is a GcbenchError before anything runs or is written."""

from __future__ import annotations

import contextlib
import math
import sys
import textwrap
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gcbench import gpus
from gcbench.cli_options import domain_errors
from gcbench.errors import GcbenchError
from gcbench.validate.plan import (CARDS, COMMAND_LIMIT_S, DEVICE_NAMES, PREDICTED, SMOKE_ROOT, results_folder,
                                   tiers as plan_tiers)
from gcbench.values import option_items

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped at the deadline; the same command goes on
Opt = typer.Option


def validate(
    dry_run: Annotated[bool, Opt("--dry-run", help="print the tiers, what is done, device seconds; run nothing")]
    = False,
    deadline: Annotated[float | None, Opt(help="stop cleanly before work ending past this", metavar="<s>")] = None,
    tiers: Annotated[str | None, Opt(help="only these tiers, e.g. 1,2", metavar="<list>")] = None,
    archive: Annotated[Path | None, Opt(help="then pack the results: one .tar.gz + summary.txt", metavar="<dir>")]
    = None,
    predict: Annotated[bool, Opt("--predict", help="(CPU) make the plan's predictions beforehand")] = False,
    import_: Annotated[Path | None, Opt("--import", metavar="<archive>",
                                        help="merge a GPU archive into this checkout: records, report, quoted numbers"
                                        )] = None,
    gpu: Annotated[str | None, Opt(help="card to plan for: h100-80gb (default), h200-141gb (or h200)")] = None,
    smoke: Annotated[bool, Opt("--smoke", help="the plan on tiny models, into results/gpu-smoke/")] = False,
) -> None:
    """The GPU validation in tiers of at most 8 minutes, resumable (docs/gpu.md). Exit 0: all done; 75: stopped at
    --deadline (run again); 1: a step failed."""
    with domain_errors(lambda: "interrupted; finished configs are kept, run the same command again to resume"):
        code = validate_command(dry_run=dry_run, deadline=deadline, tiers=tiers, archive=archive, predict=predict,
                                import_=import_, gpu=gpu, smoke=smoke, console=Console(), err_console=Console(stderr=True))
    raise typer.Exit(code)


def _in_checkout_root() -> None:
    """The plan reads its predictions (benchmarks/gpu/predicted/), runs the checkout's scripts and writes
    results/gpu/, all from the checkout's root: elsewhere it would price every step without its predictions."""
    from gcbench.validate.home import checkout_root, is_checkout

    if is_checkout(Path(".")):
        return
    try:
        where = f": cd {str(checkout_root(Path('.')))[:200]}"
    except GcbenchError:
        where = " (a clone of gcbench's repository)"
    raise GcbenchError(f"validate runs in the root of a gcbench checkout, where the plan's predictions and scripts "
                       f"are{where}")


def validate_command(*, dry_run: bool, deadline: float | None, tiers: str | None, archive: Path | None,
                     predict: bool, import_: Path | None, gpu: str | None, smoke: bool, console: Console,
                     err_console: Console) -> int:
    modes = [name for name, on in (("--dry-run", dry_run), ("--predict", predict), ("--import", import_ is not None))
             if on]
    if len(modes) > 1:
        raise GcbenchError(f"{' and '.join(modes)} are different jobs: give one")
    if modes and (deadline is not None or archive is not None):
        raise GcbenchError(f"--deadline and --archive go with a run, not with {modes[0]}")
    if deadline is not None and not (math.isfinite(deadline) and deadline > 0):
        raise GcbenchError(f"--deadline must be a positive number of seconds, got {deadline:g}")
    with contextlib.suppress(GcbenchError):  # h200 -> h200-141gb; a name of no card is refused below
        gpu = gpus.gpu(gpu).name if gpu is not None else None
    if gpu is not None and gpu not in CARDS:
        raise GcbenchError(f"--gpu {gpu!r}: the plan is made for {', '.join(CARDS)}")
    wanted = _tier_numbers(tiers)
    if archive is not None:
        _check_folder(archive, "--archive")
    if import_ is not None:
        return _import(import_, console)
    _in_checkout_root()

    import torch

    from gcbench.validate.execute import Validation, archive as write_archive, check_budget

    here = torch.cuda.is_available()
    plan = plan_tiers(smoke=smoke, bitsandbytes=_has_bitsandbytes())
    predicted = SMOKE_ROOT / "predicted" if smoke else PREDICTED
    if predict or dry_run or not here:
        if not (predict or dry_run):
            raise GcbenchError("no CUDA GPU here (gcbench validate --dry-run prints the plan; --predict makes its "
                               "predictions on this machine)")
        card = gpu or CARDS[0]
        folder = results_folder(DEVICE_NAMES[card], smoke)
        with err_console.status("planning"):
            validation = Validation(plan, folder, predicted=predicted, card=card, tiers_wanted=wanted,
                                    planning=True, python=sys.executable, console=err_console)
        if predict:
            from gcbench.validate.predict import predict_plan

            written = predict_plan(validation, err_console, cards=CARDS[:1] if smoke else CARDS)
            console.print(f"predictions written: {', '.join(str(p) for p in written)}", markup=False,
                          highlight=False)
            return 0
        console.print(f"gcbench GPU validation plan for {card}\nrecords in {folder}/", markup=False, highlight=False)
        for line in validation.describe():  # commands come wrapped with their `\`; a tier's title is wrapped here
            title = line.startswith("tier ") and len(line) > console.width
            console.print(textwrap.fill(line, console.width, subsequent_indent=" " * 8) if title else line,
                          markup=False, highlight=False, soft_wrap=True)
        check_budget(validation)
        return 0

    from gcbench.gpus import for_device

    name = torch.cuda.get_device_name(0)
    known = for_device(name, torch.cuda.get_device_properties(0).total_memory)
    folder = results_folder(name, smoke)
    validation = Validation(plan, folder, predicted=predicted, card=known.name if known else None,
                            tiers_wanted=wanted, python=sys.executable, console=err_console)
    console.print(f"gcbench GPU validation on {name}\nrecords in {folder}/", markup=False, highlight=False,
                  soft_wrap=True)
    if deadline is not None and deadline > COMMAND_LIMIT_S:
        err_console.print(f"gcbench: note: --deadline {deadline:g} s is past the {COMMAND_LIMIT_S} s a tier is "
                          "planned for", markup=False, highlight=False)
    outcome = None
    try:
        outcome = validation.run(deadline)
    finally:
        summary = _summary(validation, outcome, name)
        if archive is not None:
            path = write_archive(folder, archive, summary)
            console.print(f"archive: {path} (import it with: gcbench validate --import {path.name})", markup=False,
                          highlight=False, soft_wrap=True)
    for line in summary.splitlines():
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if outcome.stopped:
        return EXIT_STOPPED
    return 1 if outcome.failed else 0


def _summary(validation, outcome, gpu_name: str) -> str:
    validation.refresh()
    lines = [f"gcbench validate on {gpu_name}: {validation.folder}/"]
    for planned in validation.steps:
        lines.append(f"tier {planned.tier.number} {planned.step.name}: {planned.done}/{planned.total} done")
    if outcome is None:
        lines.append("interrupted: run the same command again to resume")
    elif outcome.stopped:
        left = round(sum(validation.tier_seconds().values()))
        lines.append(f"stopped at the deadline ({outcome.stopped}) after {outcome.seconds:.0f} s; about {left} s of "
                     "device time left; run the same command again to resume")
    elif outcome.failed:
        lines += ["not everything passed:", *(f"  {line}" for line in outcome.failed)]
    else:
        lines.append(f"done in {outcome.seconds:.0f} s")
    return "\n".join(lines) + "\n"


def _import(archive: Path, console: Console) -> int:
    from gcbench.validate.home import checkout_root, import_archive

    try:
        archive.stat()
    except OSError as e:  # no such file, a name too long, a folder on the way that is not one
        raise GcbenchError(f"--import {str(archive)[:200]!r}: {e.strerror or e}") from None
    if not archive.is_file():
        raise GcbenchError(f"--import {str(archive)[:200]!r}: not a file")
    result = import_archive(archive, checkout_root(Path.cwd()))
    console.print(f"imported {result.files} file(s) into {result.folder}/ ({result.records_added} new record(s)); "
                  f"report in {result.report}/", markup=False, highlight=False)
    if result.smoke:
        console.print("a smoke archive: nothing quoted (no GPU numbers)", markup=False, highlight=False)
    elif result.quoted:
        console.print(f"GPU numbers updated in: {', '.join(str(p) for p in result.quoted)}", markup=False,
                      highlight=False)
    return 0


def _check_folder(path: Path, option: str) -> None:
    """`path` can be made a folder and written into: an existing folder, or one whose nearest existing parent is
    (nothing is created before the work is done)."""
    import os

    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise GcbenchError(f"{option} {str(path)[:200]!r}: not a folder this user can write into")


def _tier_numbers(text: str | None) -> set[int] | None:
    if text is None:
        return None
    known = [tier.number for tier in plan_tiers()]
    words = f"--tiers {text!r}: give tier numbers {known[0]}-{known[-1]}, comma-separated (e.g. 1,2)"
    try:
        numbers = {int(part) for part in option_items("--tiers", text)}
    except ValueError:
        raise GcbenchError(words) from None
    if not numbers or not numbers <= set(known):
        raise GcbenchError(words)
    return numbers


def _has_bitsandbytes() -> bool:
    from importlib.util import find_spec

    return find_spec("bitsandbytes") is not None
