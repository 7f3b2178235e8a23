"""Sweeps: a grid of RunSpecs (models x seq x batch x policies), each config run in a fresh child process with a
timeout, one Record appended per config as it finishes, resumable, and an OOM recorded as a result.

    grid = SweepSpec.load("sweeps/smoke.toml", {"steps": 2})   # or SweepSpec.load(None, {"model": ..., ...})
    records = Sweep(grid).run()                                 # or gcbench.sweep("sweeps/smoke.toml")

Statuses: ok | oom | timeout | error (with the last lines of the child's stderr) | skipped (a config that needs
at least as much memory as one that already ran out, with the reason). See docs/sweep.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich import box
from rich.table import Table

from gcbench.errors import GcbenchError
from gcbench.policies import parse_policy
from gcbench.units import fmt_bytes
from gcbench.results.schema import STATUSES, config_key, config_label, new_record, peak_bytes, policy_label
from gcbench.results.store import append_record, drop_truncated_last_line, ensure_writable, read_records
from gcbench.spec import RunSpec, parse_bytes

DEFAULT_OUT = Path("results/sweep.jsonl")
DEFAULT_TIMEOUT_S = 600.0  # per config; generous: a 7B model at seq 8192 takes minutes to build, warm up and time
DEFAULT_POLICIES = ("none", "full", "every-k:k=2", "sqrtn")
ISOLATIONS = ("process", "none")
STDERR_TAIL_LINES = 30  # of a failed child's stderr, kept in its record
_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}

OnPhase = Callable[[str], None]


# --------------------------------------------------------------------------------------------------- the grid

@dataclass(frozen=True)
class SweepSpec:
    """A grid: every combination of models x seq_lens x batch_sizes x policies, sharing the other RunSpec
    options; and how to run it (output file, per-config timeout, isolation)."""

    models: tuple[str, ...]  # preset names or config.json paths
    seq_lens: tuple[int, ...]  # tokens per sample, ascending: small configs first, so an OOM can skip larger ones
    batch_sizes: tuple[int, ...]  # samples per step, ascending for the same reason
    policies: tuple[str, ...] = DEFAULT_POLICIES  # canonical policy strings ("every-k:k=2")
    layers: int | None = _RUN_DEFAULTS["layers"]  # keep only the first N blocks of every model
    precision: str = _RUN_DEFAULTS["precision"]
    optimizer: str = _RUN_DEFAULTS["optimizer"]
    device: str = _RUN_DEFAULTS["device"]
    attn: str | None = _RUN_DEFAULTS["attn"]
    warmup_steps: int = _RUN_DEFAULTS["warmup_steps"]
    measure_steps: int = _RUN_DEFAULTS["measure_steps"]
    seed: int = _RUN_DEFAULTS["seed"]
    memory_cap_bytes: int | None = _RUN_DEFAULTS["memory_cap_bytes"]
    out: Path = DEFAULT_OUT  # JSON Lines file; records are appended (only a half-written last line is ever cut)
    timeout_s: float = DEFAULT_TIMEOUT_S  # wall-clock limit per config, child start included
    isolation: str = "process"  # process: fresh child per config | none: in this process (faster start, less safe)

    @classmethod
    def load(cls, config: str | Path | None = None, options: Mapping[str, Any] | None = None,
             where: str | None = None) -> SweepSpec:
        """The grid from a TOML file and/or options (CLI names: model, seq, batch, policy, ..., memory-cap);
        options override the file. `where` names the options in errors (None: command-line flags)."""
        fields: dict[str, Any] = {}
        if config is not None:
            path = Path(config)
            fields.update(parse_options(_read_toml(path), where=str(path)))
        fields.update(parse_options(options or {}, where=where))
        for axis, flag in (("models", "model"), ("seq_lens", "seq"), ("batch_sizes", "batch")):
            if axis not in fields:
                raise GcbenchError(f"no --{flag} given: a sweep needs at least one value of each of "
                                   "--model, --seq and --batch (or a --config file that sets them)")
        return cls(**fields)

    def expand(self) -> list[RunSpec]:
        """Every config as a validated RunSpec, in run order: model, seq, batch, then policy innermost (the
        policies of one shape run together, and a shape's OOM is known before the next larger shape runs)."""
        specs = []
        for model, seq, batch, policy in itertools.product(self.models, self.seq_lens, self.batch_sizes,
                                                           self.policies):
            try:
                specs.append(RunSpec(
                    model=model, seq_len=seq, batch_size=batch, policy=policy, layers=self.layers,
                    precision=self.precision, optimizer=self.optimizer, device=self.device, attn=self.attn,
                    warmup_steps=self.warmup_steps, measure_steps=self.measure_steps, seed=self.seed,
                    memory_cap_bytes=self.memory_cap_bytes))
            except GcbenchError as e:
                raise GcbenchError(f"{e} (config: {model}, seq {seq}, batch {batch}, {policy})") from None
        return specs

    def shared_options(self) -> str:
        """The options every config shares, as one line for tables."""
        cap = fmt_bytes(self.memory_cap_bytes) if self.memory_cap_bytes else "none"
        return (f"layers {self.layers or 'all'} · precision {self.precision or 'auto'} · {self.optimizer} · "
                f"device {self.device} · warm-up {self.warmup_steps} + {self.measure_steps} timed steps · "
                f"memory cap {cap} · timeout {self.timeout_s:g} s · isolation {self.isolation}")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise GcbenchError(f"cannot read sweep config {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise GcbenchError(f"{path}: malformed TOML: {e}") from None


def parse_options(options: Mapping[str, Any], where: str | None = None) -> dict[str, Any]:
    """Sweep options by their CLI names ('memory-cap' or 'memory_cap') -> SweepSpec fields. Values are what a
    TOML file or a Python caller gives (lists, ints) or what the command line gives (comma lists: "512,1024")."""
    fields: dict[str, Any] = {}
    for raw_key, value in options.items():
        key = str(raw_key).replace("_", "-")
        label = f"--{key}" if where is None else f"{where}: {key}"
        if key not in _OPTIONS:
            raise GcbenchError(f"{where + ': ' if where else ''}unknown option {raw_key!r} "
                               f"(known: {', '.join(_OPTIONS)})")
        field_name, parse = _OPTIONS[key]
        try:
            fields[field_name] = parse(value)
        except GcbenchError as e:
            raise GcbenchError(f"{label}: {e}") from None
    return fields


def _items(value: Any) -> list[Any]:
    """A list as given, or a comma-separated string split, or one scalar as a list of one."""
    if isinstance(value, str):
        items: list[Any] = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if not items:
        raise GcbenchError("no values: the grid would be empty")
    return items


def _unique(values: list[Any], shown: Callable[[Any], str] = str) -> tuple[Any, ...]:
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise GcbenchError(f"duplicate value {shown(v)} (each config would run twice)")
        seen.add(v)
    return tuple(values)


def _int(value: Any) -> int:
    # bool is an int in Python; `seq = true` in TOML is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise GcbenchError(f"{value!r} is not a non-negative integer")
    return int(value)


def _names(value: Any) -> tuple[str, ...]:
    items = _items(value)
    if not all(isinstance(v, str) and v for v in items):
        raise GcbenchError(f"expected names, got {value!r}")
    return _unique(items)


def _sizes(value: Any) -> tuple[int, ...]:
    return tuple(sorted(_unique([_int(v) for v in _items(value)])))


def _policies(value: Any) -> tuple[str, ...]:
    # A comma list ("none,every-k:k=2") is split into policies; a piece with '=' but no ':' is one more option of
    # the policy before it ("foo:a=1,b=2"). A TOML list item is always one whole policy.
    if isinstance(value, str):
        texts: list[str] = []
        for piece in _items(value):
            if texts and "=" in piece and ":" not in piece:
                texts[-1] += "," + piece
            else:
                texts.append(piece)
    else:
        texts = _items(value)
    if not all(isinstance(t, str) for t in texts):
        raise GcbenchError(f"expected policy strings, got {value!r}")
    policies = _unique([parse_policy(t) for t in texts])
    return tuple(str(p) for p in policies)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise GcbenchError(f"expected a string, got {value!r}")
    return value


def _bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        return parse_bytes(value)
    raise GcbenchError(f"expected a size such as 2GiB, got {value!r}")


def _seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise GcbenchError(f"expected seconds, got {value!r}") from None
    if isinstance(value, bool) or not seconds > 0:
        raise GcbenchError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _isolation(value: Any) -> str:
    if value not in ISOLATIONS:
        raise GcbenchError(f"unknown isolation {value!r} ({', '.join(ISOLATIONS)})")
    return value


def _path(value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise GcbenchError(f"expected a file path, got {value!r}")
    return Path(value)


# CLI / TOML name -> (SweepSpec field, parser). The keys are also the only keys a sweep TOML file may hold.
_OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model": ("models", _names),
    "seq": ("seq_lens", _sizes),
    "batch": ("batch_sizes", _sizes),
    "policy": ("policies", _policies),
    "layers": ("layers", _int),
    "precision": ("precision", _text),
    "optimizer": ("optimizer", _text),
    "device": ("device", _text),
    "attn": ("attn", _text),
    "warmup": ("warmup_steps", _int),
    "steps": ("measure_steps", _int),
    "seed": ("seed", _int),
    "memory-cap": ("memory_cap_bytes", _bytes),
    "out": ("out", _path),
    "timeout": ("timeout_s", _seconds),
    "isolation": ("isolation", _isolation),
}


# --------------------------------------------------------------------------------------------------- records

def failure_record(spec: RunSpec, status: str, error: str, env: dict | None = None, **extra: Any) -> dict[str, Any]:
    """A record for a config that produced no measurement (skipped, timeout, error)."""
    return new_record(spec.as_record(), status, error, **extra, env=env)


class OomFrontier:
    """The skip rule. Once a config runs out of memory, any config with the same model, policy and other options
    whose seq_len and batch_size are both at least as large needs at least as much memory: it is skipped."""

    def __init__(self) -> None:
        self._ooms: dict[str, list[tuple[int, int]]] = {}

    @staticmethod
    def _shape_free_key(record: Mapping[str, Any]) -> str:
        return config_key(record, ignore=("seq_len", "batch_size"))

    def add(self, record: Mapping[str, Any]) -> None:
        if record.get("status") == "oom":
            self._ooms.setdefault(self._shape_free_key(record), []).append(
                (record["seq_len"], record["batch_size"]))

    def skip_reason(self, spec: RunSpec) -> str | None:
        for seq, batch in self._ooms.get(self._shape_free_key(spec.as_record()), []):
            if spec.seq_len >= seq and spec.batch_size >= batch:
                return f"seq {seq} batch {batch} ran out of memory with the same model and policy (--no-skip runs it)"
        return None


# --------------------------------------------------------------------------------------------------- runners

class ProcessRunner:
    """Each config in a fresh child process, forked from a fork server that imported torch, transformers and
    gcbench once: a child starts in tens of milliseconds, yet owns its CUDA context and allocator, so an OOM, a
    sticky CUDA error or a segfault cannot touch the next config. `timeout_s` is enforced by killing the child."""

    def __init__(self, timeout_s: float):
        from gcbench.sweeps.child import run_child  # here, not at import: importing it warms up (git sha, model code)

        self.timeout_s = timeout_s
        self._target = run_child
        self._ctx = _child_context()

    def __call__(self, spec: RunSpec, on_phase: OnPhase) -> dict[str, Any]:
        fd, log_path = tempfile.mkstemp(prefix="gcbench-child-", suffix=".log")
        os.close(fd)
        results, results_w = self._ctx.Pipe(duplex=False)
        lifeline_r, lifeline = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=self._target, args=(spec.as_record(), results_w, lifeline_r, log_path),
                                 name=f"gcbench {config_label(spec.as_record())}", daemon=True)
        finished = started = False
        try:
            with _signals_deferred(), _main_module_hidden():
                proc.start()
                started = True
            # The child holds these now; our copies would keep the pipes open after it died.
            results_w.close()
            lifeline_r.close()
            record, finished = self._wait(spec, proc, results, on_phase, log_path)
            return record
        finally:
            if started:
                _stop(proc, grace_s=10.0 if finished else 0.0)
            for conn in (results, results_w, lifeline, lifeline_r):
                conn.close()
            os.unlink(log_path)

    def _wait(self, spec: RunSpec, proc, results, on_phase: OnPhase, log_path: str) -> tuple[dict, bool]:
        deadline = time.monotonic() + self.timeout_s
        env, phase = None, "starting"
        while (left := deadline - time.monotonic()) > 0:
            if not results.poll(min(left, 0.25)):
                if proc.is_alive() or results.poll():
                    continue
                msg = None  # died without closing the pipe cleanly
            else:
                try:
                    msg = results.recv()
                except EOFError:
                    msg = None
            if msg is None:
                proc.join(5)
                tail = _tail(log_path)
                return failure_record(spec, "error", _death_message(proc.exitcode, tail), env,
                                      stderr_tail=tail), False
            kind, payload = msg
            if kind == "record":
                on_phase("child exiting")  # the next config waits for it: its memory must be released first
                return payload, True
            if kind == "env":
                env = payload
            elif kind == "progress":
                phase = payload
                on_phase(payload)
        return failure_record(spec, "timeout", f"no result within {self.timeout_s:g} s (was: {phase})", env,
                              stderr_tail=_tail(log_path)), False


class InProcessRunner:
    """--isolation none: every config in this process. Starts faster, but less safe: no timeout, a crash or a
    sticky CUDA error ends the whole sweep, and what one config leaves in the CUDA caching allocator or in host
    memory can shift the next one's numbers. For quick CPU checks."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = None  # cannot be enforced without a process to kill

    def __call__(self, spec: RunSpec, on_phase: OnPhase) -> dict[str, Any]:
        from gcbench.runner import run

        try:
            return run(spec, on_phase)
        except GcbenchError as e:
            return failure_record(spec, "error", str(e))
        except Exception as e:  # failure is data: the sweep goes on
            tail = "\n".join(traceback.format_exc().splitlines()[-STDERR_TAIL_LINES:])
            return failure_record(spec, "error", f"{type(e).__name__}: {e}"[:500], stderr_tail=tail)


def _child_context():
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")  # no fork server (Windows): slower starts, same isolation
    # torch.cuda.is_available() in the fork server (transformers calls it) would initialise the CUDA driver there,
    # and a process forked after that cannot use CUDA. NVML answers the same question without touching CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gcbench.sweeps.child"])
    return ctx


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a child starts and deliver them right after: interrupted mid-start, the sweep
    would not yet know the child's pid and could not stop it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in caught[:1]:
            signal.raise_signal(sig)  # to the restored handler: KeyboardInterrupt in a sweep


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a child without the caller's __main__. The child runs gcbench.sweeps.child.run_child and needs nothing from
    the calling script, but multiprocessing would re-run that script in every child (its unguarded top level
    included: a notebook-style script calling gcbench.sweep() would recurse) and cannot at all for `python -`."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to re-import
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _stop(proc, grace_s: float) -> None:
    """Wait `grace_s` for a child to exit by itself, then SIGTERM, then SIGKILL; always reaped before returning,
    so the next config starts on a device this one has released."""
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    proc.close()


def _tail(path: str, lines: int = STDERR_TAIL_LINES) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _death_message(exitcode: int | None, tail: str) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        how = f"child killed by {name}" + (" (the kernel's OOM killer?)" if name == "SIGKILL" else "")
    else:
        how = f"child exited with code {exitcode} without a result"
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    return f"{how}: {last}"[:500] if last else how


# --------------------------------------------------------------------------------------------------- the sweep

@dataclass(frozen=True)
class PlannedConfig:
    spec: RunSpec
    done: dict[str, Any] | None  # its record already in the output file (resume), or None: to run


class Sweep:
    """Runs a grid: resume from the output file, skip after OOMs, one record appended per config as it ends.

    Everything is validated when the Sweep is made (every RunSpec, the output file's schema), before anything
    runs or is written. Ctrl-C and SIGTERM stop the running child and raise KeyboardInterrupt after it: the
    records written so far stay, and running the same sweep again resumes.
    """

    def __init__(self, grid: SweepSpec, *, rerun: bool = False, skip_after_oom: bool = True,
                 console: Console | None = None):
        self.grid = grid
        self.rerun = rerun  # run every config again, even those with a record in the output file
        self.skip_after_oom = skip_after_oom
        self.console = console  # progress and warnings go here (stderr); None: quiet, warnings via `warnings`
        self.sweep_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        self.specs = grid.expand()
        self._existing, notes = _existing_records(grid.out)
        for note in notes:
            self._warn(note)

    def plan(self) -> list[PlannedConfig]:
        """Each config with its resumable record from the output file (newest wins), or None if it must run."""
        done = {} if self.rerun else {config_key(r): r for r in self._existing if self._counts_as_done(r)}
        return [PlannedConfig(spec, done.get(config_key(spec.as_record()))) for spec in self.specs]

    def _counts_as_done(self, record: dict[str, Any]) -> bool:
        status = record.get("status")
        if status == "skipped":
            return self.skip_after_oom  # --no-skip runs what an earlier sweep skipped
        return status in STATUSES

    def run(self) -> list[dict[str, Any]]:
        """Run what the plan says must run; return the grid's records in grid order (resumed ones included)."""
        out = self.grid.out
        ensure_writable(out)
        dropped = drop_truncated_last_line(out)
        if dropped is not None:
            self._warn(f"{out}: removed a truncated last line left by an interrupted run ({dropped[:60]!r}...)")
        plan = self.plan()
        runner = (ProcessRunner if self.grid.isolation == "process" else InProcessRunner)(self.grid.timeout_s)
        frontier = OomFrontier()
        envs: dict[str, dict] = {}
        records: list[dict[str, Any]] = []
        to_run = sum(p.done is None for p in plan)
        with _sigterm_raises_interrupt(), SweepProgress(self.console, to_run, len(plan) - to_run) as view:
            for config in plan:
                record = config.done
                if record is None:
                    record = self._run_one(config.spec, runner, frontier, view)
                    if record.get("env") is None:
                        record["env"] = envs.get(config.spec.device) or _host_env()
                    envs[config.spec.device] = record["env"]
                    append_record(out, record)
                    view.finished(record)
                frontier.add(record)
                records.append(record)
        return records

    def _run_one(self, spec: RunSpec, runner, frontier: OomFrontier, view: SweepProgress) -> dict[str, Any]:
        reason = frontier.skip_reason(spec) if self.skip_after_oom else None
        if reason is not None:
            record, wall_ms = failure_record(spec, "skipped", reason), None
        else:
            view.started(spec)
            t0 = time.perf_counter()
            record = runner(spec, view.phase)
            wall_ms = (time.perf_counter() - t0) * 1e3
        env = record.pop("env", None)
        # config_wall_ms: the whole config as the sweep saw it (child start, build, all steps), in ms.
        return {**record, "sweep_id": self.sweep_id, "isolation": self.grid.isolation, "config_wall_ms": wall_ms,
                "env": env}

    def _warn(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"gcbench: warning: {message}", markup=False, highlight=False)
        else:
            warnings.warn(message, stacklevel=3)


def _existing_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records already in the output file (GcbenchError for another schema_version) and warnings about it."""
    if not path.exists():
        return [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_records(path)
    return records, [str(w.message) for w in caught]


def _host_env() -> dict:
    # For records no child produced (skipped, or a child that died before reporting): the sweep process must not
    # create a CUDA context of its own (it would hold device memory during every config), so no GPU fields here.
    from gcbench.env import capture_env

    return capture_env("cpu")


@contextmanager
def _sigterm_raises_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler ending the job, `kill`) takes the Ctrl-C path: stop the child, keep the records."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class SweepProgress:
    """What a running sweep shows on stderr: a bar over the configs to run with ETA, the config and phase running
    now and counts per status; one line per finished config is printed above the bar. Quiet with no console."""

    def __init__(self, console: Console | None, total: int, resumed: int):
        self.console, self.total, self.resumed = console, total, resumed
        self.counts: Counter[str] = Counter()
        self._label = ""
        self._bar = Progress(
            SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[counts]}"),
            console=console, transient=True, disable=console is None)

    def __enter__(self) -> SweepProgress:
        if self.console is not None and self.resumed:
            self.console.print(f"resuming: {self.resumed} config(s) already in the results file, "
                               f"{self.total} to run (--rerun runs all)")
        self._bar.__enter__()
        self._task = self._bar.add_task("starting", total=self.total, counts=self._counts_text())
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def _counts_text(self) -> str:
        return " · ".join(f"{s} {self.counts[s]}" for s in STATUSES)

    def started(self, spec: RunSpec) -> None:
        self._label = config_label(spec.as_record())
        self._bar.update(self._task, description=f"{self._label} · starting")

    def phase(self, text: str) -> None:
        self._bar.update(self._task, description=f"{self._label} · {text}")

    def finished(self, record: dict[str, Any]) -> None:
        self.counts[record["status"]] += 1
        self._bar.update(self._task, advance=1, counts=self._counts_text())
        if self.console is not None:
            self._bar.console.print(_finished_line(record), highlight=False)


_STATUS_STYLE = {"ok": "green", "oom": "yellow", "skipped": "dim", "timeout": "red", "error": "bold red"}


def _finished_line(record: dict[str, Any]) -> str:
    status = record["status"]
    line = f"[{_STATUS_STYLE[status]}]{status:>7}[/] {config_label(record)}"
    if status == "ok":
        line += f"  {record['step_ms_median']:.1f} ms/step, peak {fmt_bytes(peak_bytes(record))}"
    elif record.get("error"):
        line += f"  [dim]{_escape(str(record['error'])[:120])}[/]"
    return line


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------------------------------- tables

def grid_table(sweep: Sweep) -> Table:
    """`--dry-run`: every config of the grid, and whether the results file already holds it."""
    plan = sweep.plan()
    to_run = sum(p.done is None for p in plan)
    table = Table(title=f"{len(plan)} configs ({to_run} to run, {len(plan) - to_run} already in {sweep.grid.out})",
                  caption=sweep.grid.shared_options())
    for col in ("#", "model", "seq", "batch", "policy", "in results file"):
        table.add_column(col, justify="right" if col in ("#", "seq", "batch") else "left")
    for i, config in enumerate(plan, 1):
        record = config.spec.as_record()
        done = config.done["status"] if config.done else "to run"
        table.add_row(str(i), record["model"], str(record["seq_len"]), str(record["batch_size"]),
                      policy_label(record), done)
    return table


def summary_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per config: the columns a sweep summary shows (raw units)."""
    return pd.DataFrame([{
        "model": r["model"], "seq_len": r["seq_len"], "batch_size": r["batch_size"], "policy": policy_label(r),
        "status": r["status"], "step_ms_median": r.get("step_ms_median"), "peak_bytes": peak_bytes(r),
        "activation_peak_bytes": r.get("activation_peak_bytes"), "tokens_per_s": r.get("tokens_per_s"),
        "note": r.get("error"),
    } for r in records])


def summary_table(records: list[dict[str, Any]]) -> Table:
    """The table a sweep prints at the end: every config of the grid with its status and headline numbers."""
    frame = summary_frame(records)
    counts = Counter(frame["status"]) if len(frame) else Counter()
    title = f"{len(frame)} configs: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    models = sorted(set(frame["model"])) if len(frame) else []
    if len(models) == 1:  # one model: name it once in the title, keep the table within 80 columns
        title = f"{models[0]} · {title}"
    # A light box (no vertical rules) so that the config and its numbers fit an 80-column terminal.
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="peak: CUDA max_memory_allocated, or on CPU the live-tensor tracker's peak; "
                          "act. peak: fwd+bwd peak above model state")
    notes = bool(len(frame)) and (frame["status"] != "ok").any()  # the column only when something did not run
    columns = ["model", "seq", "batch", "policy", "status", "step ms", "peak", "act. peak", "tokens/s"]
    if len(models) == 1:
        columns.remove("model")
    rows = []
    for row in frame.itertuples(index=False):
        ok = row.status == "ok"
        rows.append([*([] if len(models) == 1 else [row.model]), str(row.seq_len), str(row.batch_size), row.policy, row.status,
                     f"{row.step_ms_median:.1f}" if ok else "-", fmt_bytes(row.peak_bytes) if ok else "-",
                     fmt_bytes(row.activation_peak_bytes) if ok else "-", f"{row.tokens_per_s:,.0f}" if ok else "-",
                     *([str(row.note)[:100] if row.note and not ok else ""] if notes else [])])
    for i, col in enumerate(columns):
        # The config and its numbers keep their width; on a narrow terminal the note wraps instead.
        table.add_column(col, justify="left" if col in ("model", "policy", "status") else "right", no_wrap=True,
                         min_width=max(len(r[i]) for r in rows) if rows else None)
    if notes:
        table.add_column("note", ratio=1)
    status = columns.index("status")
    for cells in rows:
        cells[status] = f"[{_STATUS_STYLE[cells[status]]}]{cells[status]}[/]"
        if notes:
            cells[-1] = _escape(cells[-1])
        table.add_row(*cells)
    return table


def largest_fit_table(records: list[dict[str, Any]]) -> Table | None:
    """`gcbench report`'s "largest config that fit" table for these records; None when nothing ran out of memory
    (then "largest" would only mean "largest in the grid")."""
    from gcbench.report import largest_fit_grid, results_frame, rich_table

    if not any(r["status"] == "oom" for r in records):
        return None
    # The same frame `gcbench report` builds from a results file (results.load adds policy_label and source).
    rows = [{**r, "policy_label": policy_label(r), "source": "sweep"} for r in records]
    grid = largest_fit_grid(results_frame(pd.json_normalize(rows, max_level=1)))
    grid.title = "largest config that fit, per policy"
    return rich_table(grid)


# --------------------------------------------------------------------------------------------------- library call

def sweep(config: str | Path | SweepSpec | None = None, *, rerun: bool = False, skip_after_oom: bool = True,
          progress: bool = True, **options: Any) -> list[dict[str, Any]]:
    """Run a sweep from Python, exactly as `gcbench sweep` does; returns the grid's records in grid order.

        gcbench.sweep(model="tiny-llama", seq=[32, 64], batch=[1, 2], policy=["none", "full"], device="cpu",
                      out="results/tiny.jsonl")
        gcbench.sweep("sweeps/smoke.toml", steps=2)     # keyword options override the file

    Options take the CLI names (memory_cap or "memory-cap"). KeyboardInterrupt propagates after the running child
    is stopped; the records already written stay and the next call resumes.
    """
    grid = config if isinstance(config, SweepSpec) else SweepSpec.load(config, options, where="sweep()")
    if isinstance(config, SweepSpec) and options:
        grid = dataclasses.replace(grid, **parse_options(options, where="sweep()"))
    console = Console(stderr=True) if progress else None
    return Sweep(grid, rerun=rerun, skip_after_oom=skip_after_oom, console=console).run()
