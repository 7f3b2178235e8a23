"""Measuring instruments: the CPU and CUDA instruments that time steps and read memory, step statistics, the CPU
live-tensor tracker, saved-activation bytes, FLOPs, MFU peaks.

Every torch.cuda call of a run is made by `CudaInstrument`, each with the run's explicit device (cuda:N), so that
CI can drive it with a faked torch.cuda (tests/fake_cuda.py) while torch's own argument checks stay real.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

# FlopCounterMode knows the CUDA SDPA kernels but not the CPU flash kernel that SDPA picks on CPU; without these
# two formulas attention would count zero FLOPs on CPU. Same formulas as the CUDA flash kernel (causal not halved).
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):

    @flop_counter.register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@dataclass(frozen=True)
class Stats:
    """Summary of raw samples (e.g. per-step milliseconds): the one place medians and IQRs are computed."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        xs = sorted(samples)
        if not xs:
            raise ValueError("no samples")
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def round_up(nbytes: int, granularity_bytes: int) -> int:
    """`nbytes` rounded up to a multiple of `granularity_bytes` (512 models the CUDA caching allocator's blocks)."""
    return -(-nbytes // granularity_bytes) * granularity_bytes


def storage_bytes(tensors: Iterable[torch.Tensor], granularity_bytes: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once), each rounded up to
    `granularity_bytes`. Keyed by storage object, not data pointer: fake tensors all point at address 0."""
    storages = {id(s): s for s in (t.untyped_storage() for t in tensors)}
    return sum(round_up(s.nbytes(), granularity_bytes) for s in storages.values())


class LiveTensorTracker(TorchDispatchMode):
    """Peak of live tensor bytes on CPU: each new storage adds its bytes, its release subtracts them.

    Storages that existed before (parameters, gradients, optimizer state) are added with `track`. A storage is
    counted once however many views share it. With `cap_bytes`, going past the cap raises a real
    torch.OutOfMemoryError, so OOM handling can be exercised without a GPU. This is not an allocator: no
    fragmentation, no caching, no 512-byte rounding — it is reported as `peak_tracked_bytes`, never as CUDA memory.
    `granularity_bytes` rounds every storage up to a multiple (512 mimics the CUDA caching allocator's blocks; the
    memory estimator uses it, measurements keep 1).
    """

    def __init__(self, cap_bytes: int | None = None, granularity_bytes: int = 1):
        super().__init__()
        self.cap_bytes = cap_bytes
        self.granularity_bytes = granularity_bytes
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        nbytes = round_up(nbytes, self.granularity_bytes)
        self._live[key] = nbytes
        self.current += nbytes
        # Storages keep their Python object while the storage lives, so this fires when the memory is freed.
        weakref.finalize(storage, self._release, key)
        if self.current > self.peak:
            self.peak = self.current
            if self.cap_bytes is not None and self.current > self.cap_bytes:
                raise torch.OutOfMemoryError(
                    f"live tensors need {self.current} bytes, past the memory cap of {self.cap_bytes} bytes")

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out


class SavedActivations:
    """Bytes autograd keeps for backward during a forward: distinct storages passed to saved_tensors_hooks.

    Parameters and buffers are excluded (they are model state). Tensors saved inside a non-reentrant checkpoint
    go to the checkpoint's own hooks and are dropped; the checkpoint's inputs are saved through ours, so a
    checkpointed block counts exactly what it stores. Op outputs a selective checkpoint caches arrive via
    `note_saved`. Tensors an inner hook moves off the device (activation offload) are not counted here.
    """

    def __init__(self, exclude: Iterable[torch.Tensor]):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in self._exclude:
            self._saved[s.data_ptr()] = s.nbytes()

    @contextmanager
    def recording(self):
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t

        token = _RECORDING.set(self)
        try:
            with saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            _RECORDING.reset(token)


# The recording in progress, so that tensors kept for backward by other means than saved_tensors_hooks can be counted.
_RECORDING: ContextVar[SavedActivations | None] = ContextVar("gcbench_saved_activations", default=None)


def note_saved(tensors: Iterable[torch.Tensor]) -> None:
    """Count `tensors` in the SavedActivations recording in progress, if any.

    For tensors autograd keeps outside saved_tensors_hooks: selective checkpointing caches op outputs in its own
    storage, invisible to the hooks, so the `sac` policy reports them here.
    """
    recording = _RECORDING.get()
    if recording is not None:
        for t in tensors:
            recording.add(t)


@contextmanager
def counting_flops():
    """FLOPs of everything run inside (forward, backward and any recompute); read `.get_total_flops()`."""
    with FlopCounterMode(display=False) as counter:
        yield counter


# Dense bf16 tensor-core peak FLOP/s (no sparsity), matched against torch.cuda.get_device_name(); first match wins.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
]


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when unknown."""
    for key, value in PEAK_BF16_FLOPS:
        if key in device_name:
            return value
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The instruments: everything that differs between a CPU and a CUDA run


Progress = Callable[[str], None]  # called once per step with a short description of what runs next


class Step(Protocol):
    """What an instrument needs of a training step (worker.TrainingStep)."""

    batch: dict[str, torch.Tensor]

    def __call__(self) -> None: ...

    def forward_backward(self) -> None: ...

    def optimizer_step(self) -> None: ...

    def static_tensors(self) -> list[torch.Tensor]: ...


def step_time_fields(step_ms: list[float]) -> dict[str, Any]:
    stats = Stats.of(step_ms)
    return {"step_ms": step_ms, "step_ms_median": stats.median, "step_ms_iqr": stats.iqr}


def warm_up(step: Step, n: int, progress: Progress) -> None:
    """`n` untimed steps."""
    for i in range(n):
        progress(f"warm-up {i + 1}/{n}")
        step()


def instrument_class(device: str) -> type[CpuInstrument] | type[CudaInstrument]:
    return CudaInstrument if str(device).startswith("cuda") else CpuInstrument


def instrument_for(device: str, memory_cap_bytes: int | None = None) -> CpuInstrument | CudaInstrument:
    """The instrument for a resolved device ("cpu" or "cuda:N")."""
    return instrument_class(device)(device, memory_cap_bytes)


@contextmanager
def cleanup_after(cleanup: Callable[[], None]) -> Iterator[None]:
    """Run `cleanup` when the block ends, however it ends. If the block failed, its error is the one raised: a
    failing cleanup is attached to it as a note instead of replacing it (as a plain `finally` would)."""
    try:
        yield
    except BaseException as first:
        try:
            cleanup()
        except Exception as second:  # noqa: BLE001 - reported with the first error, which is what matters
            first.add_note(f"then cleaning up failed too: {type(second).__name__}: {second}")
        raise
    cleanup()


class CpuInstrument:
    """A CPU run: perf_counter around each whole step; the peak comes from one more step under the live-tensor
    tracker. `--memory-cap` limits live tensor bytes: the tracker raises a real torch.OutOfMemoryError past it."""

    kind = "cpu"
    memory_cap_kind = "tracked"  # what --memory-cap limits: live tensor bytes (LiveTensorTracker)

    def __init__(self, device: str = "cpu", memory_cap_bytes: int | None = None):
        self.memory_cap_bytes = memory_cap_bytes

    @contextmanager
    def session(self) -> Iterator[None]:
        with cleanup_after(gc.collect):  # reference cycles of this run, before the next in-process one
            yield

    def available_bytes(self) -> int:
        """The host's MemAvailable."""
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def describe(self) -> dict[str, Any]:
        return {"gpu_name": None, "gpu_memory_bytes": None}

    def peak_flops(self) -> float | None:
        return None

    def warm_up(self, step: Step, n: int, progress: Progress) -> None:
        # A memory cap must bite from the first step, as a GPU's memory would.
        capped = LiveTensorTracker(self.memory_cap_bytes) if self.memory_cap_bytes else None
        if capped is not None:
            capped.track(step.static_tensors() + list(step.batch.values()))
        with capped or nullcontext():
            warm_up(step, n, progress)

    def time_steps(self, step: Step, n: int, progress: Progress) -> dict[str, Any]:
        step_ms = []
        for i in range(n):
            progress(f"measuring {i + 1}/{n}")
            t0 = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        return step_time_fields(step_ms)

    def peak_fields(self, step: Step, progress: Progress) -> dict[str, Any]:
        """One untimed step under the live-tensor tracker: peak of live tensor bytes, whole step and fwd+bwd."""
        progress("tracking live tensors")
        tracker = LiveTensorTracker(self.memory_cap_bytes)
        tracker.track(step.static_tensors() + list(step.batch.values()))
        baseline = tracker.current
        with tracker:
            step.forward_backward()
            fwd_bwd_peak = tracker.peak
            step.optimizer_step()
        return {
            "peak_tracked_bytes": tracker.peak,
            "fwd_bwd_peak_bytes": fwd_bwd_peak,
            "static_bytes": baseline,
            "activation_peak_bytes": fwd_bwd_peak - baseline,
        }


class CudaInstrument:
    """A CUDA run on one explicit device: CUDA events and the caching allocator's statistics, in the fixed sequence
    of DESIGN.md. `--memory-cap` limits the caching allocator's reserved bytes (a per-process memory fraction).

    Every torch.cuda call names the device. Events carry none: they record on the current device's stream, which
    `session` sets to this device.
    """

    kind = "cuda"
    memory_cap_kind = "reserved"  # what --memory-cap limits: the caching allocator's reserved bytes

    def __init__(self, device: str | torch.device, memory_cap_bytes: int | None = None):
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"CudaInstrument needs an explicit device such as cuda:0, got {str(device)!r}")
        self.memory_cap_bytes = memory_cap_bytes

    @contextmanager
    def session(self) -> Iterator[None]:
        """This device selected and the memory cap applied for the block; afterwards the cap is lifted (it is
        process-wide) and freed memory handed back, so that the next in-process run starts clean."""
        torch.cuda.set_device(self.device)
        self._release()  # what an earlier run in this process left in the cache
        if self.memory_cap_bytes is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.memory_cap_bytes / total), self.device)
        with cleanup_after(self._end_session):
            try:
                yield
            except torch.OutOfMemoryError as e:
                # The failed step's tensors live on in the traceback's frames: drop them, so that the memory they
                # hold goes back to the device when the session ends rather than when the error is forgotten.
                traceback.clear_frames(e.__traceback__)
                raise

    def _end_session(self) -> None:
        self._release()
        if self.memory_cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _release(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()  # the caching allocator's unused blocks, of every device

    def available_bytes(self) -> int:
        """Free memory on the device now (cudaMemGetInfo)."""
        return torch.cuda.mem_get_info(self.device)[0]

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        return {"gpu_name": props.name, "gpu_memory_bytes": props.total_memory}

    def peak_flops(self) -> float | None:
        return peak_flops(torch.cuda.get_device_name(self.device))

    def warm_up(self, step: Step, n: int, progress: Progress) -> None:
        warm_up(step, n, progress)

    def time_steps(self, step: Step, n: int, progress: Progress) -> dict[str, Any]:
        """Per step: synchronize, reset peaks, baseline, event, forward+backward, read the fwd+bwd peak, optimizer
        step, event, synchronize, read the step's peaks. Peaks are reset every step, so each is read every step and
        the maximum reported; allocation retries are counted over the measured steps only."""
        dev = self.device
        step_ms, wall_ms, peaks, fwd_bwd_peaks, reserved_peaks, baselines = [], [], [], [], [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        retries_before = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
        for i in range(n):
            progress(f"measuring {i + 1}/{n}")
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            baselines.append(torch.cuda.memory_allocated(dev))
            t0 = time.perf_counter()
            start.record()
            step.forward_backward()
            # Allocator statistics live on the host: reading them here does not synchronize with the GPU.
            fwd_bwd_peaks.append(torch.cuda.max_memory_allocated(dev))
            step.optimizer_step()
            end.record()
            torch.cuda.synchronize(dev)
            wall_ms.append((time.perf_counter() - t0) * 1e3)
            step_ms.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated(dev))
            reserved_peaks.append(torch.cuda.max_memory_reserved(dev))
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - retries_before
        baseline = max(baselines)
        return {
            **step_time_fields(step_ms),
            "wall_ms": wall_ms,
            "peak_allocated_bytes": max(peaks),
            "fwd_bwd_peak_bytes": max(fwd_bwd_peaks),
            "static_bytes": baseline,
            "activation_peak_bytes": max(fwd_bwd_peaks) - baseline,
            "peak_reserved_bytes": max(reserved_peaks),
            "num_alloc_retries": retries,
        }

    def peak_fields(self, step: Step, progress: Progress) -> dict[str, Any]:
        return {}  # the allocator's peaks come with the timed steps
