"""RunSpec: one configuration to measure, made from the run fields' declaration (fields.py), validated when made.

RunSpec has one attribute per field of fields.RUN_FIELDS, in that order, each read by its field's kind (so a value
typed on the command line, written in a TOML file or passed from Python is the same value); what concerns several
fields at once (the optimizer in backward with accumulation, sharding and its ranks), and what needs the machine
(the device, the model's config) is checked here. A new field is declared in fields.py alone.
Importing this module is cheap (no torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, POLICY_OPTIONS, PRECISIONS, RUN_FIELDS, DeviceKind
from gcbench.optimizers import optimizer_kind
from gcbench.timing import StepBudget, default_threads
from gcbench.values import AUTO

if TYPE_CHECKING:
    import torch


class _RunSpecMethods:
    """What a RunSpec does beyond holding its fields (the fields themselves are declared in fields.py)."""

    def __post_init__(self) -> None:
        from gcbench.policies import parse_policy

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        for field in RUN_FIELDS:
            set_(field.name, field.parse(getattr(self, field.name)))
        if isinstance(self.policy, str):
            set_("policy", parse_policy(self.policy))
        set_("device", resolve_device(self.device))
        if self.threads in (None, AUTO):
            set_("threads", default_threads() if self.device == "cpu" else _torch_default_threads())
        if not self.precision:
            set_("precision", "bf16" if DeviceKind.of(self.device) is DeviceKind.CUDA else "fp32")
        kind = optimizer_kind(self.optimizer)
        if self.optim_in_backward and not kind.steps:
            raise GcbenchError("--optim-in-backward needs an optimizer to step; --optimizer none has none")
        if self.optim_in_backward and self.grad_accum > 1:
            raise GcbenchError(f"--optim-in-backward steps each parameter as soon as its gradient is complete, so "
                               f"gradients cannot accumulate over --grad-accum {self.grad_accum} micro-batches: "
                               f"use one or the other")
        if self.attn == "flash_attention_2":
            _check_flash_attention(self.device, self.precision)
        self._check_sharding()
        config, _ = self.model_config()
        self.policy.validate(config.num_hidden_layers)

    def _check_sharding(self) -> None:
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
        from gcbench.fsdp import in_rank  # a rank's spec names its own GPU: the launcher checked the count

        if DeviceKind.of(self.device) is DeviceKind.CUDA and not DEVICES_ELSEWHERE.get() and not in_rank():
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
    def device_kind(self) -> DeviceKind:
        """CUDA or CPU (fields.DeviceKind, a str: "cuda" | "cpu")."""
        return DeviceKind.of(self.device)

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
        """The spec's fields as they appear in a record (fields.spec_columns: flat, JSON-ready)."""
        from gcbench.instruments import instrument_class

        out = {field.name: getattr(self, field.name) for field in RUN_FIELDS}
        out["policy"] = self.policy.name
        out[POLICY_OPTIONS] = self.policy.options()
        # What --memory-cap limits on this device: live tensor bytes (CPU) or reserved bytes (CUDA); None: no cap.
        out["memory_cap_kind"] = instrument_class(self.device).memory_cap_kind if self.memory_cap_bytes else None
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunSpec:
        """The spec back from `as_record()` or a stored record (extra keys ignored), validated again: the JSON
        round trip a sweep uses to hand a spec to its child process."""
        from gcbench.policies import parse_policy

        values = {name: record[name] for name in BY_NAME if name in record}
        policy = parse_policy(str(record.get("policy", "none")))
        try:
            values["policy"] = dataclasses.replace(policy, **(record.get(POLICY_OPTIONS) or {}))
        except TypeError:
            raise GcbenchError(f"record has options {record.get(POLICY_OPTIONS)!r} that policy "
                               f"{policy.name!r} does not take") from None
        return cls(**values)


def _dataclass_field(field) -> dataclasses.Field:
    if field.default is dataclasses.MISSING:
        return dataclasses.field(metadata={"field": field})
    return dataclasses.field(default=field.default, metadata={"field": field})


RunSpec = dataclasses.make_dataclass(
    "RunSpec", [(f.name, f.annotation, _dataclass_field(f)) for f in RUN_FIELDS], bases=(_RunSpecMethods,),
    frozen=True)
RunSpec.__module__ = __name__  # pickled by name: a sweep's child and a Slurm job receive specs
RunSpec.__doc__ = ("One configuration to measure: one attribute per run field (fields.RUN_FIELDS, where each is "
                   "declared with its help and unit). Made only through validation: every field is concrete and "
                   "legal (device resolved, threads counted, precision chosen, the policy parsed).")


def crossed_out(fields: Mapping[str, Any], values: Mapping[str, Sequence[Any]]) -> bool:
    """Whether a grid that crosses several values leaves this combination out: the optimizer in backward with
    accumulation, or several ranks without sharding. Given alone, such a combination is an error (RunSpec says)."""
    varies = lambda *names: any(len(values.get(n, ())) > 1 for n in names)  # noqa: E731
    in_backward = fields.get("optim_in_backward") and fields.get("grad_accum", 1) > 1
    if varies("optim_in_backward", "grad_accum") and in_backward:
        return True
    return varies("shard", "nproc") and fields.get("shard", "none") == "none" and fields.get("nproc", 1) > 1


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
    if DeviceKind.of(device) is not DeviceKind.CUDA:
        raise GcbenchError("--attn flash_attention_2 needs a CUDA device (on CPU use --attn eager or sdpa)")
    if precision == "fp32":
        raise GcbenchError("--attn flash_attention_2 needs 16-bit activations: use --precision bf16 or amp-bf16")
    if importlib.util.find_spec("flash_attn") is None:
        raise GcbenchError("--attn flash_attention_2 needs the flash-attn package (pip install flash-attn)")
