"""The `gcbench` command: thin Typer commands that build a spec and call one library function.

Every domain error (GcbenchError) and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gcbench.errors import GcbenchError

app = typer.Typer(
    help="Benchmark the memory/compute trade-off of activation checkpointing on transformers models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

DEFAULT_OUT = Path("results/runs.jsonl")


@contextmanager
def domain_errors() -> Iterator[None]:
    """GcbenchError -> one line on stderr, exit code 2."""
    try:
        yield
    except GcbenchError as e:
        typer.echo(f"gcbench: error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    model: Annotated[str, typer.Option(help="preset name (see `gcbench models`) or path to a config.json")] = "gpt2",
    seq: Annotated[int, typer.Option(help="sequence length in tokens")] = 512,
    batch: Annotated[int, typer.Option(help="samples per step")] = 1,
    policy: Annotated[str, typer.Option(help="checkpoint policy: name or name:key=value (see `gcbench policies`)")]
    = "none",
    layers: Annotated[int | None, typer.Option(help="keep only the first N blocks (default: all)")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32 | bf16 | amp-bf16 (default: bf16 on CUDA, fp32 on CPU)")]
    = None,
    optimizer: Annotated[str, typer.Option(help="adamw | sgd (momentum) | none")] = "adamw",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N]")] = "auto",
    attn: Annotated[str | None, typer.Option(help="attention implementation: eager | sdpa (default sdpa)")] = None,
    warmup: Annotated[int, typer.Option(help="untimed warm-up steps")] = 3,
    steps: Annotated[int, typer.Option(help="timed steps (median reported)")] = 10,
    seed: Annotated[int, typer.Option(help="seed for weights, batch and dropout")] = 0,
    memory_cap: Annotated[str | None, typer.Option(help="memory limit, e.g. 2GiB (CPU: tracked bytes; CUDA: "
                                                        "per-process fraction)")] = None,
    out: Annotated[Path, typer.Option(help="JSON Lines file the record is appended to")] = DEFAULT_OUT,
) -> None:
    """Measure real training steps of one model under one checkpoint policy."""
    from gcbench.report import run_table
    from gcbench.results import append_record, ensure_writable
    from gcbench.spec import RunSpec, parse_bytes
    from gcbench.worker import run as run_spec

    with domain_errors():
        spec = RunSpec(model=model, seq_len=seq, batch_size=batch, policy=policy, layers=layers,
                       precision=precision or "", optimizer=optimizer, device=device, attn=attn,
                       warmup_steps=warmup, measure_steps=steps, seed=seed,
                       memory_cap_bytes=parse_bytes(memory_cap) if memory_cap else None)
        ensure_writable(out)
        with _step_progress(spec.warmup_steps + spec.measure_steps + 4) as advance:
            record = run_spec(spec, progress=advance)
        append_record(out, record)
    console.print(run_table(record))
    console.print(f"[dim]record appended to {out}[/]")
    if record["status"] != "ok":
        raise typer.Exit(1)


@contextmanager
def _step_progress(total: int):
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("starting", total=total)

        def advance(description: str) -> None:
            bar.update(task, description=description, advance=1)

        yield advance


@app.command()
def models() -> None:
    """List the model presets."""
    from gcbench.models import MODELS, describe

    table = Table(title="model presets (random weights, built from transformers configs)")
    for col in ("name", "family", "params", "layers", "hidden", "heads", "attention", "summary"):
        table.add_column(col, justify="right" if col in ("params", "layers", "hidden", "heads") else "left")
    for name in MODELS:
        row = describe(name)
        row["params"] = f"{row['params'] / 1e6:,.1f} M"
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)


@app.command()
def policies() -> None:
    """List the checkpoint policies, their options and what they do."""
    from gcbench.policies import POLICIES

    table = Table(title="checkpoint policies (N = number of blocks)")
    table.add_column("name")
    table.add_column("options")
    table.add_column("meaning")
    for name, cls in POLICIES.items():
        opts = ", ".join(f"{f.name}={f.default} ({f.metadata.get('help', '')})" for f in dataclasses.fields(cls))
        table.add_row(name, opts or "-", cls.summary)
    console.print(table)


def main() -> None:
    """Console entry point: usage errors too become one line on stderr with exit code 2."""
    try:
        app(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        typer.echo("gcbench: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        typer.echo(f"gcbench: error: {e.format_message()}", err=True)
        sys.exit(2)
