"""SweepSpec: a grid of RunSpecs (every combination of the values given per field) and how to run it.

Every RunSpec field can take several values (`--seq 512,1024`, `seq = [512, 1024]`, `precision = ["fp32", "bf16"]`);
the keys and parsers come from the field declarations in spec.py, so a new RunSpec field is a grid option at once.
Importing this module is cheap (no torch).
"""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, RUN_FIELDS
from gcbench.results.schema import LEVER_FIELDS, lever_text
from gcbench.results.store import check_regular
from gcbench.resolved import PolicyRefused, ResolvedRun, config_fields, distinct_runs, resolve
from gcbench.spec import RunSpec, check_grid_size, crossed_out
from gcbench.timing import MIN_SPAN_S
from gcbench.units import fmt_bytes
from gcbench.values import Choice, Int, Kind, Name, Seconds, Size, Switch, split_items

DEFAULT_OUT = Path("results/sweep.jsonl")
DEFAULT_TIMEOUT_S = 600.0  # per config; generous: a 7B model at seq 8192 takes minutes to build, warm up and time
DEFAULT_POLICIES = ("none", "full", "every-k:k=2", "sqrtn")
ISOLATIONS = ("process", "none")
EXECUTORS = ("slurm", "local")  # submitit's: a Slurm cluster, or processes on this machine
# RunSpec fields without a default (model, seq, batch): a grid must give them
REQUIRED = tuple(f.name for f in RUN_FIELDS if f.default is dataclasses.MISSING)


@dataclass(frozen=True)
class FilePath(Kind):
    metavar = "PATH"

    def parse(self, value: Any) -> Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise GcbenchError(f"expected a file path, got {value!r}")
        return Path(value)


@dataclass(frozen=True)
class Devices(Kind):
    """--devices: "all" or a comma list of cuda:N (TOML: a list)."""

    metavar = "GPUS"

    def parse(self, value: Any) -> tuple[str, ...]:
        items = tuple(str(i).strip() for i in (value if isinstance(value, (list, tuple)) else split_items(str(value))))
        if "" in items:  # a TOML list's "" as a comma list's empty item
            raise GcbenchError(f"an empty item in {list(value) if isinstance(value, (list, tuple)) else value!r}")
        if items == ("all",):
            return items
        for item in items:
            if not (item.startswith("cuda:") and item[5:].isdigit()):
                raise GcbenchError(f"expected all or a list of cuda:N (cuda:0,cuda:1), got {item!r}")
        if len(set(items)) != len(items):
            raise GcbenchError(f"a GPU given twice in {','.join(items)}")
        if not items:
            raise GcbenchError("expected all or a list of cuda:N")
        return items


# How a sweep runs (not part of any RunSpec): option name -> (SweepSpec field, the kind of its value). The kinds
# are the run fields' (fields.py): `paired = "on"` and `paired = true` are one value, as for any switch.
RUN_OPTIONS: dict[str, tuple[str, Kind]] = {
    "out": ("out", FilePath()),
    "timeout": ("timeout_s", Seconds(most=float("inf"))),
    "isolation": ("isolation", Choice(ISOLATIONS, "isolation")),
    "paired": ("paired", Switch()),
    "devices": ("devices", Devices()),
    "jobs": ("jobs", Int(1, 4096)),
    "executor": ("executor", Choice(EXECUTORS, "executor")),
    "slurm-partition": ("slurm_partition", Name()),
    "slurm-gpus-per-job": ("slurm_gpus_per_job", Int(1, 4096)),
    "slurm-array-parallelism": ("slurm_array_parallelism", Int(1, 1_000_000)),
}


@dataclass(frozen=True)
class SweepSpec:
    """A grid: the values of each RunSpec field (every combination is one config), and how to run it."""

    values: Mapping[str, tuple[Any, ...]]  # RunSpec field name -> its values; a field not here keeps its default
    out: Path = DEFAULT_OUT  # JSON Lines file; records are appended (only a half-written last line is ever cut)
    timeout_s: float = DEFAULT_TIMEOUT_S  # wall-clock limit per config, child start included
    isolation: str = "process"  # process: fresh child per config | none: in this process (faster start, less safe)
    # Time the policies of one model/seq/batch interleaved in one process after each has run (paired.py), so that
    # their time ratio does not drift with the machine: a few seconds more per configuration.
    paired: bool = True
    devices: tuple[str, ...] | None = None  # run one config per GPU at a time: ("all",) or ("cuda:0", "cuda:1")
    jobs: int = 1  # CPU configs run side by side, each on its own cores (their step times are not comparable)
    # Jobs through submitit instead of children here: slurm, or local (submitit's local executor, for trying it).
    executor: str | None = None
    slurm_partition: str | None = None
    slurm_gpus_per_job: int = 1  # GPUs each job asks for (a job runs one config at a time on the first)
    slurm_array_parallelism: int | None = None  # the most jobs of the array running at once (None: Slurm's)

    def __post_init__(self) -> None:
        slurm_only = {"slurm-partition": self.slurm_partition, "slurm-array-parallelism":
                      self.slurm_array_parallelism, "slurm-gpus-per-job": None if self.slurm_gpus_per_job == 1 else 1}
        for flag, value in slurm_only.items():
            if value is not None and self.executor != "slurm":
                raise GcbenchError(f"--{flag} is for --executor slurm")
        if self.executor is not None and (self.devices or self.jobs > 1 or self.isolation != "process"):
            raise GcbenchError(f"--executor {self.executor} runs each configuration as a job: --devices, --jobs and "
                               "--isolation none do not apply (a job's configs run one at a time in fresh children)")
        object.__setattr__(self, "defaulted", "policy" not in self.values)  # no --policy: the models' defaults
        object.__setattr__(self, "refused", {})  # a default policy a model refuses -> why (expand fills it)
        values = {"policy": DEFAULT_POLICIES, **self.values}
        for name in REQUIRED:
            if name not in values:
                every = ", ".join(f"--{BY_NAME[n].flag}" for n in REQUIRED)
                raise GcbenchError(f"no --{BY_NAME[name].flag} given: a sweep needs at least one value of each of "
                                   f"{every} (or a --config file that sets them)")
        check_grid_size(values, "split it into several sweeps (they may share one --out)")
        object.__setattr__(self, "values", MappingProxyType(values))

    @classmethod
    def load(cls, config: str | Path | None = None, options: Mapping[str, Any] | None = None,
             where: str | None = None) -> SweepSpec:
        """The grid from a TOML file and/or options (CLI names: model, seq, batch, policy, ..., memory-cap, out,
        timeout, isolation); options override the file. `where` names the options in errors (None: flags)."""
        values: dict[str, tuple] = {}
        run: dict[str, Any] = {}
        sources = [] if config is None else [(_read_toml(Path(config)), str(config), True)]
        for source, source_where, file in [*sources, (options or {}, where, False)]:
            grid_values, run_values = parse_options(source, where=source_where, file=file)
            values.update(grid_values)
            run.update(run_values)
        return cls(values, **run)

    def expand(self, devices_here: bool = True) -> list[ResolvedRun]:
        """Every config, resolved (resolved.py), in run order: fields in declaration order (model, seq, batch, ...),
        the policy innermost (the policies of one shape run together, and a shape's OOM is known before the next
        larger shape runs). Combinations that cannot be one config, where the grid crosses several values, are
        left out (`left_out` says how many and why); given alone, such a combination is an error.
        `devices_here=False`: the configs run on other machines (resolved.resolve)."""
        names = [n for n in BY_NAME if n in self.values and n != "policy"] + ["policy"]
        configs: dict[tuple, tuple[Any, str]] = {}  # one model config per resolved.config_fields

        def runs() -> Iterator[tuple[ResolvedRun, dict[str, Any]]]:
            for combo in itertools.product(*(self.values[n] for n in names)):
                fields = dict(zip(names, combo))
                if self._crossed_out(fields):
                    continue
                try:
                    plain = RunSpec(**fields)
                    shape = config_fields(plain)
                    spec = resolve(plain, devices_here=devices_here, config=configs.get(shape))
                    configs[shape] = spec.model_config()
                    spec.check_runnable(here=devices_here)
                except PolicyRefused as e:
                    if not self.defaulted:
                        raise GcbenchError(f"{e} (config: {fields['model']})") from None
                    self.refused[fields["policy"], fields["model"]] = f"left out for {fields['model']}: {e}"
                    continue
                except GcbenchError as e:
                    raise GcbenchError(f"{e} (config: {fields['model']}, seq {fields['seq_len']}, batch "
                                       f"{fields['batch_size']}, {fields['policy']})") from None
                yield spec, fields

        return distinct_runs(runs(), "run")

    def _crossed_out(self, fields: Mapping[str, Any]) -> bool:
        """A combination that cannot be one config, from a grid that crosses several values (spec.crossed_out)."""
        return crossed_out(fields, self.values)

    def left_out(self) -> str | None:
        """What expand() leaves out of the grid, in one line; None when nothing."""
        names = [n for n in BY_NAME if n in self.values]
        n = sum(self._crossed_out(dict(zip(names, combo)))
                for combo in itertools.product(*(self.values[k] for k in names)))
        crossed = [] if not n else [
            f"{n} config{'s' if n != 1 else ''} left out: --optim-in-backward on cannot accumulate gradients "
            f"(--grad-accum above 1), --nproc above 1 is a sharded run (not --shard none), and --precision amp-fp16 "
            f"runs neither with --optim-in-backward on nor sharded"]
        return "; ".join([*crossed, *self.refused.values()]) or None

    def shared_options(self) -> str:
        """The options every config shares, as one line for tables."""
        one = {n: v[0] for n, v in self.values.items() if len(v) == 1}
        defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
        get = lambda name: one.get(name, defaults[name])  # noqa: E731
        cap = fmt_bytes(get("memory_cap_bytes")) if get("memory_cap_bytes") else "none"
        varies = lambda name: len(self.values.get(name, ())) > 1  # noqa: E731 - then a column says it per config
        varying = tuple(n for n in LEVER_FIELDS if varies(n))
        levers = lever_text({**{n: get(n) for n in LEVER_FIELDS}, "precision": get("precision") or "auto precision"},
                            leave_out=varying)
        target = f"target {get('target_len')} · " if get("target_len") and not varies("target_len") else ""
        return (f"layers {get('layers') or 'all'} · {target}" + (f"{levers} · " if levers else "")
                + f"device {get('device')} · threads {get('threads') or 'auto'} · warm-up {get('warmup_steps')} + "
                f"{_steps_text(get)} · memory cap {cap} · timeout {self.timeout_s:g} s · "
                f"isolation {self.isolation}" + ("" if self.paired else " · not paired")
                + (f" · devices {','.join(self.devices)}" if self.devices else "")
                + (f" · {self.jobs} parallel jobs" if self.jobs > 1 else "")
                + (f" · {self.executor} jobs" if self.executor else ""))


def _steps_text(get: Callable[[str], Any]) -> str:
    if get("measure_steps") != "auto":
        return f"{get('measure_steps')} timed steps"
    span, most = min(MIN_SPAN_S, get("max_time_s")), get("max_time_s")
    if most <= span:  # the default: the interval's target cannot end it sooner
        return f"timed steps for {most:g} s (at most {get('max_steps')} steps)"
    return f"timed steps over {span:g} s, then until +-2% (+-1% CUDA), at most {get('max_steps')} steps or {most:g} s"


def parse_options(options: Mapping[str, Any], where: str | None = None, fields: tuple[str, ...] | None = None,
                  file: bool = False) -> tuple[dict[str, tuple], dict[str, Any]]:
    """Options by their CLI names ('memory-cap' or 'memory_cap') -> (RunSpec field -> values, SweepSpec run
    fields). Values are what a TOML file or a Python caller gives (lists, ints) or what the command line gives
    (comma lists: "512,1024"). `fields` limits which RunSpec fields are accepted (None: all). `file`: a TOML
    file's, where a size is text with its unit (`memory-cap = 80` meant 80 GiB, not 80 bytes, as on the command
    line); Python's ints stay bytes."""
    by_flag = {f.flag: f for f in RUN_FIELDS if fields is None or f.name in fields}
    known = [*by_flag, *RUN_OPTIONS] if fields is None else list(by_flag)
    values: dict[str, tuple] = {}
    run: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for raw_key, value in options.items():
        key = str(raw_key).replace("_", "-")
        if key in seen:  # memory-cap and memory_cap are one option
            raise GcbenchError(f"{where + ': ' if where else ''}{seen[key]!r} and {raw_key!r} are the same option: "
                               "give it once")
        seen[key] = str(raw_key)
        if key not in known:
            raise GcbenchError(f"{where + ': ' if where else ''}unknown option {raw_key!r} "
                               f"(known: {', '.join(known)})")
        try:
            if file and key in by_flag and isinstance(by_flag[key].kind, Size) and any(
                    type(v) is int for v in (value if isinstance(value, list) else [value])):
                raise GcbenchError(f"{value!r} has no unit: write the size as text, e.g. \"80GiB\"")
            if key in by_flag:
                values[by_flag[key].name] = by_flag[key].parse_many(value)
            else:
                name, kind = RUN_OPTIONS[key]
                run[name] = kind.parse(value)
        except GcbenchError as e:
            # On the command line the flag is named (--seq: ...); in a file, the file and its key.
            message = str(e).removeprefix(f"--{key}: ")
            raise GcbenchError(f"{where}: {key}: {message}" if where else f"--{key}: {message}") from None
    return values, run


def _read_toml(path: Path) -> dict[str, Any]:
    check_regular(path, "a sweep config")  # a directory, /dev/zero, a FIFO: fails late or reads forever
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise GcbenchError(f"cannot read sweep config {str(path)[:200]!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise GcbenchError(f"{path}: not a TOML file (TOML is UTF-8 text)") from None
    except tomllib.TOMLDecodeError as e:
        raise GcbenchError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:  # arrays or tables inside each other deeper than the parser follows
        raise GcbenchError(f"{path}: not a sweep config: values nested too deeply") from None


def one_value_each(values: dict[str, tuple], why: str) -> dict[str, Any]:
    """{field: (value,)} -> {field: value}; GcbenchError naming the option given several values."""
    for name, given in values.items():
        if len(given) > 1:
            raise GcbenchError(f"--{BY_NAME[name].flag} takes one value here, got {len(given)}"
                               + (f": {why}" if why else ""))
    return {name: given[0] for name, given in values.items()}
