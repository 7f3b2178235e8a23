"""The one record schema: what a line of a results file holds, and the one identity of a configuration.

A record is a flat JSON object (a TypedDict: records are built, stored and loaded as plain dicts, and a DataFrame
row is one, so a class with conversion at every boundary would buy nothing). Stored values are raw: bytes,
milliseconds, FLOPs; units are converted only for display. Every producer builds its record with `new_record`,
every consumer keys a configuration with `config_key`.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from gcbench.fields import RUN_FIELDS, Role, default_precision, identity_columns, names, run_field, setup_words
from gcbench.results.types import field_problem
from gcbench.units import parse_bytes, plural

# 2: the levers beside checkpointing (optim_in_backward, grad_accum, per-phase peaks); 3: sharded runs (shard, nproc,
# world_size and the per-rank fields); 4: adapters, the loss and compiled blocks (adapter, loss, compile); 5: the
# head (head); 6: a vision-language model's images (images) and an encoder-decoder's target length (target_len)
SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)  # an older record reads as one with ADDED_SPEC_FIELDS' values


class Status(enum.StrEnum):
    """How a configuration ended. A str: records store it as its value, and "ok" == Status.OK."""

    OK = "ok"  # measured
    OOM = "oom"  # out of memory: measured, or predicted past the memory it may use (oom_predicted)
    TIMEOUT = "timeout"  # ran past the sweep's timeout
    ERROR = "error"  # a crash, a bug: not a result (a sweep exits 1)
    SKIPPED = "skipped"  # not run: needs at least as much memory as a config that ran out


STATUSES = tuple(Status)


class NoteKind(enum.StrEnum):
    """Why a step time is not trusted, by kind (a record's timing_note_kinds, beside the texts in timing_notes)."""

    FEW_STEPS = "few-steps"  # too few measured steps to judge their spread
    SPREAD = "spread"  # the steps' IQR past the limit (docs/methodology.md, "When a step time is trusted")
    ZERO_MS = "zero-ms"  # steps of 0 ms: no spread to judge
    BUSY_HOST = "busy-host"  # other processes kept cores busy during the steps
    LOADED_HOST = "loaded-host"  # the 1-minute load average before the steps was past the cores
    SIDE_BY_SIDE = "side-by-side"  # one of several CPU jobs side by side (--jobs)
    CPU_RANKS = "cpu-ranks"  # a sharded run's CPU ranks share one machine's cores
    THROTTLED = "throttled"  # the GPU held its clocks back (power or temperature) during the steps
    OTHER = "other"  # a text of no known kind (named by its own words)

    @property
    def words(self) -> str:
        """How tables name the kind (each record's text has its own numbers)."""
        return NOTE_WORDS[self]


NOTE_WORDS = {NoteKind.FEW_STEPS: "too few steps to judge", NoteKind.SPREAD: "steps spread past the limit",
              NoteKind.ZERO_MS: "steps of 0 ms", NoteKind.BUSY_HOST: "other processes busy",
              NoteKind.LOADED_HOST: "host loaded before the run", NoteKind.SIDE_BY_SIDE: "CPU jobs side by side",
              NoteKind.CPU_RANKS: "CPU ranks", NoteKind.THROTTLED: "GPU throttled", NoteKind.OTHER: ""}
# Records written before timing_note_kinds existed: their notes' kinds, by how each kind's text begins.
_LEGACY_NOTE_STARTS = {"only ": NoteKind.FEW_STEPS, "step times spread": NoteKind.SPREAD,
                       "step times of 0": NoteKind.ZERO_MS, "other processes": NoteKind.BUSY_HOST,
                       "1-minute load": NoteKind.LOADED_HOST, "one of ": NoteKind.SIDE_BY_SIDE,
                       "CPU ranks": NoteKind.CPU_RANKS}


@dataclass(frozen=True)
class TimingNote:
    """One reason a step time is not trusted: its kind, and the text with this record's own numbers."""

    kind: NoteKind
    text: str


def timing_note_fields(notes: Sequence[TimingNote]) -> dict[str, list[str]]:
    """A record's timing notes as stored: the texts in timing_notes, their kinds beside them (one per text)."""
    return {"timing_notes": [n.text for n in notes], "timing_note_kinds": [n.kind.value for n in notes]}


def timing_notes_of(record: Mapping[str, Any]) -> list[TimingNote]:
    """A record's timing notes back as TimingNotes (an older record's kinds told by their texts' beginnings; a text
    of no known kind is OTHER)."""
    texts = record.get("timing_notes")
    texts = texts if isinstance(texts, list) else []
    kinds = record.get("timing_note_kinds")
    if isinstance(kinds, list) and len(kinds) == len(texts) and all(k in NOTE_WORDS for k in kinds):
        return [TimingNote(NoteKind(k), t) for k, t in zip(kinds, texts)]
    return [TimingNote(next((kind for start, kind in _LEGACY_NOTE_STARTS.items() if str(t).startswith(start)),
                            NoteKind.OTHER), str(t)) for t in texts]


def note_kinds(record: Mapping[str, Any]) -> list[str]:
    """A record's timing notes as their kinds in words (without the record's own numbers), in order."""
    return [n.kind.words or n.text for n in timing_notes_of(record)]


class Record(TypedDict, total=False):
    """One configuration's result: the spec's columns first (fields.spec_columns(), one per run field as
    ResolvedRun.as_record writes them, declared in fields.py), then these. Measurement fields are present when status
    is "ok" (some also on "oom")."""

    schema_version: int
    status: str  # one of STATUSES
    error: str | None  # why it did not run or finished early (OOM message, timeout, last stderr line)
    oom_predicted: bool  # an `oom` recorded without running: model state or predicted peak past the memory it may use
    oom_limit: str  # with oom_predicted: "free" (the device's free memory then; --retry-failed re-checks) | "cap"
    # | "plan" (no mix of a `plan` policy is predicted within its memory)
    # prediction made before the run (estimators.predict_for_run)
    predicted_peak_bytes: int | None
    prediction_method: str | None
    predicted_peak_bytes_simulate: int | None
    predicted_peak_bytes_analytic: int | None
    predicted_peak_phase: str | None  # forward | backward | optimizer, by the method of predicted_peak_bytes
    # the step's time on this run's card, from the simulated step op by op (estimators/step_time.py); None on CPU,
    # without the simulation (--predict off), or on a card gcbench has no datasheet figures for
    predicted_step_ms: float | None
    # the model
    family: str
    n_layers: int  # blocks, every stack's
    stacks: str | None  # an encoder-decoder's stacks and their blocks ("encoder:12,decoder:12"); None: one stack
    n_params: int
    attn_implementation: str
    # static memory, bytes
    param_bytes: int  # parameters, buffers and a 4-bit base's quantisation state: the base and the adapters
    adapter_param_bytes: int  # --adapter: the adapters' own weights, part of param_bytes (0 without one)
    trainable_params: int  # parameters that train (peft's count with an adapter; every one without)
    grad_bytes: int
    optimizer_bytes: int  # inside torch's allocator (on CUDA: in max_memory_allocated)
    optimizer_paged_bytes: int  # paged optimizers only: state in CUDA managed memory, outside the allocator (0 on CPU)
    static_bytes: int  # the step's starting baseline: params + grads + optimizer state (+ buffers)
    # time, ms
    step_ms: list[float]  # every measured step, in order
    step_ms_median: float
    step_ms_iqr: float
    step_ms_rel_iqr: float  # IQR / median
    # 95% interval of the median for correlated steps (results.stats.median_interval; records from before it took
    # the steps as independent: readers that judge noise recompute it from step_ms); None: too few or too correlated
    step_ms_ci: list[float] | None
    steps_stop: str  # why measuring stopped: fixed | ci (interval within +-2% CPU, +-1% CUDA) | max-steps | max-time
    timing_stable: bool  # the stability rule (timing.timing_verdict, docs/methodology.md)
    timing_notes: list[str]  # why the timing is not trusted; empty when stable
    timing_note_kinds: list[str]  # each note's NoteKind, in the same order
    # the host around the timed steps
    load_1m_before: float | None  # 1-minute load average
    load_1m_after: float | None
    cpus_logical: int
    cpu_affinity: list[int] | None  # CPUs the process may run on
    torch_threads: int
    other_cpu_cores: float | None  # cores other processes kept busy during the timed steps, on average
    gpu_state_start: dict[str, Any] | None  # CUDA: NVML clocks (MHz), power (W), temperature (C), clock-event reasons
    gpu_state_end: dict[str, Any] | None
    # CUDA: NVML over the timed steps (nvml.GpuWindow): window_ms, power_capped_ms, thermal_capped_ms, energy_mj,
    # sm_clock_mhz_min/_median/_max, clock_samples, clock_event_reasons_seen; gpu_throttled: held back at least 5%
    # of the window (None: NVML could not tell)
    gpu_window: dict[str, Any] | None
    gpu_throttled: bool | None
    # paired timing (a sweep's policies of one model/seq/batch interleaved in one process; paired.py)
    time_ratio: float  # median over rounds of this policy's step time / the baseline's in the same round
    time_ratio_ci: list[float] | None  # its 95% interval
    time_ratio_vs: str  # the baseline policy: none, or the cheapest that ran when none did not
    paired_step_ms: list[float]  # this policy's step times in the rounds
    paired_rounds: int
    paired_stop: str  # as steps_stop
    paired_error: str  # why a policy that ran was not paired
    wall_ms: list[float]  # CUDA: host wall time between the returns of consecutive timed steps (not synchronized)
    compile_ms: float  # budget policy: first step minus a compiled step
    # peaks, bytes
    peak_allocated_bytes: int  # CUDA: torch.cuda.max_memory_allocated over a whole step
    peak_tracked_bytes: int | None  # CPU: the live-tensor tracker's peak over a whole step
    fwd_bwd_peak_bytes: int | None
    # the peak of each phase of one step (CUDA: max_memory_allocated after a reset at the phase's start, in one
    # untimed step; CPU: the live-tensor tracker's), and the phase that reached the step's peak first
    forward_peak_bytes: int | None
    backward_peak_bytes: int | None
    optimizer_peak_bytes: int | None  # None: no step after backward (optimizer none, or stepped in backward)
    peak_phase: str | None  # forward | backward | optimizer
    activation_peak_bytes: int | None  # fwd_bwd_peak_bytes - static_bytes
    peak_reserved_bytes: int  # CUDA: max_memory_reserved
    num_alloc_retries: int  # CUDA: allocator retries during the measured steps
    saved_activation_bytes: int  # saved for backward (saved_tensors_hooks), parameters excluded
    offloaded_bytes: int  # offload policy: bytes one step puts in host memory
    plan_mix: dict[str, int]  # plan policy: the mix chosen for this shape, kind of block -> blocks
    # compute
    flops: int | None  # with recompute
    model_flops: int  # without the policy: the MFU numerator
    recompute_flops_ratio: float | None  # flops / model_flops - 1
    tokens_per_s: float
    mfu: float | None
    record_id: str  # every record's own (new_record); a newer version of a record (its paired timing added) keeps it
    # a sweep's
    sweep_id: str
    isolation: str
    device_slot: str  # --devices / --jobs: the GPU (cuda:N as the driver numbers them) or the cores it ran on
    parallel_jobs: int  # with device_slot: how many configs ran side by side
    executor: str  # --executor: slurm | local (submitit's), with the job's id in job_id
    job_id: str
    config_wall_ms: float | None  # the whole config as the sweep saw it
    stderr_tail: str  # last lines of a failed child's output
    # a sharded run (shard fsdp2): the record's peak and model state are the largest rank's
    world_size: int
    # (None: a rank that did not report it, e.g. one that ran out of memory before its optimizer step)
    rank_peak_allocated_bytes: list[int | None]  # each rank's, in rank order (CUDA); rank_peak_tracked_bytes on CPU
    rank_peak_tracked_bytes: list[int | None]
    rank_param_bytes: list[int | None]  # each rank's shard (about 1/world_size of the unsharded bytes)
    rank_grad_bytes: list[int | None]
    rank_optimizer_bytes: list[int | None]
    env: dict[str, Any] | None  # versions, device, numeric settings (env.capture_env)
    # a fit's trial (fits/fit.py): its search, what it varies, its budget, its place in the search
    fit_id: str
    fit_vary: str  # seq_len | batch_size
    fit_budget_bytes: int
    fit_trial: int
    paired_tokens_per_s: float  # a fit's winners timed interleaved
    fit_paired_id: str  # the winners timed in one interleaving share it (a resumed fit's earlier winner has another)


# Spec fields added since version 1, with what an older record measured (fields.Field.added: one unsharded process,
# the optimizer after backward, no accumulation): a reader fills them in, so that an older record is the same
# configuration as a new one that differs in nothing else.
ADDED_SPEC_FIELDS = {f.name: f.added[1] for f in RUN_FIELDS if f.added}
PHASES = ("forward", "backward", "optimizer")  # the phases of a training step whose peaks are reported apart
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}  # the phase that held a step's peak, in tables


def peak_phase(peaks: Mapping[str, int | None]) -> str | None:
    """The phase that reached the step's peak (the first, on a tie); None without any phase's peak."""
    reached = [p for p in PHASES if peaks.get(p) is not None]
    return max(reached, key=lambda p: (peaks[p], -PHASES.index(p))) if reached else None


LEVER_FIELDS = names(Role.LEVER)  # the levers beside the policy: precision, optimizer, ...


def stack_counts(stacks: object) -> list[tuple[str, str]] | None:
    """A record's `stacks` ("encoder:12,decoder:12") as (name, count) pairs; None where it does not read so."""
    parts = [part.partition(":") for part in str(stacks).split(",")]
    return [(name, count) for name, _, count in parts] if all(c and n.isdigit() for _, c, n in parts) else None


def blocks_text(record: Mapping[str, Any]) -> str:
    """A record's blocks in words ("32 blocks"), a model of several stacks' stack by stack ("2 encoder + 2 decoder
    blocks"); "" where it names none. `stacks` as the record has it: shown as it is unless it reads name:count."""
    if stacks := record.get("stacks"):
        counts = stack_counts(stacks)
        return " + ".join(f"{count} {name}" for name, count in counts) + " blocks" if counts else str(stacks)
    blocks = record.get("n_layers") or record.get("layers")
    return plural(blocks, "block") if blocks else ""


def lever_text(record: Mapping[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """The levers beside the policy, in words, as every table names them: "bf16 · adamw-loop · optimizer in
    backward · 4 micro-batches" (all but `leave_out`; in backward and accumulation only when on)."""
    return setup_words(record, (Role.LEVER,), leave_out)
# What a block of the `plan` policy may be, least recompute first (policies/plan.py).
PLAN_KINDS = ("none", "attn", "sac", "full", "offload")


def mix_text(counts: Mapping[str, int]) -> str:
    """A plan's chosen mix (a record's plan_mix) in a few words, the most saving kinds first: "full 4 · sac 8 ·
    none 20"."""
    return " · ".join(f"{kind} {counts[kind]}" for kind in reversed(PLAN_KINDS) if counts.get(kind))


SHAPE_FIELDS = names(Role.SHAPE)  # seq_len, batch_size: records are compared within one shape
SIZE_WORDS = {name: run_field(name).flag for name in SHAPE_FIELDS}  # a fit's varied size (fit_vary) in a word


def fastest(best: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], float, bool] | None:
    """The fastest of several policies' largest configs (a fit's winners): (record, tokens/s, paired). Ranked by
    paired tokens/s when every one was timed paired (drift-free), else by each run's own tokens/s."""
    if not best:
        return None
    # paired only within one interleaving (older records carry no id: theirs is taken for one)
    paired = all(r.get("paired_tokens_per_s") for r in best) and len({r.get("fit_paired_id") for r in best}) == 1
    key = "paired_tokens_per_s" if paired else "tokens_per_s"
    top = max(best, key=lambda r: r[key])
    return top, top[key], paired


def fit_policy(record: Mapping[str, Any]) -> str:
    """A fit trial's policy as one line across budgets: its label, but the memory of a plan that took the fit's
    budget as its own left out: "plan", "plan:allow_offload=true"; "plan:memory=8GiB,..." when given apart."""
    options = dict(record.get("policy_options") or {})
    if record["policy"] != "plan" or parse_bytes(str(options.get("memory", "0B"))) != record.get("fit_budget_bytes"):
        return policy_label(record)
    offload = options.get("allow_offload") in (True, "true")
    return "plan:allow_offload=true" if offload else "plan"


# The fields that make two records the same configuration (memory_cap_kind is derived from device).
IDENTITY_KEYS = identity_columns()


def new_record(spec_fields: Mapping[str, Any], status: str = Status.OK, error: str | None = None,
               **fields: Any) -> Record:
    """The head every record starts with (schema version, the spec, status, error, a new record_id), then
    `fields`."""
    return {"schema_version": SCHEMA_VERSION, **spec_fields, "status": Status(status).value,  # type: ignore
            "error": error, "record_id": uuid.uuid4().hex, **fields}


# What a reader needs of every record, with its type: without these a record cannot be placed in a table.
REQUIRED = {**{f.name: int if f.kind.python_type == "int" else str for f in RUN_FIELDS if f.required},
            "status": str}


# What a sweep's record awaiting its paired timing says until the timing replaces it (a newer version of the record,
# the same record_id, on its line; never the other way round): what stays when the sweep is stopped (Ctrl-C, kill -9)
# before then, for a resumed sweep to pair. EARLIER_NOT_YET_PAIRED: the same, as gcbench wrote it before.
NOT_YET_PAIRED = "not paired yet: the paired timing of its seq and batch follows once every policy has run"
EARLIER_NOT_YET_PAIRED = ("not paired: the sweep stopped before the paired timing of its seq and batch",)
AWAITING_PAIRING = (NOT_YET_PAIRED, *EARLIER_NOT_YET_PAIRED)


def version_order(record: Mapping[str, Any]) -> tuple[str, bool]:
    """How versions of one record (the same record_id) follow each other: by the sweep that wrote them (a config
    run again keeps its record's id; a sweep_id begins with the time its sweep started), then by the paired timing,
    added later in the same sweep."""
    return str(record.get("sweep_id") or ""), record.get("paired_error") not in AWAITING_PAIRING


def record_problem(record: Mapping[str, Any]) -> str | None:
    """Why `record` is not a record readers can use (a field missing or of the wrong type, an unknown status, a
    measurement that is not a number); None when it is one."""
    for name, kind in REQUIRED.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is {value!r}, not a{'n' if kind is int else ''} {kind.__name__}" if name in record \
                else f"no {name!r} field"
    if record["status"] not in STATUSES:
        return f"unknown status {record['status']!r} (one of {', '.join(STATUSES)})"
    for name in ("step_ms_ci", "time_ratio_ci"):
        value = record.get(name)
        if value is not None and (not isinstance(value, list) or len(value) != 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            return f"{name} is {value!r}, not a [low, high] pair of numbers"
    if record.get("peak_phase") is not None and record["peak_phase"] not in PHASES:
        return f"peak_phase is {record['peak_phase']!r}, not forward, backward or optimizer"
    if record.get("fit_id") is not None and (record.get("fit_vary") not in SHAPE_FIELDS
                                             or not isinstance(record.get("fit_budget_bytes"), int)):
        return "a fit's trial without its fit_vary (seq_len or batch_size) or its fit_budget_bytes"
    # every field by its declaration (results/types.py): types, finite numbers, measurements in range
    return next((p for name, value in record.items() if (p := field_problem(name, value, Record))), None)


def half_width(value: float, interval: Any) -> float | None:
    """How far a [low, high] interval reaches from its value, on the wider side, relative to the value (0.02 =
    +-2%); None without an interval (fewer than 6 steps, an older record) or a value of 0."""
    if not isinstance(interval, (list, tuple)) or len(interval) != 2 or not value:
        return None
    return max(value - interval[0], interval[1] - value) / abs(value)


def config_key(record: Mapping[str, Any], *, ignore: tuple[str, ...] = ()) -> str:
    """A configuration's identity: its spec fields (minus `ignore`) as canonical JSON. A sweep resumes by it, the
    OOM skip rule ignores seq_len and batch_size, compare ignores the device index and the run length. A fixed step
    count (--steps N) leaves --max-steps and --max-time unused: they are not part of that config's identity."""
    if record.get("measure_steps", "auto") != "auto":
        ignore = (*ignore, "max_steps", "max_time_s")
    return json.dumps({k: record.get(k) for k in IDENTITY_KEYS if k not in ignore}, sort_keys=True, default=str)


def policy_label(record: Mapping[str, Any]) -> str:
    """A record's policy as written on the command line: "every-k:k=2", "sqrtn"."""
    opts = record.get("policy_options") or {}
    return record["policy"] + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def config_label(record: Mapping[str, Any]) -> str:
    """A configuration in a few words, for progress lines and errors: model, shape, policy, and the levers set away
    from their defaults ("lora:r=8 · loss chunked"), so that two configs of one sweep never read alike."""
    levers = [w for f in RUN_FIELDS if f.role is Role.LEVER and f.default not in ("", None)
              and record.get(f.name, f.default) != f.default and (w := f.text(record))]
    precision = record.get("precision")  # its default is the device's: named where it is not that one
    if precision and precision != default_precision(record.get("device", "cpu")):
        levers.insert(0, precision)
    return " · ".join([f"{record['model']} seq {record['seq_len']} batch {record['batch_size']} "
                       f"{policy_label(record)}", *levers])


def peak_bytes(record: Mapping[str, Any]) -> int | None:
    """A record's measured peak: the CUDA allocator's, or on CPU the live-tensor tracker's (never mixed up)."""
    return record.get("peak_allocated_bytes", record.get("peak_tracked_bytes"))
