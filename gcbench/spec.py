"""RunSpec: everything that defines one measured configuration, each field declared once, validated when made.

Each field carries its `Option`: the flag and TOML key, the help, the parser of one value. The command line
(`gcbench run`, `sweep`, `estimate`), sweep TOML files and sweep grids are all derived from these declarations,
so a new field is declared here, added to the record schema (results/schema.py) and used where it acts.
Importing this module is cheap (no torch): the CLI reads the declarations to build its options.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError
from gcbench.optimizers import OPTIMIZERS, optimizer_kind
from gcbench.timing import DEFAULT_MAX_STEPS, DEFAULT_MAX_TIME_S, StepBudget, default_threads
from gcbench.units import parse_bytes

if TYPE_CHECKING:
    import torch

    from gcbench.policies import Policy

PRECISIONS = {
    # name: (parameter dtype, autocast dtype or None), as torch attribute names
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),  # pure bf16: params, grads and optimizer state in bf16 (AdamW: 8 B/param)
    "amp-bf16": ("float32", "bfloat16"),  # fp32 master weights, grads and state, bf16 matmuls (AdamW: 16 B/param)
}
# The integer fields' ranges. Above them: sizes no machine holds (int64 overflows in torch), step counts that would
# run for days, seeds torch.manual_seed refuses.
LIMITS = {"seq_len": (1, 2**31 - 1), "batch_size": (1, 2**31 - 1), "layers": (1, 1_000),
          "warmup_steps": (1, 1_000_000), "measure_steps": (1, 1_000_000), "max_steps": (1, 1_000_000),
          "seed": (0, 2**63 - 1), "threads": (1, 4096), "grad_accum": (1, 65_536), "nproc": (1, 4096)}
AUTO = "auto"  # --steps auto, --threads auto
ATTENTION = ("eager", "sdpa", "flash_attention_2")
SHARDS = ("none", "fsdp2")


# --------------------------------------------------------------------------------------------------- one value

def parse_int(value: Any) -> int:
    """An integer; its range is RunSpec's to check, so that its message names the rule."""
    # bool is an int in Python; `seq = true` in TOML is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"\s*-?[0-9]+\s*", str(value)):
        raise GcbenchError(f"{value!r} is not an integer")
    return int(value)


def parse_int_or_auto(value: Any) -> int | str:
    """An integer, or "auto" (the field's default rule decides)."""
    if isinstance(value, str) and value.strip() == AUTO:
        return AUTO
    try:
        return parse_int(value)
    except GcbenchError:
        raise GcbenchError(f"{value!r} is neither an integer nor 'auto'") from None


def parse_seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise GcbenchError(f"expected seconds, got {value!r}") from None
    if isinstance(value, bool) or not 0 < seconds <= 86_400:
        raise GcbenchError(f"must be a number of seconds above 0 and at most a day (86400), got {value!r}")
    return seconds


SWITCH = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_switch(value: Any) -> bool:
    """on | off (true/false, yes/no, 1/0 too; a TOML boolean as it is)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in SWITCH:
        return SWITCH[value.strip().lower()]
    raise GcbenchError(f"expected on or off, got {value!r}")


def parse_name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise GcbenchError(f"expected a name, got {value!r}")
    return value.strip()


def parse_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return parse_bytes(str(value))  # bytes: the checks of a size typed
    if isinstance(value, str):
        return parse_bytes(value)
    raise GcbenchError(f"expected a size such as 2GiB, got {value!r}")


def parse_policy_text(value: Any) -> str:
    """A policy string in canonical form ("every-k" -> "every-k:k=2"), checked against the registry."""
    from gcbench.policies import parse_policy

    if not isinstance(value, str):
        raise GcbenchError(f"expected a policy string, got {value!r}")
    return str(parse_policy(value))


def split_items(text: str) -> list[str]:
    """A comma list as typed: "512,1024" -> ["512", "1024"]."""
    return [s.strip() for s in text.split(",") if s.strip()]


def split_policies(text: str) -> list[str]:
    # A piece with '=' but no ':' is one more option of the policy before it: "foo:a=1,b=2,none".
    texts: list[str] = []
    for piece in split_items(text):
        if texts and "=" in piece and ":" not in piece:
            texts[-1] += "," + piece
        else:
            texts.append(piece)
    return texts


@dataclass(frozen=True)
class Option:
    """How one RunSpec field is given: `--flag VALUE` on the command line, `flag = value` in a sweep file."""

    flag: str  # the option name without dashes; also the TOML key
    help: str
    parse: Callable[[Any], Any] = parse_int  # one value as typed or as TOML/Python gives it -> the field's value
    metavar: str = "INT"
    axis: bool = False  # a main grid axis: `gcbench estimate` takes several values of it too
    ascending: bool = False  # a sweep runs its values smallest first, so that an OOM can skip the larger ones
    split: Callable[[str], list[str]] = split_items  # several values in one string (sweep, estimate)
    flag_value: str | None = None  # the value of the bare flag (`--optim-in-backward` = `--optim-in-backward on`)

    def parse_one(self, value: Any) -> Any:
        try:
            return self.parse(value)
        except GcbenchError as e:
            raise GcbenchError(f"--{self.flag}: {e}") from None

    def parse_many(self, value: Any) -> tuple[Any, ...]:
        """Values from a comma string, a list, or one scalar; no duplicates (each config would run twice)."""
        items = self.split(value) if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) \
            else [value]
        if not items:
            raise GcbenchError(f"--{self.flag}: no values: the grid would be empty")
        values = [self.parse_one(v) for v in items]
        if len(set(values)) < len(values):
            dup = next(v for v in values if values.count(v) > 1)
            raise GcbenchError(f"--{self.flag}: duplicate value {dup} (each config would run twice)")
        return tuple(sorted(values)) if self.ascending else tuple(values)


def option(flag: str, help: str, default: Any = dataclasses.MISSING, **how: Any) -> Any:
    """A RunSpec field with its Option (read back with `spec_options()`)."""
    return field(default=default, metadata={"option": Option(flag, help, **how)})


# --------------------------------------------------------------------------------------------------- the spec

@dataclass(frozen=True)
class RunSpec:
    """One configuration to measure. Made only through validation: every field is concrete and legal."""

    model: str = option("model", "preset name (see `gcbench models`), path to a config.json, or a Hugging Face Hub "
                        "id owner/name[@revision] (its config.json only)", parse=parse_name,
                        metavar="NAME", axis=True)
    seq_len: int = option("seq", "sequence length in tokens", axis=True, ascending=True)
    batch_size: int = option("batch", "samples per step", axis=True, ascending=True)
    policy: Policy = option("policy", "checkpoint policy: name or name:key=value (see `gcbench policies`)",
                            "none", parse=parse_policy_text, metavar="POLICY", axis=True, split=split_policies)
    layers: int | None = option("layers", "keep only the first N blocks (activation memory is linear in N; "
                                "default: all)", None)
    precision: str = option("precision", "fp32 | bf16 (pure: weights, grads and optimizer state in bf16) | "
                            "amp-bf16 (fp32 weights, grads and state; bf16 autocast) (default: bf16 on CUDA, fp32 "
                            "on CPU)", "", parse=parse_name, metavar="NAME", axis=True)
    optimizer: str = option("optimizer", f"{' | '.join(OPTIMIZERS)} (docs/levers.md; adamw8bit needs "
                            "bitsandbytes)", "adamw", parse=parse_name, metavar="NAME", axis=True)
    optim_in_backward: bool = option("optim-in-backward", "step each parameter inside backward as soon as its "
                                     "gradient is complete, then drop that gradient (no full set of gradients at "
                                     "once); on | off", False, parse=parse_switch, metavar="on|off", axis=True,
                                     flag_value="on")
    grad_accum: int = option("grad-accum", "micro-batches of --batch per optimizer step (gradient accumulation: "
                             "the memory of one micro-batch, the tokens of all)", 1, axis=True, ascending=True)
    shard: str = option("shard", "none | fsdp2: parameters, gradients and optimizer state sharded over --nproc "
                        "ranks (FSDP2 on each block and the root; --batch is per rank)", "none", parse=parse_name,
                        metavar="NAME", axis=True)
    nproc: int = option("nproc", "ranks of a sharded run, started by torchrun: one GPU each (cuda:N, N+1, ...), or "
                        "CPU processes talking through gloo", 1, axis=True, ascending=True)
    device: str = option("device", "auto | cpu | cuda[:N]; auto is cuda:0 when there is a GPU", "auto",
                         parse=parse_name, metavar="NAME")  # resolved when made: "cpu" or an explicit "cuda:N"
    attn: str | None = option("attn", "attention implementation: eager | sdpa (default: sdpa where the model's "
                              "family has it, else eager)", None,
                              parse=parse_name, metavar="NAME")
    warmup_steps: int = option("warmup", "untimed warm-up steps, at least 1: step 1 creates gradients and "
                               "optimizer state", 3)
    measure_steps: int | str = option("steps", "timed steps: auto (until the median's 95% interval is within "
                                      "+-2%: at least 6 steps, at most --max-steps or --max-time) or a number",
                                      AUTO, parse=parse_int_or_auto, metavar="N|auto")
    max_steps: int = option("max-steps", "with --steps auto: the most timed steps", DEFAULT_MAX_STEPS)
    max_time_s: float = option("max-time", "with --steps auto: seconds of timed steps after which it stops (at "
                               "least 6 steps run)", DEFAULT_MAX_TIME_S, parse=parse_seconds, metavar="SECONDS")
    threads: int | None = option("threads", "torch CPU threads: auto (CPU: the available cores but one; CUDA: "
                                 "torch's default) or a number", None, parse=parse_int_or_auto, metavar="N|auto")
    seed: int = option("seed", "seed for weights, batch and dropout", 0)
    # Records say which limit applies in `memory_cap_kind`.
    memory_cap_bytes: int | None = option("memory-cap", "memory limit, e.g. 2GiB (CPU: live tensor bytes; CUDA: "
                                          "the allocator's reserved bytes)", None, parse=parse_size, metavar="SIZE")

    def __post_init__(self) -> None:
        from gcbench.policies import parse_policy

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        if isinstance(self.policy, str):
            set_("policy", parse_policy(self.policy))
        if self.warmup_steps == 0:
            raise GcbenchError("--warmup must be at least 1, got 0: the first step creates gradients and optimizer "
                               "state, so it cannot be a measured one")
        set_("device", resolve_device(self.device))
        if self.threads in (None, AUTO):
            set_("threads", default_threads() if self.device == "cpu" else _torch_default_threads())
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if (name == "layers" and value is None) or (name == "measure_steps" and value == AUTO):
                continue  # all of the model's blocks; steps until the interval is narrow
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise GcbenchError(f"--{spec_options()[name].flag} must be an integer from {lo} to {hi:,}"
                                   + (" or auto" if name == "measure_steps" else "") + f", got {value!r}")
        if isinstance(self.max_time_s, bool) or not isinstance(self.max_time_s, (int, float)) \
                or not 0 < self.max_time_s <= 86_400:
            raise GcbenchError(f"--max-time must be a number of seconds above 0 and at most 86400, got "
                               f"{self.max_time_s!r}")
        if not self.precision:
            set_("precision", "bf16" if self.device.startswith("cuda") else "fp32")
        if self.precision not in PRECISIONS:
            raise GcbenchError(f"unknown precision {self.precision!r} ({', '.join(PRECISIONS)})")
        kind = optimizer_kind(self.optimizer)
        if not isinstance(self.optim_in_backward, bool):
            raise GcbenchError(f"--optim-in-backward must be on or off, got {self.optim_in_backward!r}")
        if self.optim_in_backward and not kind.steps:
            raise GcbenchError("--optim-in-backward needs an optimizer to step; --optimizer none has none")
        if self.optim_in_backward and self.grad_accum > 1:
            raise GcbenchError(f"--optim-in-backward steps each parameter as soon as its gradient is complete, so "
                               f"gradients cannot accumulate over --grad-accum {self.grad_accum} micro-batches: "
                               f"use one or the other")
        if self.attn is not None and self.attn not in ATTENTION:
            raise GcbenchError(f"unknown attention implementation {self.attn!r} ({', '.join(ATTENTION)})")
        if self.attn == "flash_attention_2":
            _check_flash_attention(self.device, self.precision)
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise GcbenchError("--memory-cap must be positive")
        self._check_sharding()
        config, _ = self.model_config()
        self.policy.validate(config.num_hidden_layers)

    def _check_sharding(self) -> None:
        if self.shard not in SHARDS:
            raise GcbenchError(f"unknown --shard {self.shard!r} ({', '.join(SHARDS)})")
        if self.shard == "none":
            if self.nproc > 1:
                raise GcbenchError(f"--nproc {self.nproc} needs --shard fsdp2: gcbench measures sharded training "
                                   "(per-rank memory), not plain data parallel")
            return
        if self.policy.compiles:
            raise GcbenchError(f"--policy {self.policy.name} compiles the blocks, and compiled blocks under FSDP2 draw "
                               "other dropout masks than eager ones: the gradients would not equal none's; not "
                               "with --shard fsdp2")
        if self.optim_in_backward:
            raise GcbenchError("--optim-in-backward steps plain parameters inside backward; FSDP2's are sharded "
                               "(DTensors) and reduce-scattered after it: not with --shard fsdp2")
        from gcbench.sharding import in_rank  # a rank's spec names its own GPU: the launcher checked the count

        if self.device.startswith("cuda") and not DEVICES_ELSEWHERE.get() and not in_rank():
            import torch

            first, count = int(self.device.split(":")[1]), torch.cuda.device_count()
            if first + self.nproc > count:
                raise GcbenchError(f"--nproc {self.nproc} needs a GPU per rank from {self.device}: {count} here")

    def check_runnable(self) -> None:
        """GcbenchError when this machine cannot run the config: a package its optimizer needs is not installed.
        Not part of validation: `gcbench estimate` predicts such a config without the package."""
        optimizer_kind(self.optimizer).check_installed()

    def model_config(self):
        """(config, family) with this run's layers, sequence length and attention applied."""
        from gcbench.models import load_config, prepare_config

        config, family = load_config(self.model)
        return prepare_config(config, family, layers=self.layers, seq_len=self.seq_len, attn=self.attn), family

    @property
    def budget(self) -> StepBudget:
        """How many steps to time (timing.StepBudget)."""
        fixed = None if self.measure_steps == AUTO else self.measure_steps
        return StepBudget(fixed, self.max_steps, float(self.max_time_s))

    @property
    def param_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, PRECISIONS[self.precision][0])

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        name = PRECISIONS[self.precision][1]
        return getattr(torch, name) if name else None

    def as_record(self) -> dict[str, Any]:
        """The spec's fields as they appear in a record (results/schema.py SpecFields: flat, JSON-ready)."""
        from gcbench.instruments import instrument_class

        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["policy"] = self.policy.name
        out["policy_options"] = self.policy.options()
        # What --memory-cap limits on this device: live tensor bytes (CPU) or reserved bytes (CUDA); None: no cap.
        out["memory_cap_kind"] = instrument_class(self.device).memory_cap_kind if self.memory_cap_bytes else None
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunSpec:
        """The spec back from `as_record()` or a stored record (extra keys ignored), validated again: the JSON
        round trip a sweep uses to hand a spec to its child process."""
        from gcbench.policies import parse_policy

        values = {f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record}
        policy = parse_policy(str(record.get("policy", "none")))
        try:
            values["policy"] = dataclasses.replace(policy, **(record.get("policy_options") or {}))
        except TypeError:
            raise GcbenchError(f"record has options {record.get('policy_options')!r} that policy "
                               f"{policy.name!r} does not take") from None
        return cls(**values)


def crossed_out(fields: Mapping[str, Any], values: Mapping[str, Sequence[Any]]) -> bool:
    """Whether a grid that crosses several values leaves this combination out: the optimizer in backward with
    accumulation, or several ranks without sharding. Given alone, such a combination is an error (RunSpec says)."""
    varies = lambda *names: any(len(values.get(n, ())) > 1 for n in names)  # noqa: E731
    in_backward = fields.get("optim_in_backward") and fields.get("grad_accum", 1) > 1
    if varies("optim_in_backward", "grad_accum") and in_backward:
        return True
    return varies("shard", "nproc") and fields.get("shard", "none") == "none" and fields.get("nproc", 1) > 1


def spec_options() -> dict[str, Option]:
    """RunSpec field name -> its Option, in declaration order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(RunSpec)}


def with_bare_switches(args: list[str]) -> list[str]:
    """A switch option given alone (`--optim-in-backward`, last or before another option) gets its flag value
    (`on`); with a value (`--optim-in-backward off`, `on,off` in a sweep) it keeps it. For the command line's
    arguments before click parses them: click 8 could do this (flag_value on a value option), typer does not pass
    flag_value on."""
    switches = {f"--{o.flag}": o.flag_value for o in spec_options().values() if o.flag_value}
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in switches and (following is None or following.startswith("-")):
            out.append(switches[arg])
    return out


def _torch_default_threads() -> int:
    import torch

    return torch.get_num_threads()


# Set while a Slurm sweep's driver plans its grid: the configs run on other machines, so a device is checked for
# its form only (the job checks it again on its node), and `auto` cannot be resolved here.
DEVICES_ELSEWHERE: ContextVar[bool] = ContextVar("gcbench_devices_elsewhere", default=False)


def resolve_device(device: str) -> str:
    """The device every torch call of a run gets: "cpu" or an explicit "cuda:N" (torch refuses "cuda" without an
    index in set_device and set_per_process_memory_fraction). "auto" is cuda:0 when CUDA is available, else the CPU;
    "cuda" is cuda:0, the first visible device (CUDA_VISIBLE_DEVICES picks which that is)."""
    import torch

    elsewhere = DEVICES_ELSEWHERE.get()
    if device == "auto":
        if elsewhere:
            raise GcbenchError("--device auto: the jobs run on other machines, whose devices this one cannot see; "
                               "give --device cuda or --device cpu")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if m := re.fullmatch(r"cuda(?::(\d+))?", device):
        if elsewhere:
            return f"cuda:{int(m.group(1) or 0)}"
        if not torch.cuda.is_available():
            raise GcbenchError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        index = int(m.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise GcbenchError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        return f"cuda:{index}"
    raise GcbenchError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N)")


def _check_flash_attention(device: str, precision: str) -> None:
    """flash_attention_2 runs only on CUDA, in 16-bit, with the flash-attn package: refuse early, not mid-run."""
    if not device.startswith("cuda"):
        raise GcbenchError("--attn flash_attention_2 needs a CUDA device (on CPU use --attn eager or sdpa)")
    if precision == "fp32":
        raise GcbenchError("--attn flash_attention_2 needs 16-bit activations: use --precision bf16 or amp-bf16")
    if importlib.util.find_spec("flash_attn") is None:
        raise GcbenchError("--attn flash_attention_2 needs the flash-attn package (pip install flash-attn)")
