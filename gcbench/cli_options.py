"""How the command line is made from the RunSpec declarations (one option per field, spec.py) and how a command's
domain errors reach the shell (one line on stderr, exit code 2)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, RUN_FIELDS
from gcbench.text import plain

ALL = "all"


@contextmanager
def domain_errors(interrupted: Callable[[], str] = lambda: "interrupted") -> Iterator[None]:
    """GcbenchError -> one line on stderr, exit code 2. Ctrl-C or SIGTERM -> the line `interrupted()` gives (what
    was kept, what to do next), exit code 130."""
    try:
        yield
    except GcbenchError as e:
        # plain: the message quotes paths, names and values from files; one line, no escape sequences
        typer.echo(f"gcbench: error: {plain(e)}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"gcbench: {plain(interrupted())}", err=True)
        raise typer.Exit(130) from None


def print_warnings(notes: list[str]) -> None:
    """Each note as one `gcbench: warning:` line on stderr, plain: notes quote file names and lines."""
    for note in notes:
        typer.echo(f"gcbench: warning: {plain(note)}", err=True)


def warm_children(models: list[str]) -> None:
    """Start the fork server children are forked from now, warming up `models` (launch/server.py): its start-up
    (torch, transformers, the models' code) then overlaps the command's own instead of following it."""
    from gcbench.launch.server import start

    start(models)


def prepare_sweep(grid: Any, dry_run: bool) -> None:
    """What a sweep (grid.SweepSpec) about to run in children starts first: their fork server, warming up its
    models, so that its start-up overlaps the sweep's own."""
    if grid.executor is None and grid.isolation == "process" and not dry_run:
        warm_children(list(grid.values["model"]))


def check_jobs(grid: Any, dry_run: bool) -> None:
    """A sweep to run as jobs, its grid checked: one line now, before anything is written or submitted, when its
    executor cannot submit from here (launch/slurm.py)."""
    if grid.executor is not None and not dry_run:
        from gcbench.launch.slurm import check_executor

        check_executor(grid.executor)


FIT_FIELDS = tuple(n for n in BY_NAME if n != "memory_cap_bytes")  # `gcbench fit`'s: --memory is its budget
_SWITCHES: dict[str, dict[str, str]] = {}  # command -> {its run fields' switch flags: their flag value}


def with_spec_options(*, several: tuple[str, ...] | str = (), fields: tuple[str, ...] | None = None,
                 defaults: dict[str, Any] | None = None,
                 shown: dict[str, str] | None = None) -> Callable[[Callable], Callable]:
    """Give a command one option per run field (fields.py declares them: flag, help, metavar), before its own.

    The command receives `spec_values`: {flag: value as typed} for the options given or with a default here
    (`defaults`, by field name; the others keep RunSpec's). `several`: the fields that take comma-separated values
    here (ALL: every one); `fields`: which RunSpec fields the command has (None: all); `shown`: what the help says
    in parentheses of a field whose default the command itself applies (a sweep's default policies) or that it
    requires, instead of RunSpec's default.
    """
    options = {f.name: f for f in RUN_FIELDS if fields is None or f.name in fields}
    defaults = defaults or {}

    def add_options(command: Callable) -> Callable:
        _SWITCHES[command.__name__.replace("_", "-")] = {f"--{f.flag}": f.flag_value for f in options.values()
                                                         if f.flag_value}
        hints = {k: v for k, v in get_type_hints(command, include_extras=True).items() if k != "spec_values"}
        # typer reads Annotated[..., typer.Option] from the signature: give it the evaluated hints
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
               for p in inspect.signature(command).parameters.values() if p.name != "spec_values"]
        added = []
        for name, opt in options.items():
            many = several == ALL or name in several
            help = opt.help + ("; comma-separated for several" if many and several != ALL else "")
            if name in (shown or {}):
                help += f" ({shown[name]})"
            elif name not in defaults and opt.default not in (None, "", dataclasses.MISSING):
                help += f" (default: {opt.kind.show(opt.default)})"  # applied by RunSpec, so that a TOML file can set it
            # a list of name[:k=v,...] items shows an item's options as k=v: at 80 columns a wide metavar column
            # leaves the option names too little (--slurm-array-parallelism was cut short)
            item = opt.kind.metavar.lower()
            metavar = f"<{item.replace(',...', '')},...>" if many else f"<{item}>"
            hint = Annotated[str | None, typer.Option(f"--{opt.flag}", help=help, metavar=metavar)]
            default = str(defaults[name]) if name in defaults else None
            added.append(inspect.Parameter(f"spec__{name}", inspect.Parameter.KEYWORD_ONLY, default=default,
                                           annotation=hint))
            hints[f"spec__{name}"] = hint

        @functools.wraps(command)
        def with_options(**kwargs: Any) -> Any:
            given = {options[name].flag: kwargs.pop(f"spec__{name}") for name in options}
            return command(spec_values={flag: v for flag, v in given.items() if v is not None}, **kwargs)

        with_options.__signature__ = inspect.Signature([*added, *own])  # type: ignore[attr-defined]
        with_options.__annotations__ = hints
        return with_options

    return add_options


@contextmanager
def step_progress(err_console: Console, total: int | None):
    """A step counter on stderr for `gcbench run`; yields advance(description)."""
    columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), TimeElapsedColumn())
    # Not on a pipe or a log file: a bar there is noise, and its last refresh leaves an empty line.
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task("starting", total=total)

        def advance(description: str) -> None:
            bar.update(task, description=plain(description), advance=1)

        yield advance


def with_bare_switches(args: list[str]) -> list[str]:
    """A switch option of the command's run fields given alone (`--optim-in-backward`, last or before another
    option) gets its flag value (`on`); with a value (`--optim-in-backward off`, `on,off` in a sweep) it keeps it.
    For the command line's arguments before click parses them: click 8 could do this (flag_value on a value
    option), typer does not pass flag_value on. Another command's own flag of the same name is left alone
    (`validate --predict`); options without a command before them (a sweep's, spliced in) take every run field's."""
    switches = {f"--{f.flag}": f.flag_value for f in RUN_FIELDS if f.flag_value}
    if args and not args[0].startswith("-"):
        switches = _SWITCHES.get(args[0], {})
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in switches and (following is None or following.startswith("-")):
            out.append(switches[arg])
    return out


# How `gcbench run` shows its record: a display option, not a run field (it changes nothing measured or stored).
RunFormatOption = Annotated[str, typer.Option("--format", help="table | json (the record alone on stdout, one JSON "
                                                               "object as --out stores it; the rest on stderr)")]


def check_format(output_format: str) -> None:
    """--format is table or json: checked before anything runs."""
    if output_format not in ("table", "json"):
        raise GcbenchError(f"unknown --format {output_format!r} (table, json)")


# How a sweep spreads its configs (docs/scale.md): declared here, beside the spec's options, to keep cli.py short.
DevicesOption = Annotated[str | None, typer.Option(help="run one config per GPU at a time: all, or cuda:0,cuda:1,... "
                                                       "(each child sees only its GPU)", metavar="<gpus>")]
JobsOption = Annotated[int | None, typer.Option(help="CPU configs side by side, each on its own cores (memory exact; "
                                                     "step times not comparable with a sequential sweep's)")]
ExecutorOption = Annotated[str | None, typer.Option(help="run each configuration as a job through submitit: slurm | "
                                                        "local (submitit's local executor, a trial of the same path); "
                                                        "needs gcbench\\[slurm]")]
SlurmPartitionOption = Annotated[str | None, typer.Option(help="with --executor slurm: the partition")]
SlurmGpusOption = Annotated[int | None, typer.Option(help="with --executor slurm: GPUs per job (default 1)")]
SlurmParallelismOption = Annotated[int | None, typer.Option(help="with --executor slurm: the most jobs running at "
                                                                 "once")]


class PredictionBar:
    """A bar on stderr for `gcbench estimate` (an estimators Progress, told from any thread): predictions done of
    all, elapsed and remaining time. Started by the first call, not on entry: the estimators fork their workers
    first (estimators/sharing.py), and a fork must not copy a running refresh thread. Not on a pipe or a log file."""

    def __init__(self, err_console: Console, what: str):
        self.console, self.what = err_console, what
        self._bar: Progress | None = None  # made by the first call: the bar, then what is predicted now under it
        self._line: Progress | None = None
        self._live: Live | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> PredictionBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def __call__(self, done: int, total: int, what: str) -> None:
        from gcbench.sweeps.progress import bar_with_lines

        with self._lock:
            if self._bar is None or self._line is None:
                self._bar, self._line, self._live = bar_with_lines(self.console, self.console.is_terminal)
                if self._live is not None:
                    self._live.start()
                self._bar.add_task("", total=total)
                self._line.add_task("")
            self._bar.update(self._bar.task_ids[0], completed=done, total=total)
            self._line.update(self._line.task_ids[0], description=plain(f"{self.what} {what}"))


# A plan across levers (fits/levers.py, docs/levers.md): an option of `fit` and of `estimate --fit`.
LeversOption = Annotated[str | None, typer.Option(help="plan across levers: auto (policy, adapter, optimizer, its "
                                                      "step, loss, accumulation to --batch) or some of those, "
                                                      "precision and compile, comma-separated: the configs "
                                                      "predicted to fit, ranked by predicted tokens/s",
                                                      metavar="<auto|levers>")]


def print_version(value: bool) -> None:
    """--version: gcbench's, torch's and transformers' versions, then exit."""
    if not value:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from gcbench import __version__

    def installed(name: str) -> str:  # read from the package metadata: importing torch would take seconds
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    typer.echo(f"gcbench {__version__} (torch {installed('torch')}, transformers {installed('transformers')}, "
               f"python {platform.python_version()})")
    raise typer.Exit(0)


def refuse_unused(why: str, options: dict[str, bool]) -> None:
    """One line naming the options given (`options`: flag -> whether it was given) that `why` leaves unused: an
    option silently ignored is an answer to another question."""
    given = [flag for flag, was_given in options.items() if was_given]
    if given:
        raise GcbenchError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply {why}")


def one_line_summaries(app: typer.Typer) -> None:
    """Each command's line in `gcbench --help`: its docstring's first paragraph on one line (typer keeps a
    docstring's line breaks there, and at 80 columns a line ended mid-sentence: "--out adds figures" / "and a
    report to share.")."""
    for command in app.registered_commands:
        first = (inspect.getdoc(command.callback) or "").split("\n\n")[0]
        command.short_help = command.short_help or " ".join(first.split())
