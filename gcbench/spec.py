"""RunSpec: one configuration to measure, as a plain value made from the run fields' declaration (fields.py).

RunSpec has one attribute per field of fields.RUN_FIELDS, in that order, each read by its field's kind (so a value
typed on the command line, written in a TOML file or passed from Python is the same value), and checks what
concerns several fields at once (the optimizer in backward with accumulation, sharding and its ranks). It looks
nothing up: the device, the threads, the precision's default, the policy and the model's config are resolved.py's
(`resolve(spec)` -> a ResolvedRun). A new field is declared in fields.py alone.
Importing this module is cheap (no torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gcbench.adapters import parse_adapter
from gcbench.errors import GcbenchError
from gcbench.fields import BY_NAME, RUN_FIELDS, DeviceKind
from gcbench.optimizers import optimizer_kind


class _RunSpecMethods:
    """What a RunSpec checks and answers beyond holding its fields (the fields themselves are in fields.py)."""

    def __post_init__(self) -> None:
        for field in RUN_FIELDS:  # frozen: normalised in place, once, when made
            object.__setattr__(self, field.name, field.parse(getattr(self, field.name)))
        if self.optim_in_backward and not optimizer_kind(self.optimizer).steps:
            raise GcbenchError("--optim-in-backward needs an optimizer to step; --optimizer none has none")
        if self.optim_in_backward and self.grad_accum > 1:
            raise GcbenchError(f"--optim-in-backward steps each parameter as soon as its gradient is complete, so "
                               f"gradients cannot accumulate over --grad-accum {self.grad_accum} micro-batches: "
                               f"use one or the other")
        if self.shard == "none" and self.nproc > 1:
            raise GcbenchError(f"--nproc {self.nproc} needs --shard fsdp2: gcbench measures sharded training "
                               "(per-rank memory), not plain data parallel")
        if self.shard != "none" and optimizer_kind(self.optimizer).module == "bitsandbytes":
            raise GcbenchError(f"--optimizer {self.optimizer} with --shard fsdp2 is not supported: bitsandbytes' "
                               "optimizers step plain tensors, FSDP2's parameters are DTensors")
        if self.precision == "amp-fp16" and self.optim_in_backward:
            raise GcbenchError("--optim-in-backward steps each parameter inside backward, before a gradient scaler "
                               "could check every gradient for inf/NaN: not with --precision amp-fp16")
        if self.precision == "amp-fp16" and self.shard != "none":
            raise GcbenchError("--precision amp-fp16 with --shard fsdp2 is not supported: FSDP2 needs fp16 gathers "
                               "and a ShardedGradScaler, which gcbench does not set up; use amp-bf16 or bf16")
        if self.shard != "none" and self.optim_in_backward:
            raise GcbenchError("--optim-in-backward steps plain parameters inside backward; FSDP2's are sharded "
                               "(DTensors) and reduce-scattered after it: not with --shard fsdp2")

    def check_runnable(self) -> None:
        """GcbenchError when this machine cannot run the config: a package its optimizer or adapter needs is not
        installed. Not part of validation: `gcbench estimate` predicts such a config without the package."""
        optimizer_kind(self.optimizer).check_installed()
        parse_adapter(self.adapter).check_installed()

    @property
    def device_kind(self) -> DeviceKind:
        """CUDA or CPU (fields.DeviceKind, a str: "cuda" | "cpu"); `auto` reads as CPU until resolved."""
        return DeviceKind.of(self.device)


def _dataclass_field(field) -> dataclasses.Field:
    if field.default is dataclasses.MISSING:
        return dataclasses.field(metadata={"field": field})
    return dataclasses.field(default=field.default, metadata={"field": field})


RunSpec = dataclasses.make_dataclass(
    "RunSpec", [(f.name, f.annotation, _dataclass_field(f)) for f in RUN_FIELDS], bases=(_RunSpecMethods,),
    frozen=True)
RunSpec.__module__ = __name__  # pickled by name: a sweep's child and a Slurm job receive specs
RunSpec.__doc__ = ("One configuration to measure, as given: one attribute per run field (fields.RUN_FIELDS, where "
                   "each is declared with its help and unit), each value checked by its kind. A plain value: "
                   "resolved.resolve(spec) looks up what it names (device, policy, model config).")


def crossed_out(fields: Mapping[str, Any], values: Mapping[str, Sequence[Any]]) -> bool:
    """Whether a grid that crosses several values leaves this combination out: the optimizer in backward with
    accumulation, several ranks without sharding, a bitsandbytes optimizer with sharding, or amp-fp16 with either
    the optimizer in backward or sharding. Given alone, such a combination is an error (RunSpec says)."""
    varies = lambda *names: any(len(values.get(n, ())) > 1 for n in names)  # noqa: E731
    in_backward = fields.get("optim_in_backward") and fields.get("grad_accum", 1) > 1
    if varies("optim_in_backward", "grad_accum") and in_backward:
        return True
    bitsandbytes_sharded = fields.get("shard", "none") != "none" and \
        optimizer_kind(fields.get("optimizer", "adamw")).module == "bitsandbytes"
    if varies("shard", "optimizer") and bitsandbytes_sharded:
        return True
    scaled = fields.get("precision") == "amp-fp16" and (fields.get("optim_in_backward")
                                                        or fields.get("shard", "none") != "none")
    if varies("precision", "optim_in_backward", "shard") and scaled:
        return True
    return varies("shard", "nproc") and fields.get("shard", "none") == "none" and fields.get("nproc", 1) > 1


# The most configurations one grid may hold (a sweep's, an estimate's): past it a grid is a typo or a script's range
# (every seq from 16 to 215 by every batch from 1 to 200), not a plan, and expanding it hung with no word. A sweep
# runs each config in a process of its own (seconds to minutes); resolving alone is about 1.4 ms a config (a 5,000
# config dry run: 7 s on this project's 2-core machine).
MAX_GRID = 10_000


def check_grid_size(values: Mapping[str, Sequence[Any]], split: str = "split it into several commands") -> None:
    """Refuse a grid (field name -> its values) of more than MAX_GRID combinations, before any is made; `split`
    says how to run it instead."""
    n = math.prod(len(v) for v in values.values())
    if n > MAX_GRID:
        axes = " x ".join(f"{len(v):,} --{BY_NAME[name].flag}" for name, v in values.items() if len(v) > 1)
        raise GcbenchError(f"the grid holds {n:,} combinations ({axes}): at most {MAX_GRID:,} in one command; "
                           f"{split}")
