"""Every run field, declared once: its name, kind of value, default, help, flag and what it means to a reader.

A field's line in RUN_FIELDS is the only place its facts are written. Derived from it:
- RunSpec (spec.py): a frozen dataclass with one attribute per field, each value checked by its kind;
- the command line (cli_options.py): `--flag` with its help and metavar on `run`, `sweep`, `fit`, `estimate`;
- sweep TOML keys and grids (grid.py): `flag = value` or `flag = [values]`, parsed by the same kind;
- the record (results/schema.py): a column per field, the identity a sweep resumes by, what older records held;
- the frame and the report (results/frame.py, report/): the columns, the group a record is compared in, and the
  few words a setup is named by in every table.

One parser per kind of value (values.py: `Int`, `Switch`, `Size`, `Choice`, ...), shared by the command line, TOML
files and Python callers: `on`, `true` and a TOML `true` are one value wherever a switch is taken.
Imports nothing above it and nothing heavy: `gcbench --help` reads it without torch.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.optimizers import OPTIMIZERS
from gcbench.units import fmt_bytes, plural
from gcbench.values import (AUTO, Choice, Device, Int, IntOrAuto, Kind, Name, OptionText, PolicyText, Seconds, Size, Switch)

# --steps auto: the most timed steps, a bound on a record's size (it keeps every step), not on the 10 s the steps
# must span (timing.MIN_SPAN_S): steps down to 1 ms still span it. At 1000, steps under 10 ms stopped before it
# (docs/methodology.md, "What a rerun would see")
DEFAULT_MAX_STEPS = 10_000
DEFAULT_MAX_TIME_S = 10.0  # --steps auto: seconds of timed steps after which it stops
PRECISIONS = {
    # name: (parameter dtype, autocast dtype or None), as torch attribute names
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),  # pure bf16: params, grads and optimizer state in bf16 (AdamW: 8 B/param)
    "amp-bf16": ("float32", "bfloat16"),  # fp32 master weights, grads and state, bf16 matmuls (AdamW: 16 B/param)
    # as amp-bf16 with fp16 matmuls and a gradient scaler (torch.amp.GradScaler; step.TrainingStep)
    "amp-fp16": ("float32", "float16"),
}
ATTENTION = ("eager", "sdpa", "flash_attention_2")
HEADS = ("lm", "seq-cls")  # models.auto_class: the language-model head, or a sequence classifier


class DeviceKind(enum.StrEnum):
    """What kind of device a device string names: "cuda", "cuda:N" -> CUDA; "cpu" -> CPU. A str, so that a record's
    or a table's "cuda" is the same value."""

    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, device: Any) -> DeviceKind:
        return cls.CUDA if str(device).split(":")[0] == cls.CUDA else cls.CPU


def default_precision(device: Any) -> str:
    """--precision left unset: pure bf16 on a GPU, fp32 on a CPU."""
    return "bf16" if DeviceKind.of(device) is DeviceKind.CUDA else "fp32"


SHARDS = ("none", "fsdp2")
COMPILES = ("none", "blocks")


# --------------------------------------------------------------------------------------------------- a field

class Role(enum.Enum):
    """What a field is to a reader of results: it decides the tables a record lands in and the words it gets."""

    MODEL = "model"  # which model: a table or a setup is named by it first
    SHAPE = "shape"  # seq_len, batch_size: records are compared within one shape
    POLICY = "policy"  # the checkpoint policy: a row per policy, ratios against `none`
    LEVER = "lever"  # a memory lever beside the policy: part of the setup, named in every table's title or column
    SETUP = "setup"  # the rest of what defines a measured configuration: part of the setup's name where set
    DEVICE = "device"  # where it runs: the device label (GPU name, or CPU, cores and threads)
    LENGTH = "length"  # how long to measure, not what: two runs differing only in these measure the same thing


Words = Callable[[Any, Mapping[str, Any]], str]  # (value, the whole record) -> a few words, "" to say nothing


@dataclass(frozen=True)
class Field:
    """One run field. Its name is RunSpec's attribute and the record's column; `flag` is the option without dashes
    and the TOML key."""

    name: str
    flag: str
    kind: Kind
    help: str
    default: Any = dataclasses.field(default_factory=lambda: dataclasses.MISSING)  # MISSING: must be given
    role: Role = Role.SETUP
    axis: bool = False  # `gcbench estimate` takes several values of it (a sweep takes several of every field)
    estimate: bool = False  # `gcbench estimate` takes it (every axis too): it changes the predicted memory
    ascending: bool = False  # a sweep runs its values smallest first, so that an OOM can skip the larger ones
    flag_value: str | None = None  # the value of the bare flag (`--optim-in-backward` = `--optim-in-backward on`)
    identity: bool = True  # part of a configuration's identity (resume, the OOM skip rule, compare)
    required: bool = False  # a reader cannot place a record without it (results.schema.record_problem)
    words: Words | None = None  # how its value reads in a setup's name; None: not named there
    unset: str = ""  # its words where a column must show a value that was left at its default ("all layers")
    added: tuple[int, Any] | None = None  # (schema version it came in, what records before it measured)
    short: str = ""  # a table column's heading where its flag is too long ("in bwd"); "": the flag
    # `gcbench fit --levers` (fits/levers.py): the values a plan tries (None: not a lever it searches; (): derived),
    # and `plan_role`: "class" (changes a step's FLOPs; a plan compares candidates within one policy and adapter),
    # "flops" (changes the FLOPs), "named" (searched only where --levers names it), "" (memory only)
    plan: tuple[Any, ...] | None = None
    plan_role: str = ""

    @property
    def heading(self) -> str:
        return self.short or self.flag

    @property
    def annotation(self) -> str:
        kind_type = self.kind.python_type
        return f"{kind_type} | None" if self.default is None else kind_type

    def parse(self, value: Any) -> Any:
        """One value, as its kind reads it; the default as it is (None and "" stand for a rule: auto, all)."""
        if self.default is not dataclasses.MISSING and value == self.default and type(value) is type(self.default):
            return value
        try:
            return self.kind.parse(value)
        except GcbenchError as e:
            raise GcbenchError(f"--{self.flag}: {e}") from None

    def parse_many(self, value: Any) -> tuple[Any, ...]:
        """Values from a comma string, a list, or one scalar; no duplicates (each config would run twice)."""
        try:
            items = self.kind.split(value) if isinstance(value, str) else list(value) \
                if isinstance(value, (list, tuple)) else [value]
        except GcbenchError as e:
            raise GcbenchError(f"--{self.flag}: {e}") from None
        if not items:
            raise GcbenchError(f"--{self.flag}: no values: the grid would be empty")
        values = [self.parse(v) for v in items]
        for i, v in enumerate(values):
            if any(v == w and type(v) is type(w) for w in values[:i]):
                raise GcbenchError(f"--{self.flag}: duplicate value {v} (each config would run twice)")
        return tuple(sorted(values)) if self.ascending else tuple(values)

    def text(self, record: Mapping[str, Any]) -> str:
        """Its value in `record` in a few words; "" where it says nothing (a default, or a field not named)."""
        return self.words(record.get(self.name), record) if self.words else ""


def _named(template: str) -> Words:
    """Words for a value that is named whenever it is set: "{} layers", "attn {}"."""
    return lambda value, record: template.format(value) if value is not None else ""


def _accumulation(value: Any, record: Mapping[str, Any]) -> str:
    return f"{int(value)} micro-batches" if isinstance(value, (int, float)) and value == value and value > 1 else ""


def _counted(noun: str) -> Words:
    """Words for a count that is named whenever it is set: "1 layer", "8 layers"."""
    return lambda value, record: plural(value, noun) if value is not None else ""


def _ranks(value: Any, record: Mapping[str, Any]) -> str:
    sharded = record.get("shard") not in (None, "none")
    return plural(int(value), "rank") if isinstance(value, (int, float)) and (value > 1 or sharded) else ""


def _as_is(value: Any, record: Mapping[str, Any]) -> str:
    return "" if value is None else str(value)


RUN_FIELDS: tuple[Field, ...] = (
    Field("model", "model", Name(), "preset name (see `gcbench models`), path to a config.json, or a Hugging Face "
          "Hub id owner/name[@revision] (its config.json only)", role=Role.MODEL, axis=True, required=True),
    Field("seq_len", "seq", Int(), "sequence length in tokens", role=Role.SHAPE, axis=True, ascending=True,
          required=True),
    Field("batch_size", "batch", Int(), "samples per step", role=Role.SHAPE, axis=True, ascending=True,
          required=True),
    Field("policy", "policy", PolicyText(), "checkpoint policy: name or name:key=value (see `gcbench policies`)",
          "none", role=Role.POLICY, axis=True, required=True, plan=("none", "full", "sac"), plan_role="class"),
    Field("layers", "layers", Int(1, 1_000), "keep only the first N blocks (activation memory is linear in N; "
          "default: all)", None, estimate=True, words=_counted("layer"), unset="all layers"),
    Field("images", "images", Int(1, 64), "images per sample of a vision-language model (llava, gemma3): each adds "
          "the tokens its vision tower makes to the language model's sequence, beside --seq's text tokens (default: "
          "1; refused for a model without a vision tower)", None, estimate=True, added=(6, None),
          words=_counted("image")),
    Field("target_len", "target-len", Int(1, 1_000_000), "an encoder-decoder's target tokens per sample, the "
          "decoder's length (T5, BART, Whisper; default: as long as --seq, at most the decoder's learned positions: "
          "Whisper's 448)", None, axis=True, ascending=True, added=(6, None),
          words=lambda value, record: f"target {value}" if value is not None else "", unset="target default"),
    Field("precision", "precision", Choice(tuple(PRECISIONS), "precision"), "fp32 | bf16 (pure: weights, grads and "
          "optimizer state in bf16) | amp-bf16 (fp32 weights, grads and state; bf16 autocast) | amp-fp16 (the same "
          "with fp16 autocast and a gradient scaler) (default: bf16 on CUDA, fp32 on CPU)", "", role=Role.LEVER,
          axis=True, words=_as_is, plan=("bf16", "amp-bf16"), plan_role="named"),
    Field("optimizer", "optimizer", Choice(tuple(OPTIMIZERS), "optimizer"), f"{' | '.join(OPTIMIZERS)} "
          "(docs/levers.md; adamw8bit and the paged ones need bitsandbytes)", "adamw", role=Role.LEVER, axis=True,
          words=_as_is, plan=("adamw", "adamw8bit", "paged_adamw8bit", "adafactor")),
    Field("optim_in_backward", "optim-in-backward", Switch(), "step each parameter inside backward as soon as its "
          "gradient is complete, then drop that gradient (no full set of gradients at once); on | off", False,
          role=Role.LEVER, axis=True, flag_value="on", added=(2, False), short="in bwd",
          words=lambda value, record: "optimizer in backward" if value is True else "", plan=(False, True)),
    Field("grad_accum", "grad-accum", Int(1, 65_536), "micro-batches of --batch per optimizer step (gradient "
          "accumulation: the memory of one micro-batch, the tokens of all)", 1, role=Role.LEVER, axis=True,
          ascending=True, added=(2, 1), short="accum", words=_accumulation, plan=()),
    Field("adapter", "adapter", OptionText("an adapter"), "none | lora (options r=16 alpha=32 dropout=0.05 "
          "targets=all-linear by default, given as lora:r=8,alpha=16) | dora (lora's options) | qlora (lora's and "
          "skip=a+b: LoRA on a 4-bit NF4 base: every linear layer but the head, as "
          "transformers quantises it; bitsandbytes): a frozen base with trainable "
          "adapters through peft (docs/levers.md)", "none", role=Role.LEVER, axis=True, added=(4, "none"),
          words=lambda value, record: "" if value in (None, "none") else str(value), plan=("none", "lora", "qlora"),
          plan_role="class"),
    Field("loss", "loss", OptionText("a loss"), "ce (the model's own: full logits) | chunked[:n=8] (cross-entropy "
          "over n chunks of the sequence, each chunk's logits recomputed in backward: the full logits never exist) "
          "| litgpt[:len=128] (LitGPT's fine-tuning scripts': the head on slices of len positions, every slice's "
          "logits kept in fp32 through the backward) | fused-linear (liger-kernel's fused linear cross-entropy; "
          "CUDA)", "ce", role=Role.LEVER, axis=True,
          added=(4, "ce"), words=lambda value, record: "" if value in (None, "ce") else f"loss {value}",
          plan=("ce", "chunked"), plan_role="flops"),
    Field("compile", "compile", Choice(COMPILES, "compile mode"), "none | blocks (torch.compile each block after "
          "the policy wraps it, as torchtitan and torchtune do)", "none", role=Role.LEVER, axis=True,
          added=(4, "none"), words=lambda value, record: "" if value in (None, "none") else "compiled blocks",
          plan=("none", "blocks"), plan_role="named"),  # named only: not in auto while compile is not predicted
    Field("shard", "shard", Choice(SHARDS, "shard"), "none | fsdp2: parameters, gradients and optimizer state "
          "sharded over --nproc ranks (FSDP2 on each block and the root; --batch is per rank)", "none",
          role=Role.LEVER, axis=True, added=(3, "none"),
          words=lambda value, record: "" if value in (None, "none") else str(value)),
    Field("nproc", "nproc", Int(1, 4096), "ranks of a sharded run, started by torchrun: one GPU each (cuda:N, N+1, "
          "...), or CPU processes talking through gloo", 1, role=Role.LEVER, axis=True, ascending=True,
          added=(3, 1), short="ranks", words=_ranks),
    # resolved when a spec is made: "cpu" or an explicit "cuda:N"
    Field("device", "device", Device(), "auto | cpu | cuda[:N]; auto is cuda:0 when there is a GPU", AUTO,
          role=Role.DEVICE, required=True),
    Field("attn", "attn", Choice(ATTENTION, "attention implementation"), "attention implementation: eager | sdpa "
          "(default: sdpa where the model's family has it, else eager)", None, estimate=True,
          words=_named("attn {}"), unset="attn default"),
    Field("head", "head", Choice(HEADS, "head"), "the head trained: lm (the model's language-model head: causal, or "
          "masked for an encoder) | seq-cls (transformers' sequence-classification head: a classifier of the "
          "config's num_labels classes on one token, one label per sequence)", "lm", role=Role.LEVER, axis=True,
          added=(5, "lm"),
          words=lambda value, record: "seq-cls head" if value == "seq-cls" else ""),
    Field("warmup_steps", "warmup", Int(1, 1_000_000, "the first step creates gradients and optimizer state, so it "
          "cannot be a measured one"), "untimed warm-up steps, at least 1: step 1 creates gradients and optimizer "
          "state", 3, role=Role.LENGTH),
    Field("measure_steps", "steps", IntOrAuto(1, 1_000_000), "timed steps: auto (spanning 10 s or --max-time if "
          "shorter, then until the median's 95% interval is within +-2%, +-1% on CUDA: at least 6 steps, at most "
          "--max-steps or --max-time) or a number", AUTO, role=Role.LENGTH),
    Field("max_steps", "max-steps", Int(1, 1_000_000), "with --steps auto: the most timed steps", DEFAULT_MAX_STEPS,
          role=Role.LENGTH),
    Field("max_time_s", "max-time", Seconds(), "with --steps auto: seconds of timed steps after which it stops (at "
          "least 6 steps run)", DEFAULT_MAX_TIME_S, role=Role.LENGTH),
    Field("predict", "predict", Switch(), "also predict the peak by the fake-tensor simulation before the run (on "
          "CPU exact; about a second for a tiny model, seconds for 7B); without it a record carries the analytic "
          "prediction only (instant, the classic policies)", False, role=Role.LENGTH, flag_value="on",
          identity=False),
    Field("threads", "threads", IntOrAuto(1, 4096), "torch CPU threads: auto (CPU: the available cores but one; "
          "CUDA: torch's default) or a number", None, role=Role.DEVICE),
    Field("seed", "seed", Int(0, 2**63 - 1), "seed for weights, batch and dropout", 0,
          words=lambda value, record: f"seed {int(value)}" if value not in (None, 0) and value == value else ""),
    # Records say which limit applies in `memory_cap_kind`.
    Field("memory_cap_bytes", "memory-cap", Size(), "memory limit, e.g. 2GiB (CPU: live tensor bytes; CUDA: the "
          "allocator's reserved bytes)", None,
          words=lambda value, record: f"memory cap {fmt_bytes(value)}" if value and value == value else ""),
)

# Record columns a spec adds beyond its fields: the policy's options beside its name, and what --memory-cap limits
# on the record's device ("tracked" on CPU, "reserved" on CUDA, None without a cap; derived from the device).
POLICY_OPTIONS = "policy_options"
DERIVED_TYPES: dict[str, Any] = {POLICY_OPTIONS: dict[str, str | int | float], "memory_cap_kind": str}
DERIVED_COLUMNS = tuple(DERIVED_TYPES)


def run_field(name: str) -> Field:
    """The declaration of the run field `name`."""
    return BY_NAME[name]


BY_NAME: dict[str, Field] = {f.name: f for f in RUN_FIELDS}
ESTIMATE_AXES = tuple(f.name for f in RUN_FIELDS if f.axis)  # `gcbench estimate` takes several values of these
ESTIMATE_FIELDS = tuple(f.name for f in RUN_FIELDS if f.axis or f.estimate)  # and one value of these
# `gcbench estimate`'s sizes where none is given (a run and a sweep ask for them; --fit searches one of them)
ESTIMATE_SIZES = {"seq_len": 2048, "batch_size": 1}
BY_FLAG: dict[str, Field] = {f.flag: f for f in RUN_FIELDS}


def names(*roles: Role) -> tuple[str, ...]:
    """The run fields of these roles (all without one), in declaration order."""
    return tuple(f.name for f in RUN_FIELDS if not roles or f.role in roles)


def spec_columns() -> tuple[str, ...]:
    """A record's spec columns, in order: every field, then the derived ones."""
    return (*names(), *DERIVED_COLUMNS)


def identity_columns() -> tuple[str, ...]:
    """The columns that make two records one configuration (resume, the OOM skip rule, compare)."""
    return (*(f.name for f in RUN_FIELDS if f.identity), POLICY_OPTIONS)


def setup_words(record: Mapping[str, Any], roles: tuple[Role, ...] = (Role.LEVER, Role.SETUP),
                leave_out: tuple[str, ...] = ()) -> str:
    """The fields of `roles` set in `record`, in a few words each, in declaration order: "32 layers · bf16 · adamw
    · optimizer in backward · 4 micro-batches · memory cap 2 GiB"."""
    return " · ".join(w for f in RUN_FIELDS if f.role in roles and f.name not in leave_out if (w := f.text(record)))
