"""The instruments: everything that differs between a CPU and a CUDA run (timing, memory peaks, the memory cap).

Every torch.cuda call of a run is made by `CudaInstrument`, each with the run's explicit device (cuda:N), so that
CI can drive it with a faked torch.cuda (tests/fake_cuda.py) while torch's own argument checks stay real. The
counters both use (live-tensor tracker, statistics, FLOP peaks) are in measure.py.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import psutil
import torch

from gcbench.fields import DeviceKind
from gcbench.gpus import peak_flops
from gcbench.heap import collect_garbage
from gcbench.measure import LiveTensorTracker, PhasePeaks
from gcbench.nvml import GpuWindow, gpu_state, nvml_free_bytes
from gcbench.timing import HostLoad, StepBudget, measure_until, step_time_fields


Progress = Callable[[str], None]  # called once per step with a short description of what runs next


class Step(Protocol):
    """What an instrument needs of a training step (step.TrainingStep)."""

    batch: dict[str, torch.Tensor]

    def __call__(self, mark: Callable[[str], None] = ...) -> None: ...

    def forward_backward(self) -> None: ...

    def optimizer_step(self) -> None: ...

    def static_tensors(self) -> list[torch.Tensor]: ...


def warm_up(step: Step, n: int, progress: Progress) -> None:
    """`n` untimed steps."""
    for i in range(n):
        progress(f"warm-up {i + 1}/{n}")
        step()


def instrument_class(device: str) -> type[CpuInstrument] | type[CudaInstrument]:
    return CudaInstrument if DeviceKind.of(device) is DeviceKind.CUDA else CpuInstrument


def instrument_for(device: str, memory_cap_bytes: int | None = None) -> CpuInstrument | CudaInstrument:
    """The instrument for a resolved device ("cpu" or "cuda:N")."""
    return instrument_class(device)(device, memory_cap_bytes)


def free_without_context(device: str) -> int | None:
    """Free memory of `device`, read without touching it (a sweep's parent must never create a CUDA context): free
    host memory (CPU), or NVML's free memory of that GPU; None when NVML cannot tell (no NVML, a MIG slice, GPUs
    whose CUDA order NVML cannot know)."""
    if DeviceKind.of(device) is DeviceKind.CUDA:
        return nvml_free_bytes(torch.device(device).index or 0)
    return psutil.virtual_memory().available  # Linux: MemAvailable, what can be had without swapping


# What a probe runs: CUDA context, then a bf16 matmul forward and backward (cuBLAS loaded, its workspaces allocated
# by the caching allocator, as in a trial), then the device's free memory plus what the probe's allocator holds
# (a trial allocates that itself, inside its budget).
_PROBE = """
import sys, torch
device = torch.device(sys.argv[1])
torch.cuda.set_device(device)
a = torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
(a @ a).sum().backward()
torch.cuda.synchronize(device)
free, total = torch.cuda.mem_get_info(device)
print(free + torch.cuda.memory_reserved(device))
"""


def free_after_context(device: str, timeout_s: float = 300.0) -> int | None:
    """Free memory of CUDA `device` as a run's own process finds it once its CUDA context and cuBLAS exist (a
    parent must not create a context of its own: it would hold that memory during every run): read by a probe
    process. None when the probe fails. On CPU, free host memory."""
    import subprocess
    import sys

    if DeviceKind.of(device) is not DeviceKind.CUDA:
        return free_without_context(device)
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, device], capture_output=True, text=True,
                              timeout=timeout_s)
        return int(done.stdout.split()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


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


class Instrument:
    """What both instruments share: the device and the memory cap, which each enforces its own way."""

    memory_cap_kind: str  # what --memory-cap limits on this device

    def __init__(self, device: str | torch.device, memory_cap_bytes: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.device = torch.device(device)
        self.memory_cap_bytes = memory_cap_bytes
        self.clock = clock  # seconds; the host's clock for budgets (CUDA steps are timed with events)

    def free_bytes(self) -> int:
        """The device's free memory now (the memory cap is checked beside it: runner.check_fits)."""
        raise NotImplementedError


class CpuInstrument(Instrument):
    """A CPU run: perf_counter around each whole step; the peak comes from one more step under the live-tensor
    tracker. `--memory-cap` limits live tensor bytes: the tracker raises a real torch.OutOfMemoryError past it.
    The cap is enforced in the untimed steps (warm-up and the tracked step), which run the same step as the timed
    ones: timing under the tracker would time the tracker."""

    kind = "cpu"
    memory_cap_kind = "tracked"  # what --memory-cap limits: live tensor bytes (LiveTensorTracker)

    @contextmanager
    def session(self) -> Iterator[None]:
        # the cycles made before the run (a prediction's simulation in a sweep's child) collected, not inside its
        # timed steps; and where a module was imported since the heap was frozen, frozen while nothing of this run
        # exists yet (collect_garbage)
        collect_garbage()
        # reference cycles of this run, before the next in-process one
        with cleanup_after(lambda: collect_garbage(freeze=False)):
            yield

    def free_bytes(self) -> int:
        return free_without_context("cpu")

    def describe(self) -> dict[str, Any]:
        return {"gpu_name": None, "gpu_memory_bytes": None}

    def peak_flops(self) -> float | None:
        return None

    def _tracker(self, step: Step) -> LiveTensorTracker:
        """A live-tensor tracker holding the cap, with the step's static tensors and batch already counted."""
        tracker = LiveTensorTracker(self.memory_cap_bytes)
        tracker.track(step.static_tensors() + list(step.batch.values()))
        return tracker

    def warm_up(self, step: Step, n: int, progress: Progress) -> None:
        # A memory cap must bite from the first step, as a GPU's memory would.
        with self._tracker(step) if self.memory_cap_bytes else nullcontext():
            warm_up(step, n, progress)

    def timed(self, step: Step) -> float:
        """One whole step, in ms."""
        t0 = self.clock()
        step()
        return (self.clock() - t0) * 1e3

    def time_steps(self, step: Step, budget: StepBudget, progress: Progress) -> dict[str, Any]:
        """Steps timed as the budget says, with the host's load around them."""
        with HostLoad(self.clock) as load:
            step_ms, stop = measure_until(budget, lambda: self.timed(step), self.clock, progress)
        return {**step_time_fields(step_ms, stop), **load.fields(torch.get_num_threads())}

    def peak_fields(self, step: Step, progress: Progress) -> dict[str, Any]:
        """One untimed step under the live-tensor tracker: peak of live tensor bytes, whole step, fwd+bwd and per
        phase (forward, backward, optimizer step)."""
        progress("tracking live tensors")
        tracker = self._tracker(step)
        baseline = tracker.current
        phases = PhasePeaks(lambda: tracker.peak, tracker.reset_peak)
        with tracker:
            step(phases)
        fwd_bwd_peak = max(phases.peaks["forward"], phases.peaks["backward"])
        return {
            "peak_tracked_bytes": max(phases.peaks.values()),
            "fwd_bwd_peak_bytes": fwd_bwd_peak,
            "static_bytes": baseline,
            "activation_peak_bytes": fwd_bwd_peak - baseline,
            **phases.fields(),
        }


class CudaInstrument(Instrument):
    """A CUDA run on one explicit device: CUDA events and the caching allocator's statistics, in the fixed sequence
    of docs/methodology.md ("The fixed sequence"). `--memory-cap` limits the caching allocator's reserved bytes (a per-process memory fraction).

    Every torch.cuda call names the device. Events carry none: they record on the current device's stream, which
    `session` sets to this device.
    """

    kind = "cuda"
    memory_cap_kind = "reserved"  # what --memory-cap limits: the caching allocator's reserved bytes

    def __init__(self, device: str | torch.device, memory_cap_bytes: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(device, memory_cap_bytes, clock)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"CudaInstrument needs an explicit device such as cuda:0, got {str(device)!r}")

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
        self._release(freeze=False)  # the run's model may be alive still: never frozen (collect_garbage)
        if self.memory_cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _release(self, freeze: bool = True) -> None:
        collect_garbage(freeze)
        torch.cuda.empty_cache()  # the caching allocator's unused blocks, of every device

    def free_bytes(self) -> int:
        """Free memory on the device now (cudaMemGetInfo)."""
        return torch.cuda.mem_get_info(self.device)[0]

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        return {"gpu_name": props.name, "gpu_memory_bytes": props.total_memory}

    def peak_flops(self) -> float | None:
        return peak_flops(torch.cuda.get_device_name(self.device))

    def warm_up(self, step: Step, n: int, progress: Progress) -> None:
        warm_up(step, n, progress)

    def timed(self, step: Step) -> float:
        """One whole step between CUDA events, in ms (synchronized before, its end event waited for after)."""
        return self.timed_round([(nullcontext, step)])[0]

    def timed_round(self, steps: Sequence[tuple[Callable[[], AbstractContextManager], Step]]) -> list[float]:
        """A paired round back to back (paired.py): each step run inside its context (its policy applied, then
        removed), between two CUDA events recorded inside that context, and nothing between two steps that waits for
        the device. A step's time runs from its start event to its end event: the host's work of switching policies
        runs while the GPU still runs the step before, and where the GPU waits for it, that wait is not the step's.
        The device is synchronized before the round and the last end event waited for once after it."""
        torch.cuda.synchronize(self.device)
        events = []
        for context, step in steps:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with context():
                start.record()
                step()
                end.record()
            events.append((start, end))
        events[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in events]

    def time_steps(self, step: Step, budget: StepBudget, progress: Progress) -> dict[str, Any]:
        """Steps back to back, as a training loop runs them (docs/methodology.md, "Timing on a GPU"): no synchronize
        and no memory-statistics call between them, so the GPU's queue never drains. A CUDA event at every step
        boundary; a step's time runs from the event before it to the one after it (time the GPU waited for the host
        included: a host-bound step is that slow). After launching step i the host waits for step i-1's end event
        only, so step i stays queued while step i-1's time is read and the budget consulted; under --steps auto the
        step launched after the last timed one is waited for, untimed (validate/cost.py counts it). The first timed step starts on an
        idle GPU, after the host's synchronize: it alone carries its first kernels' launch latency (microseconds; the
        median does not see it). Around the window: allocation retries, the GPU's state (NVML) and its throttling (nvml.GpuWindow).
        Memory is read in steps of its own (peak_fields)."""
        dev = self.device
        wall_ms: list[float] = []

        def launch() -> torch.cuda.Event:
            step()
            boundary = torch.cuda.Event(enable_timing=True)
            boundary.record()
            return boundary

        torch.cuda.synchronize(dev)
        retries_before = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
        state_start = gpu_state(dev.index)
        with HostLoad(self.clock) as load, GpuWindow(dev.index, self.clock) as window:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            ends = [start, launch()]  # the first timed step starts on an idle GPU: its first kernels' launch counts
            last = [time.perf_counter()]

            def timed_step() -> float:
                if budget.fixed is None or len(wall_ms) + 1 < budget.fixed:  # a fixed count's last step has no next
                    ends.append(launch())  # the next step, queued behind the one waited for
                else:
                    ends.append(ends[-1])
                ends[-2].synchronize()
                window.sample()
                now = time.perf_counter()
                wall_ms.append((now - last[0]) * 1e3)
                last[0] = now
                return ends[-3].elapsed_time(ends[-2])

            step_ms, stop = measure_until(budget, timed_step, self.clock, progress)
            ends[-1].synchronize()  # the step launched after the last timed one
        state_end = gpu_state(dev.index)
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - retries_before
        return {**step_time_fields(step_ms, stop), **load.fields(torch.get_num_threads()), **window.fields(),
                "gpu_state_start": state_start, "gpu_state_end": state_end, "wall_ms": wall_ms,
                "num_alloc_retries": retries}

    def peak_fields(self, step: Step, progress: Progress) -> dict[str, Any]:
        """A memory step of its own, after the timed ones: synchronize, reset the peaks, the baseline (static
        bytes), then the step read phase by phase (max_memory_allocated of the forward, the backward and the
        optimizer step, each after a reset; the whole step's peak is the largest), max_memory_reserved over all."""
        dev = self.device
        progress("reading peaks")
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        baseline = torch.cuda.memory_allocated(dev)
        reserved: list[int] = []

        def reset() -> None:
            reserved.append(torch.cuda.max_memory_reserved(dev))
            torch.cuda.reset_peak_memory_stats(dev)

        phases = PhasePeaks(lambda: torch.cuda.max_memory_allocated(dev), reset)
        step(phases)
        torch.cuda.synchronize(dev)
        reserved.append(torch.cuda.max_memory_reserved(dev))
        fwd_bwd = max(phases.peaks[p] for p in ("forward", "backward") if p in phases.peaks)
        return {"peak_allocated_bytes": max(phases.peaks.values()), "fwd_bwd_peak_bytes": fwd_bwd,
                "static_bytes": baseline, "activation_peak_bytes": fwd_bwd - baseline,
                "peak_reserved_bytes": max(reserved), **phases.fields()}
