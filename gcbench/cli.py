"""The `gcbench` command: thin Typer commands that build a spec and call one library function.

Every domain error (GcbenchError) and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gcbench.cli_options import (ALL, FIT_FIELDS, DevicesOption, ExecutorOption, JobsOption, LeversOption,
                                 PredictionBar, RunFormatOption, SlurmGpusOption, SlurmParallelismOption,
                                 SlurmPartitionOption, check_format, check_jobs, domain_errors, one_line_summaries,
                                 prepare_sweep, print_version, print_warnings, refuse_unused, step_progress,
                                 warm_children, with_bare_switches, with_spec_options)
from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, ESTIMATE_AXES, ESTIMATE_FIELDS, ESTIMATE_SIZES
from gcbench.gpus import gpu as gpu_entry, memory_to_fit
from gcbench.grid import DEFAULT_POLICIES, REQUIRED, one_value_each
from gcbench.results.schema import Status
from gcbench.spec import RunSpec
from gcbench.text import markup, plain
from gcbench.validate import command as validate_command
from gcbench.values import option_items

app = typer.Typer(help="Benchmark the memory/compute trade-off of activation checkpointing on transformers models.",
                  pretty_exceptions_enable=False, add_completion=False)
console = Console()
err_console = Console(stderr=True)

DEFAULT_OUT = Path("results/runs.jsonl")
# What `sweep --help` says of the fields a sweep defaults itself or requires (grid.SweepSpec), not RunSpec's defaults
SWEEP_SHOWN = {"policy": f"default: {', '.join(DEFAULT_POLICIES)}: those the model allows",
               **{name: "required, here or in --config" for name in REQUIRED}}
ESTIMATE_SHOWN = {name: f"default: {value}" for name, value in ESTIMATE_SIZES.items()}  # applied by estimate itself


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context, _version: Annotated[
        bool, typer.Option("--version", help="print the versions of gcbench, torch and transformers and exit",
                           callback=print_version, is_eager=True)] = False) -> None:
    # Help for a bare `gcbench` (instead of no_args_is_help, whose help-as-error would be squeezed into one line).
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


@app.command()
@with_spec_options(defaults={"model": "gpt2", "seq_len": 512, "batch_size": 1, "policy": "none"})
def run(
    spec_values: dict[str, Any],
    out: Annotated[Path, typer.Option(help="JSON Lines file the record is appended to", metavar="<path>")]
    = DEFAULT_OUT,
    output_format: RunFormatOption = "table",
) -> None:
    """Measure real training steps of one model under one checkpoint policy."""
    written: list[bool] = []  # [True] once the record is in --out
    with domain_errors(lambda: f"interrupted; {'the record is in' if written else 'nothing was written to'} {out}"):
        from gcbench.grid import parse_options
        from gcbench.report.run_table import before_run_notes, print_run
        from gcbench.resolved import resolve
        from gcbench.results.rewrite import open_for_writing
        from gcbench.results.store import append_record
        from gcbench.launch import run as run_spec

        check_format(output_format)
        values, _ = parse_options(spec_values, fields=tuple(BY_NAME))
        spec = resolve(RunSpec(**one_value_each(values, "gcbench run measures one config; a grid is `gcbench sweep`")))
        open_for_writing(out)  # before measuring: an output that cannot take the record is known now
        print_warnings(before_run_notes(spec))
        # --steps auto: how many steps is not known in advance; the bar pulses and the text counts them
        fixed = spec.budget.fixed
        with step_progress(err_console, spec.warmup_steps + fixed + 4 if fixed else None) as advance:
            record = run_spec(spec, progress=advance, refuse_unfit=True)
        try:
            dropped = append_record(out, record, written=lambda: written.append(True))
        except GcbenchError:
            typer.echo(json.dumps(record, default=str))  # the measurement is not lost: stdout has it
            raise
        if dropped is not None:
            typer.echo(f"gcbench: warning: {plain(out)}: removed a truncated last line left by an interrupted run "
                       f"({dropped[:60]!r}...)", err=True)
    print_run(record, out, output_format, console, err_console)
    if record["status"] != Status.OK:
        raise typer.Exit(1)


@app.command()
def models() -> None:
    """List the model presets. Any other model: --model path/to/config.json, or a Hub id (owner/name)."""
    from gcbench.models import MODALITIES, MODELS, describe
    from gcbench.report.models_table import models_table

    rows = sorted((describe(name) for name in MODELS), key=lambda row: MODALITIES.index(row["modality"]))
    table = models_table(rows, wide=console.width >= 120)
    console.print(table)


@app.command()
def policies() -> None:
    """List the checkpoint policies, their options and what they do."""
    from gcbench.policies import POLICIES, option_fields

    table = Table("name", "options", "meaning", title="checkpoint policies (N = number of blocks)", caption="every "
                  "policy also takes stack=NAME on a model of several stacks (encoder, decoder): that one only")
    for name, cls in POLICIES.items():
        opts = ", ".join(f"{f.name}={f.default} ({f.metadata.get('help', '')})" for f in option_fields(cls)
                         if not f.metadata.get("every_policy"))
        table.add_row(name, opts or "-", cls.summary)
    console.print(table)


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="results files (*.jsonl) or folders of them (not subfolders)")],
    out: Annotated[str | None, typer.Option(help="also write report.md, a self-contained report.html and "
                                                 "figures/*.png|svg into this directory", metavar="<dir>")] = None,
) -> None:
    """Tables of many runs grouped by device, model, seq and batch, with `x none` ratios; --out adds figures
    and a report to share."""
    from gcbench.report.document import write_report
    from gcbench.report.publish import check_folder
    from gcbench.report.tables import terminal_tables
    from gcbench.results.frame import load_results, results_frame

    with domain_errors():
        if out is not None and not out.strip():
            raise GcbenchError("--out: an empty path; give the directory the report goes to")
        df, notes = load_results(paths)
        if out is not None:
            check_folder(Path(out))  # before the tables: a refusal is its one line, not the tables and then it
        print_warnings(notes)
        frame = results_frame(df)
        for item in terminal_tables(frame, console.width):
            console.print(item)
        if out is not None:
            written = write_report(frame, Path(out))
            console.print(f"report written to {markup(out)}/ ({len(written)} files: report.md, report.html, "
                          f"{len(written) - 2} figure files)")


@app.command()
def compare(
    old: Annotated[Path, typer.Argument(help="results before (file or directory)")],
    new: Annotated[Path, typer.Argument(help="results after (file or directory)")],
    fail: Annotated[str | None, typer.Option(help="regression thresholds, e.g. peak:5%,time:10%,tokens:10%; a "
                                                  "config past one (or one that no longer runs) exits with 1")]
    = None,
    strict: Annotated[bool, typer.Option("--strict", help="with --fail: a time or tokens/s change inside the noise "
                                                         "of either run fails too (default: listed, not failed)")]
    = False,
    by: Annotated[str, typer.Option(help="time: each config's step time; ratio: each policy's time relative to its "
                                         "results' baseline policy (none) at the same seq and batch, paired where "
                                         "timed so: what a machine's load shifts least")] = "time",
) -> None:
    """Changes in peak memory, step time and tokens/s between two results, matched config by config."""
    from gcbench.compare import compare_results, parse_thresholds, print_comparison
    from gcbench.results.frame import load_results, results_frame

    with domain_errors():
        thresholds = parse_thresholds(fail, strict)
        frames = []
        for path in (old, new):
            df, notes = load_results([path])
            print_warnings(notes)
            frames.append(results_frame(df))
        result = compare_results(*frames, thresholds, strict=strict, by=by)
    print_comparison(console, result, thresholds, fail)
    if result.failed:
        raise typer.Exit(1)


@app.command()
@with_spec_options(several=ALL, shown=SWEEP_SHOWN)
def sweep(
    spec_values: dict[str, Any],
    config: Annotated[Path | None, typer.Option(help="TOML file with the grid (keys: the option names above and "
                                                     "below); options given here override it")] = None,
    out: Annotated[Path | None, typer.Option(help="JSON Lines file records are appended to (default "
                                                  "results/sweep.jsonl); configs already in it are not run again")]
    = None,
    timeout: Annotated[float | None, typer.Option(help="seconds per config before its child is killed (default "
                                                       "600)")] = None,
    isolation: Annotated[str | None, typer.Option(help="process: a fresh child per config (default) | none: in "
                                                       "this process (faster start, no timeout, less safe)")] = None,
    no_skip: Annotated[bool, typer.Option("--no-skip", help="also run configs larger than one that ran out of "
                                                           "memory (default: record them as skipped)")] = False,
    rerun: Annotated[bool, typer.Option("--rerun", help="run every config, even those already in --out")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="run again the configs whose record in --out "
                                                                     "is an error, a timeout, or an oom not run for "
                                                                     "want of free memory (other ooms stay: they "
                                                                     "are results)")] = False,
    no_paired: Annotated[bool, typer.Option("--no-paired", help="do not time the policies of one seq x batch "
                                                               "interleaved in one process after they ran (time "
                                                               "ratios then come from separate runs)")] = False,
    devices: DevicesOption = None,
    jobs: JobsOption = None,
    executor: ExecutorOption = None,
    slurm_partition: SlurmPartitionOption = None,
    slurm_gpus_per_job: SlurmGpusOption = None,
    slurm_array_parallelism: SlurmParallelismOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the grid and its size; run nothing")] = False,
) -> None:
    """Run a grid of models x seq x batch x policies, each config in a fresh process; resumable, OOM is a result.

    Every option of a config takes several comma-separated values (--seq 512,1024); the grid is every combination.
    """
    from gcbench.grid import DEFAULT_OUT as DEFAULT_SWEEP_OUT, SweepSpec

    options = {**spec_values, **dict(out=out, timeout=timeout, isolation=isolation, paired=False if no_paired else None,
               devices=devices, jobs=jobs, executor=executor, slurm_partition=slurm_partition,
               slurm_gpus_per_job=slurm_gpus_per_job, slurm_array_parallelism=slurm_array_parallelism)}
    results = out or DEFAULT_SWEEP_OUT
    with domain_errors(lambda: "interrupted; nothing was run (--dry-run)" if dry_run else
                       f"interrupted; finished configs are in {results}, run the same command again to resume"):
        grid = SweepSpec.load(config, {k: v for k, v in options.items() if v is not None})
        results = grid.out
        prepare_sweep(grid, dry_run)
        from gcbench.sweeps import Sweep

        job = Sweep(grid, rerun=rerun, retry_failed=retry_failed, skip_after_oom=not no_skip, console=err_console)
        check_jobs(grid, dry_run)
        if left_out := grid.left_out():
            err_console.print(f"[dim]{markup(left_out)}[/]")
        if dry_run:
            from gcbench.report.sweep_tables import grid_table

            plan = [(p.spec.as_record(), p.done["status"] if p.done else None) for p in job.plan()]
            console.print(grid_table(plan, grid.out, grid.shared_options()))
            return
        records = job.run()
        # the tables need pandas (0.2 s on 2 cores): imported once the configs ran, not before the first one starts
        from gcbench.report.sweep_tables import largest_fit_table, summary_table
    console.print(summary_table(records, console.width))
    fits = largest_fit_table(records, console.width)
    if fits is not None:
        console.print(fits)
    console.print(f"[dim]records in {markup(grid.out)} (sweep {job.sweep_id})[/]")
    # OOMs, timeouts and skips are results; an error (a crash, a bug) is not: make scripts notice it.
    if any(r["status"] == Status.ERROR and r.get("sweep_id") == job.sweep_id for r in records):
        raise typer.Exit(1)


@app.command()
@with_spec_options(several=("policy",), fields=FIT_FIELDS)
def fit(
    spec_values: dict[str, Any],
    vary: Annotated[str, typer.Option(help="what to search: batch (the sequence fixed by --seq) | seq (the batch "
                                           "fixed by --batch, default 1)")] = "batch",
    range_: Annotated[str | None, typer.Option("--range", help="sizes to search, LO..HI (default: batch 1..4096, "
                                                               "seq 16..the model's longest)", metavar="<lo..hi>")]
    = None,
    multiple_of: Annotated[int, typer.Option(help="search only multiples of this (e.g. 64 for seq)")] = 1,
    memory: Annotated[str | None, typer.Option(help="the budget, e.g. 24GiB: a memory cap on every trial (\"what if "
                                                    "I had a 24 GiB card\"); default: the GPU's free memory (on "
                                                    "CPU required)", metavar="<size>")] = None,
    headroom: Annotated[str, typer.Option(help="part of the budget kept free, e.g. 5%", metavar="<percent>")] = "0%",
    out: Annotated[Path, typer.Option(help="JSON Lines file every trial's record is appended to",
                                      metavar="<path>")] = Path("results/fit.jsonl"),
    timeout: Annotated[float, typer.Option(help="seconds per trial before its child is killed")] = 600.0,
    isolation: Annotated[str, typer.Option(help="process: a fresh child per trial | none: in this process")]
    = "process",
    no_paired: Annotated[bool, typer.Option("--no-paired", help="do not time the policies' largest configs "
                                                               "interleaved (rank them by their own runs)")] = False,
    levers: LeversOption = None,
) -> None:
    """The largest batch (or sequence) each policy runs in a memory budget, by real trials: predicted, bracketed,
    bisected; then the fastest recommended, with the `gcbench run` command that measures it again."""
    if levers is not None:  # a plan across levers (fits/lever_command.py), its winner verified
        from gcbench.fits.lever_command import fit_levers
        with domain_errors(lambda: f"interrupted; nothing of the plan is kept but the records in {out}"):
            refuse_unused("with --levers: a plan searches the micro-batch at --seq and ranks by predicted time",
                          {"--vary": vary != "batch", "--range": range_ is not None, "--multiple-of": multiple_of != 1,
                           "--no-paired": no_paired})
            return fit_levers(spec_values, levers, memory, headroom, out, timeout, isolation, console,
                              PredictionBar(err_console, "predicting"))
    if isolation == "process" and "model" in spec_values:
        warm_children([spec_values["model"]])
    from gcbench.fits.command import fit_job
    from gcbench.grid import parse_options
    from gcbench.report.fit_tables import fit_table, recommendation_lines

    with domain_errors(lambda: f"interrupted; the finished trials are in {out}"):
        values, _ = parse_options(spec_values, fields=FIT_FIELDS)
        job, fields = fit_job(values, vary, range_, multiple_of, memory, headroom, out, timeout, isolation,
                              not no_paired, err_console)
        field_name = job.spec.vary
        fits, rec = job.run()
    title = f"{fields['model']} · largest {vary} per policy · " + (
        f"seq {fields['seq_len']}" if field_name == "batch_size" else f"batch {fields['batch_size']}")
    console.print(fit_table(fits, field_name, job.cap, markup(title)))
    for line in map(plain, recommendation_lines(rec, field_name, fits)):  # the command whole, to paste; the rest
        command = line.lstrip().startswith("gcbench ")                      # wrapped, its later lines indented
        console.print(line if command else textwrap.fill(line, console.width, subsequent_indent="    "),
                      markup=False, highlight=False, soft_wrap=True)
    console.print(f"[dim]records in {markup(out)} (fit {job.fit_id})[/]")
    if any(f.error for f in fits):
        raise typer.Exit(1)


@app.command()
@with_spec_options(several=ESTIMATE_AXES, fields=ESTIMATE_FIELDS, shown=ESTIMATE_SHOWN)
def estimate(
    spec_values: dict[str, Any],
    method: Annotated[str, typer.Option(help="analytic (per-block formulas, instant) | simulate (the real step "
                                             "on fake tensors, seconds); comma-separated; with --fit: the one used "
                                             "(both: analytic where it knows the policy)")] = "analytic,simulate",
    device: Annotated[str, typer.Option(help="what to predict for: cuda (the peak the CUDA allocator reports, "
                                             "max_memory_allocated; no GPU needed) | cpu (the live-tensor peak of a "
                                             "CPU run)")] = "cuda",
    gpu_memory: Annotated[str | None, typer.Option(help="memory to fit in, e.g. 80GiB: adds a fits / does not fit "
                                                        "column")] = None,
    output_format: Annotated[str, typer.Option("--format", help="table | json (one JSON object per config and "
                                                                "method, one per line)")] = "table",
    fit_: Annotated[bool, typer.Option("--fit", help="per policy, the largest batch (--vary) predicted to fit "
                                                     "--gpu or --gpu-memory, and its predicted step time")] = False,
    gpu: Annotated[str | None, typer.Option(help="a GPU by name (h100-80gb, a100-40gb, rtx4090-24gb, ...; h200 "
                                                 "where it names one card; docs/fit.md): the memory to fit in (less "
                                                 "its context)",
                                            metavar="<name>")] = None,
    vary: Annotated[str, typer.Option(help="with --fit: batch | seq")] = "batch",
    headroom: Annotated[str, typer.Option(help="with --fit: part of the memory kept free, e.g. 5%",
                                          metavar="<percent>")] = "0%",
    levers: LeversOption = None,
) -> None:
    """Predict the peak memory of a training step without running it (no GPU needed): params, grads, optimizer
    state and activations per config, by formulas and by a fake-tensor simulation."""
    from gcbench.estimators import estimate_grid, estimate_rows
    from gcbench.grid import parse_options
    from gcbench.report.estimate_table import estimate_table
    from gcbench.units import parse_bytes

    with domain_errors():
        if output_format not in ("table", "json"):
            raise GcbenchError(f"unknown --format {output_format!r} (table, json)")
        memory = parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
        gpu = gpu_entry(gpu).name if gpu is not None else None  # h200 -> h200-141gb, the name every output shows
        grid, _ = parse_options(spec_values, fields=ESTIMATE_FIELDS)
        if "model" not in grid:
            raise GcbenchError("no --model given: which model to estimate (see `gcbench models`)")
        methods = option_items("--method", method)
        if not methods or len(set(methods)) < len(methods):
            raise GcbenchError(f"--method {method!r}: give each of analytic, simulate at most once, comma-separated")
        if levers is not None:  # a plan across levers (fits/lever_command.py), with --fit only
            from gcbench.fits.lever_command import estimate_levers
            refuse_unused("with --levers: a plan searches the micro-batch at --seq", {"--vary": vary != "batch"})
            return estimate_levers({"seq_len": (ESTIMATE_SIZES["seq_len"],), **grid}, levers, memory, gpu, headroom,
                                   device, console, PredictionBar(err_console, "predicting"), fit_, output_format)
        if fit_:
            return _estimate_fit(grid, memory, gpu, vary, headroom, device, output_format, methods)
        refuse_unused("without --fit", {"--vary": vary != "batch", "--headroom": headroom != "0%"})
        grid = {**{name: (value,) for name, value in ESTIMATE_SIZES.items()}, **grid}
        memory = memory_to_fit(gpu, memory)  # --gpu NAME: a fits column against what that card leaves usable
        one = one_value_each({k: v for k, v in grid.items() if k not in ESTIMATE_AXES}, "")
        with PredictionBar(err_console, "estimating") as bar:  # a card named: its workspaces in reserved
            # without a card no step time is shown: the simulations keep no work for it (a tenth of their time)
            results = estimate_grid({k: v for k, v in grid.items() if k in ESTIMATE_AXES}, methods, device, bar,
                                    memory, card=gpu_entry(gpu) if gpu else None, timed=gpu is not None, **one)
    rows = estimate_rows(results, memory, gpu, device)
    _print_rows(rows, output_format, lambda: estimate_table(rows, memory, console.width, gpu), piped_width=140)


def _estimate_fit(grid: dict[str, tuple], memory: int | None, gpu_name: str | None, vary: str, headroom: str,
                  device: str, output_format: str, methods: list[str]) -> None:
    """`gcbench estimate --fit`: per policy, the largest size predicted to fit a GPU, and its predicted step time."""
    from gcbench.fits.command import command_apart, predicted_fits
    from gcbench.report.fit_tables import predicted_fit_table

    with PredictionBar(err_console, "predicting") as bar:
        rows, field_name, title, caption = predicted_fits(grid, memory, gpu_name, vary, headroom, device,
                                                          bar, methods)
    caption, command = command_apart(caption)
    _print_rows(rows, output_format, lambda: predicted_fit_table(rows, field_name, title, caption), piped_width=100)
    if command is not None and output_format == "table":
        console.print(command, highlight=False, soft_wrap=True)  # one line, never wrapped: pasted, it runs


app.command(name="validate")(validate_command.validate)  # its options and work: validate/command.py (no torch)
one_line_summaries(app)


def _print_rows(rows: list[dict], output_format: str, table: Callable[[], Any], piped_width: int) -> None:
    """--format json: one object per line; else the table (piped: `piped_width` columns, not rich's squeezing 80)."""
    if output_format == "json":
        for row in rows:
            typer.echo(json.dumps(row))
    else:
        (console if console.is_terminal else Console(width=piped_width)).print(table())


def main() -> None:
    """The CLI's entry (gcbench/__main__.py calls it, after making SIGTERM a KeyboardInterrupt): usage errors too
    become one line on stderr with exit code 2, an interruption before a command began exit code 130."""
    try:
        # Without standalone mode, click *returns* the code of a typer.Exit raised in a command (exit 1 on an OOM,
        # 2 on a domain error, 1 on a compare regression) instead of raising it: pass it on, or CI sees success.
        code = app(args=with_bare_switches(sys.argv[1:]), standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):  # before a command began: nothing was written
        typer.echo("gcbench: interrupted", err=True)
        sys.exit(130)
    except typer.TyperException as e:  # click's usage errors, vendored by typer
        typer.echo(f"gcbench: error: {e.format_message()}", err=True)
        sys.exit(2)
