"""The one step that looks things up: a RunSpec (a plain value) -> a ResolvedRun every later stage reads.

`resolve` is where a run meets the machine and the registries, once: the device (`auto` -> cuda:0 or cpu, a GPU
that exists), the threads and the precision their rules choose, the policy parsed and checked against the model's
blocks, the model's config read (a preset, a config.json, a Hub id) and prepared (layers, sequence length,
attention). The runner, the estimators, a sweep and a fit all take the ResolvedRun: none of them parses the policy
or builds the config again. A config.json or a Hub config is read once per process (`_raw_config`); a run that
differs only in its batch or its policy reuses its prepared config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gcbench.compiled import check_compile
from gcbench.errors import GcbenchError
from gcbench.fields import POLICY_OPTIONS, PRECISIONS, DeviceKind, default_precision, run_field
from gcbench.results.schema import config_key
from gcbench.spec import RunSpec
from gcbench.timing import TARGET_HALF_WIDTH, StepBudget, cores_available, default_threads
from gcbench.values import AUTO

if TYPE_CHECKING:
    import torch

    from gcbench.policies import Policy


@dataclass(frozen=True, eq=False)
class ResolvedRun:
    """A RunSpec with everything it names looked up: `spec` holds concrete values (device "cpu" or "cuda:N",
    threads, precision), `policy` the parsed policy, `config` the model's prepared config and `family` its
    model_type. A field of the spec reads as the run's own (`run.seq_len`); `run.policy` is the Policy object.
    Equal, and hashed, by its spec and policy (the config follows from them)."""

    spec: RunSpec
    policy: Policy
    config: Any  # transformers.PretrainedConfig with this run's layers, sequence length and attention applied
    family: str

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy and pickle ask for dunders before the fields exist
            raise AttributeError(name)
        return getattr(self.spec, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResolvedRun) and (self.spec, self.policy) == (other.spec, other.policy)

    def __hash__(self) -> int:
        return hash((self.spec, self.policy))

    def __repr__(self) -> str:
        return f"ResolvedRun({self.spec!r})"

    def replace(self, **changes: Any) -> ResolvedRun:
        """This run with some fields changed, resolved again (the config rebuilt only when it depends on them)."""
        changes.setdefault("policy", self.policy)
        spec = dataclasses.replace(self.spec, **changes)
        same_model = config_fields(spec) == config_fields(self.spec)
        return resolve(spec, config=(self.config, self.family) if same_model else None)

    def check_runnable(self, here: bool = True) -> None:
        """GcbenchError when this machine cannot run the config (RunSpec.check_runnable), or, `here` (it runs on
        this machine, not a Slurm job's), when the CPU ranks of a sharded run outnumber its cores: each rank is a
        process stepping its share, and ranks taking turns on a core wait for each other at every collective."""
        self.spec.check_runnable()
        if self.spec.loss == "fused-linear":  # liger-kernel's Triton kernel: CUDA only
            from gcbench.losses import CPU_REFUSAL, liger_missing

            if self.device_kind is DeviceKind.CPU:
                raise GcbenchError(CPU_REFUSAL)
            if here and (missing := liger_missing()):
                raise GcbenchError(missing)
        if here and self.spec.shard != "none" and self.device_kind is DeviceKind.CPU:
            from gcbench.fsdp import in_rank

            if not in_rank() and self.spec.nproc > (cores := cores_available()):
                raise GcbenchError(f"--nproc {self.spec.nproc}: CPU ranks need a core each, and {cores} "
                                   f"core{'s are' if cores != 1 else ' is'} available here")

    def model_config(self) -> tuple[Any, str]:
        """(config, family): the prepared config, built once when the run was resolved."""
        return self.config, self.family

    @property
    def device_kind(self) -> DeviceKind:
        return DeviceKind.of(self.spec.device)

    @property
    def budget(self) -> StepBudget:
        """How many steps to time (timing.StepBudget)."""
        fixed = None if self.spec.measure_steps == AUTO else self.spec.measure_steps
        return StepBudget(fixed, self.spec.max_steps, float(self.spec.max_time_s), TARGET_HALF_WIDTH[self.device_kind])

    @property
    def param_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, PRECISIONS[self.spec.precision][0])

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        name = PRECISIONS[self.spec.precision][1]
        return getattr(torch, name) if name else None

    def as_record(self) -> dict[str, Any]:
        """The run's fields as a record stores them (fields.spec_columns: flat, JSON-ready): the policy's name,
        its options beside it, and what --memory-cap limits on this device."""
        from gcbench.instruments import instrument_class

        out = {f.name: getattr(self.spec, f.name) for f in dataclasses.fields(self.spec)}
        out["policy"] = self.policy.name
        out[POLICY_OPTIONS] = self.policy.options()
        # What --memory-cap limits on this device: live tensor bytes (CPU) or reserved bytes (CUDA); None: no cap.
        out["memory_cap_kind"] = instrument_class(self.spec.device).memory_cap_kind if self.memory_cap_bytes else None
        return out


def resolve(spec: RunSpec | ResolvedRun, *, devices_here: bool = True,
            config: tuple[Any, str] | None = None) -> ResolvedRun:
    """Look up what `spec` names; GcbenchError in one line for what this machine or the model cannot do.

    `devices_here=False`: the run goes to another machine (a Slurm job), so its device is checked for its form
    only and `auto` is refused. In a rank of a sharded run, the GPU count is not checked again (its launcher did).
    `config`: the prepared (config, family), when the caller has it for the same model, layers, seq and attention.
    """
    if isinstance(spec, ResolvedRun):
        return spec
    from gcbench.policies import Policy, parse_policy

    try:
        policy = spec.policy if isinstance(spec.policy, Policy) else parse_policy(spec.policy)
    except GcbenchError as e:
        raise GcbenchError(f"--policy: {e}") from None
    device = resolve_device(spec.device, devices_here)
    threads = spec.threads if spec.threads not in (None, AUTO) else \
        default_threads() if device == "cpu" else _torch_default_threads()
    precision = spec.precision or default_precision(device)
    if spec.attn == "flash_attention_2":
        _check_flash_attention(device, precision)
    if spec.shard != "none":
        from gcbench.fsdp import in_rank

        _check_sharding(spec, policy, device, devices_here and not in_rank())
    config, family = config or _prepared_config(*config_fields(spec))
    if spec.images is None and "vision" in _stack_names(config):  # a VLM's default: one image a sample
        spec = dataclasses.replace(spec, images=1)
    _check_stacks(spec, policy, config)
    check_compile(spec, policy, device)
    spec = dataclasses.replace(spec, adapter=_checked_adapter(spec, config))
    spec = dataclasses.replace(spec, loss=_checked_loss(spec, config))
    concrete = dataclasses.replace(spec, policy=str(policy), device=device, threads=threads, precision=precision)
    return ResolvedRun(concrete, policy, config, family)


class PolicyRefused(GcbenchError):
    """The model cannot run this policy (its blocks, its stacks): a default list of policies leaves it out and says
    so (runnable_defaults); a policy the user named is an error."""


def runnable_defaults(policies: tuple[str, ...], fields: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(the default `policies` the model of `fields` runs, a line for each it refuses): a command given no --policy
    runs the defaults the model takes and names the rest."""
    from gcbench.policies import parse_policy

    spec = RunSpec(**{"seq_len": 1, "batch_size": 1, **fields, "policy": "none"})
    try:  # with the command's own sequence where it has one; a model refused here is refused by the command itself
        config, _ = _prepared_config(*config_fields(spec))
    except GcbenchError:
        return list(policies), []
    kept, refused = [], []
    for policy in policies:
        try:
            _refused_policy(spec, parse_policy(policy), config)
            kept.append(policy)
        except PolicyRefused as e:
            refused.append(f"left out: {e}")
    return kept, refused


def _stack_names(config: Any) -> tuple[str, ...]:
    from gcbench.models import stack_sizes

    return tuple(stack_sizes(config))


def _check_stacks(spec: RunSpec, policy: Policy, config: Any) -> None:
    """The policy's options against each stack's blocks (an encoder-decoder's policy applies to each stack on its
    own); what a model of two stacks cannot run yet, in one line."""
    from gcbench.models import stack_sizes

    sizes = stack_sizes(config)
    if policy.stack and policy.stack not in sizes:
        has = "one stack of blocks: leave stack out" if "blocks" in sizes else \
            f"the stacks {' and '.join(sizes)}"
        raise GcbenchError(f"{policy}: stack={policy.stack} is not a stack of this model, which has {has}")
    for name, n in sizes.items():
        if policy.applies_to(name):
            policy.validate(n, "model" if name == "blocks" else name)
    _refused_policy(spec, policy, config)


def _refused_policy(spec: RunSpec, policy: Policy, config: Any) -> None:
    """PolicyRefused when the model's blocks or stacks cannot run `policy` (its options already valid)."""
    from gcbench.models import build_meta_model, group_refusal, stack_sizes

    sizes = stack_sizes(config)
    grouped = any(len(group) > 1 for name, n in sizes.items() if policy.applies_to(name) for group in policy.groups(n))
    if grouped and (why := group_refusal(config, build_meta_model)):
        raise PolicyRefused(f"{policy}: {why}")
    if len(sizes) == 1:
        return
    what = "a vision-language model" if "vision" in sizes else "an encoder-decoder"
    if spec.shard != "none":
        raise GcbenchError(f"--shard fsdp2: gcbench shards a model of one stack of blocks, not {what}")
    if policy.name == "plan":
        raise PolicyRefused(f"plan: a plan chooses among one stack's blocks, not among {what}'s two (nor within "
                            "one of them, stack=, yet); give another policy, which both stacks then take (or the one "
                            "stack= names)")


def distinct_runs(runs: Iterable[tuple[ResolvedRun, Mapping[str, Any]]], twice: str) -> list[ResolvedRun]:
    """`runs` (each with the values it was made from), each configuration once, in order; GcbenchError naming the
    option when two are one configuration written two ways ("every-k" and "every-k:k=2"). `twice`: what each config
    would otherwise be, twice ("run", "predicted")."""
    seen: dict[str, tuple[ResolvedRun, Mapping[str, Any]]] = {}
    for run, given in runs:
        if (key := config_key(run.as_record())) in seen:
            name = next(n for n in given if given[n] != seen[key][1].get(n))
            if not run_field(name).identity:  # it says how a config is run, not what: both values are one config
                raise GcbenchError(f"--{run_field(name).flag} takes one value here: it does not change the config, "
                                   f"which would be {twice} twice")
            raise GcbenchError(f"--{run_field(name).flag}: duplicate value {getattr(run, name)} (each config would be "
                               f"{twice} twice)")
        seen[key] = (run, given)
    return [run for run, _ in seen.values()]


def resolve_record(record: Mapping[str, Any], **how: Any) -> ResolvedRun:
    """The run of a stored record or of `as_record()` (extra keys ignored), resolved again: the JSON round trip a
    sweep uses to hand a run to its child process, torchrun to its ranks."""
    from gcbench.policies import parse_policy

    values = {f.name: record[f.name] for f in dataclasses.fields(RunSpec) if f.name in record}
    policy = parse_policy(str(record.get("policy", "none")))
    try:
        values["policy"] = dataclasses.replace(policy, **(record.get(POLICY_OPTIONS) or {}))
    except TypeError:
        raise GcbenchError(f"record has options {record.get(POLICY_OPTIONS)!r} that policy "
                           f"{policy.name!r} does not take") from None
    return resolve(RunSpec(**values), **how)


def config_fields(spec: RunSpec) -> tuple[Any, ...]:
    """The fields a run's model config is prepared from (_prepared_config): runs that agree on them share one."""
    return spec.model, spec.layers, spec.seq_len, spec.attn, spec.head, spec.images, spec.target_len


def _prepared_config(model: str, layers: int | None, seq_len: int, attn: str | None, head: str,
                     images: int | None = None, target_len: int | None = None) -> tuple[Any, str]:
    """(config, family) with the run's layers, sequence length, attention, head, images and target length applied,
    from the model's config as read once (a copy: preparing writes into it)."""
    from gcbench.models import prepare_config

    config, family = _raw_config(model, _file_state(model))
    return prepare_config(copy.deepcopy(config), family, layers=layers, seq_len=seq_len, attn=attn,
                          head=head, images=images, target_len=target_len), family


@functools.lru_cache(maxsize=32)
def _raw_config(model: str, file_state: tuple[int, int] | None) -> tuple[Any, str]:
    """A model's config as read from its preset, config.json or Hub id: once per process and model (a local
    config.json again when `file_state`, its modification time and size, changed)."""
    from gcbench.models import load_config

    return load_config(model)


def _file_state(model: str) -> tuple[int, int] | None:
    """(mtime_ns, size) of a local config.json named by `model`; None for a preset or a Hub id."""
    path = Path(model)
    try:
        stat = (path / "config.json" if path.is_dir() else path).stat()
    except (OSError, ValueError):
        return None
    return stat.st_mtime_ns, stat.st_size


def _check_sharding(spec: RunSpec, policy: Policy, device: str, count_gpus: bool) -> None:
    if policy.compiles:
        raise GcbenchError(f"--policy {policy.name} compiles the blocks, and compiled blocks under FSDP2 draw other "
                           "dropout masks than eager ones: the gradients would not equal none's; not with --shard "
                           "fsdp2")
    if count_gpus and DeviceKind.of(device) is DeviceKind.CUDA:
        import torch

        first, count = int(device.split(":")[1]), torch.cuda.device_count()
        if first + spec.nproc > count:
            raise GcbenchError(f"--nproc {spec.nproc} needs a GPU per rank from {device}: {count} here")


def _checked_adapter(spec: RunSpec, config: Any) -> str:
    """The run's --adapter, parsed and checked against the model (one GcbenchError line for a bad one: its named
    targets must match a layer) and written one way (its defaults left out), so that `lora` and `lora:r=16` are one
    configuration."""
    from gcbench.adapters import check_targets, parse_adapter
    from gcbench.models import build_meta_model

    adapter = parse_adapter(spec.adapter)
    check_targets(adapter, config, build_meta_model)
    if adapter.active and spec.shard != "none":
        raise GcbenchError(f"--adapter {adapter.name} with --shard fsdp2 is not supported (FSDP2 would shard the "
                           "frozen base and its adapters alike; gcbench measures adapters on one device)")
    return str(adapter)


def _checked_loss(spec: RunSpec, config: Any) -> str:
    """The run's --loss, parsed and checked against the model (one GcbenchError line: a bad value, or a head whose
    loss a chunked or fused one would not equal), written one way (`chunked` and `chunked:n=8` are one config)."""
    from gcbench.losses import check_loss, parse_loss

    loss = parse_loss(spec.loss)
    check_loss(loss, config, spec.batch_size * spec.seq_len)
    if not loss.own and spec.shard != "none":
        raise GcbenchError(f"--loss {loss.name} with --shard fsdp2 is not supported (FSDP2 gathers the root's "
                           "parameters, the head's among them, around the model's own forward, which it bypasses)")
    return str(loss)


def _torch_default_threads() -> int:
    import torch

    return torch.get_num_threads()


def resolve_device(device: str, here: bool = True) -> str:
    """The device every torch call of a run gets: "cpu" or an explicit "cuda:N" (torch refuses "cuda" without an
    index in set_device and set_per_process_memory_fraction). "auto" is cuda:0 when CUDA is available, else the CPU;
    "cuda" is cuda:0, the first visible device (CUDA_VISIBLE_DEVICES picks which that is). `here=False`: the run
    goes to another machine, whose devices this one cannot see: checked for its form only."""
    import torch

    if device == AUTO:
        if not here:
            raise GcbenchError("--device auto: the jobs run on other machines, whose devices this one cannot see; "
                               "give --device cuda or --device cpu")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if m := re.fullmatch(r"cuda(?::(\d+))?", device):
        index = int(m.group(1) or 0)
        if not here:
            return f"cuda:{index}"
        if not torch.cuda.is_available():
            raise GcbenchError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        if index >= torch.cuda.device_count():
            raise GcbenchError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        return f"cuda:{index}"
    raise GcbenchError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N)")


def _check_flash_attention(device: str, precision: str) -> None:
    """flash_attention_2 runs only on CUDA, in 16-bit, with the flash-attn package: refuse early, not mid-run."""
    if DeviceKind.of(device) is not DeviceKind.CUDA:
        raise GcbenchError("--attn flash_attention_2 needs a CUDA device (on CPU use --attn eager or sdpa)")
    if precision == "fp32":
        raise GcbenchError("--attn flash_attention_2 needs 16-bit activations: use --precision bf16, amp-bf16 or "
                           "amp-fp16")
    if importlib.util.find_spec("flash_attn") is None:
        raise GcbenchError("--attn flash_attention_2 needs the flash-attn package (pip install flash-attn)")
