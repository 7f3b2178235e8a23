"""RunSpec: everything that defines one measured configuration, validated when it is made."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from gcbench.errors import GcbenchError
from gcbench.instruments import instrument_class
from gcbench.models import load_config, prepare_config
from gcbench.policies import Policy, parse_policy
from gcbench.units import parse_bytes  # noqa: F401  (re-exported for callers of spec.parse_bytes)

PRECISIONS = {
    # name: (parameter dtype, autocast dtype or None)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),  # pure bf16: params, grads and optimizer state in bf16
    "amp-bf16": (torch.float32, torch.bfloat16),  # fp32 master weights, bf16 matmuls under autocast
}
OPTIMIZERS = ("adamw", "sgd", "none")
ATTENTION = ("eager", "sdpa", "flash_attention_2")

def resolve_device(device: str) -> str:
    """The device every torch call of a run gets: "cpu" or an explicit "cuda:N" (torch refuses "cuda" without an
    index in set_device and set_per_process_memory_fraction). "auto" is cuda:0 when CUDA is available, else the CPU;
    "cuda" is cuda:0, the first visible device (CUDA_VISIBLE_DEVICES picks which that is)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if m := re.fullmatch(r"cuda(?::(\d+))?", device):
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


@dataclass(frozen=True)
class RunSpec:
    """One configuration to measure. Made only through validation: every field is concrete and legal."""

    model: str  # preset name or path to a Hugging Face config.json
    seq_len: int  # tokens per sample
    batch_size: int  # samples per step
    policy: Policy = field(default_factory=lambda: parse_policy("none"))
    layers: int | None = None  # keep only the first N blocks (activation memory is linear in N); None = all
    precision: str = ""  # fp32 | bf16 | amp-bf16; "" = bf16 on CUDA, fp32 on CPU
    optimizer: str = "adamw"  # adamw (2 states/param) | sgd (momentum: 1 state/param) | none (no step)
    device: str = "auto"  # auto | cpu | cuda[:N]; resolved when made: "cpu" or an explicit "cuda:N"
    attn: str | None = None  # attention implementation; None = sdpa
    warmup_steps: int = 3  # untimed, >= 1: step 1 creates gradients and optimizer state (and picks kernels)
    measure_steps: int = 10  # timed; the median is reported
    seed: int = 0
    # CPU: live tensor bytes (the tracker raises OOM past it); CUDA: the caching allocator's reserved bytes (a
    # per-process memory fraction). Records say which in `memory_cap_kind`.
    memory_cap_bytes: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        if isinstance(self.policy, str):
            set_("policy", parse_policy(self.policy))
        for name in ("seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise GcbenchError(f"--{name.split('_')[0]} must be a positive integer, got {value}")
        if self.warmup_steps < 1:
            raise GcbenchError(f"--warmup must be at least 1, got {self.warmup_steps}: the first step creates "
                               "gradients and optimizer state, so it cannot be a measured one")
        if self.measure_steps < 1:
            raise GcbenchError(f"--steps must be at least 1, got {self.measure_steps}")
        set_("device", resolve_device(self.device))
        if not self.precision:
            set_("precision", "bf16" if self.device.startswith("cuda") else "fp32")
        if self.precision not in PRECISIONS:
            raise GcbenchError(f"unknown precision {self.precision!r} ({', '.join(PRECISIONS)})")
        if self.optimizer not in OPTIMIZERS:
            raise GcbenchError(f"unknown optimizer {self.optimizer!r} ({', '.join(OPTIMIZERS)})")
        if self.attn is not None and self.attn not in ATTENTION:
            raise GcbenchError(f"unknown attention implementation {self.attn!r} ({', '.join(ATTENTION)})")
        if self.attn == "flash_attention_2":
            _check_flash_attention(self.device, self.precision)
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise GcbenchError("--memory-cap must be positive")
        config, _ = self.model_config()
        self.policy.validate(config.num_hidden_layers)

    def model_config(self):
        """(config, family) with this run's layers, sequence length and attention applied."""
        config, family = load_config(self.model)
        return prepare_config(config, family, layers=self.layers, seq_len=self.seq_len, attn=self.attn), family

    @property
    def param_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision][0]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision][1]

    def as_record(self) -> dict[str, Any]:
        """The spec's fields as they appear in a Record (flat, JSON-ready)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["policy"] = self.policy.name
        out["policy_options"] = self.policy.options()
        # What --memory-cap limits on this device: live tensor bytes (CPU) or reserved bytes (CUDA); None: no cap.
        out["memory_cap_kind"] = instrument_class(self.device).memory_cap_kind if self.memory_cap_bytes else None
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunSpec:
        """The spec back from `as_record()` or a stored Record (extra keys ignored), validated again: the JSON
        round trip a sweep uses to hand a spec to its child process and to match records when resuming."""
        values = {f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record}
        policy = parse_policy(str(record.get("policy", "none")))
        try:
            values["policy"] = dataclasses.replace(policy, **(record.get("policy_options") or {}))
        except TypeError:
            raise GcbenchError(f"record has options {record.get('policy_options')!r} that policy "
                               f"{policy.name!r} does not take") from None
        return cls(**values)
