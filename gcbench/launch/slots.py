"""Where a sweep's configs run side by side: one slot per GPU (`--devices`) or per disjoint set of CPU cores
(`--jobs`). A slot runs one config at a time in its own child, which sees only its GPU (CUDA_VISIBLE_DEVICES, so
the config's device stays cuda:0 and its identity does not depend on which card it ran on) or is pinned to its
cores. Importing this module is cheap (no torch until a GPU count is needed)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gcbench.errors import GcbenchError, signals_held
from gcbench.results.schema import NoteKind, Status, TimingNote, timing_note_fields, timing_notes_of

if TYPE_CHECKING:
    from gcbench.resolved import ResolvedRun

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
T = TypeVar("T")


@dataclass(frozen=True)
class Slot:
    """One place a config runs: `name` is what progress and records show ("cuda:1", "cpus 0-3")."""

    name: str
    cuda_visible: str | None = None  # the child's CUDA_VISIBLE_DEVICES: its one GPU, as the parent numbers it
    cpus: tuple[int, ...] | None = None  # the cores the child is pinned to (sched_setaffinity)

    def enter(self) -> None:
        """In the child, before anything touches CUDA or starts a thread pool: see only this slot's GPU or cores.
        CUDA reads CUDA_VISIBLE_DEVICES when it initialises, which the fork server never did."""
        if self.cuda_visible is not None:
            os.environ[CUDA_VISIBLE] = self.cuda_visible
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def as_task(self) -> dict:
        return {"name": self.name, "cuda_visible": self.cuda_visible, "cpus": self.cpus}


HERE = Slot("here")  # a sweep without --devices or --jobs: the child inherits this process's devices and cores


def make_slots(device_kinds: Sequence[str], devices: tuple[str, ...] | None, jobs: int | None) -> list[Slot]:
    """The slots of a sweep whose configs run on `device_kinds` ("cpu", "cuda:0"); GcbenchError for a combination
    that cannot work, before anything runs."""
    if devices and jobs and jobs > 1:
        raise GcbenchError("--devices and --jobs are two ways to run configs side by side: give one (--devices for "
                           "GPUs, --jobs for CPU runs)")
    kinds = set(device_kinds)
    if devices:
        if kinds != {"cuda:0"}:
            raise GcbenchError("--devices spreads a sweep over GPUs: its configs need --device cuda (each child "
                               "sees only its GPU, as cuda:0)" + ("; on CPU use --jobs" if "cpu" in kinds else ""))
        return _gpu_slots(devices)
    if jobs is None or jobs == 1:
        return [HERE]
    if kinds != {"cpu"}:
        raise GcbenchError("--jobs runs CPU configs side by side on disjoint cores; for GPUs use --devices")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cores:
        raise GcbenchError("--jobs needs CPU affinity (Linux sched_setaffinity) to give each job its own cores")
    if jobs > len(cores):
        raise GcbenchError(f"--jobs {jobs}: only {len(cores)} CPU core(s) available, each job needs one of its own")
    size, extra = divmod(len(cores), jobs)
    slots, start = [], 0
    for j in range(jobs):
        cpus = tuple(cores[start:start + size + (j < extra)])
        start += len(cpus)
        name = f"cpu {cpus[0]}" if len(cpus) == 1 else f"cpus {cpus[0]}-{cpus[-1]}"
        slots.append(Slot(name, cpus=cpus))
    return slots


def _gpu_slots(devices: tuple[str, ...]) -> list[Slot]:
    import torch  # device_count through NVML when PYTORCH_NVML_BASED_CUDA_CHECK is set: no CUDA context here

    count = torch.cuda.device_count()
    if count == 0:
        raise GcbenchError("--devices: CUDA is not available on this machine (on CPU use --jobs)")
    indices = list(range(count)) if devices == ("all",) else [int(d[5:]) for d in devices]
    for index in indices:
        if index >= count:
            raise GcbenchError(f"--devices cuda:{index}: only {count} CUDA device(s) here")
    # CUDA_VISIBLE_DEVICES of this process renumbers the GPUs: a child gets the entry this process calls cuda:N.
    visible = [v.strip() for v in os.environ.get(CUDA_VISIBLE, "").split(",") if v.strip()]
    return [Slot(f"cuda:{i}", cuda_visible=visible[i] if i < len(visible) else str(i)) for i in indices]


def side_by_side_fields(record: dict[str, Any], slot: Slot, slots: int) -> dict[str, Any]:
    """What a record run beside others says about it: where it ran, beside how many, and on CPU that its step
    time is not one a sequential sweep would measure (its memory is exact all the same)."""
    fields: dict[str, Any] = {"device_slot": slot.name, "parallel_jobs": slots}
    if slot.cpus is not None and record.get("status") == Status.OK:
        note = (f"one of {slots} CPU jobs side by side (--jobs): shared caches and memory bandwidth make this step "
                "time not comparable with a sequential run's")
        notes = [*timing_notes_of(record), TimingNote(NoteKind.SIDE_BY_SIDE, note)]
        fields.update(timing_stable=False, **timing_note_fields(notes))
    return fields


_END = object()


def run_side_by_side(items: Iterable[T], workers: Sequence[Callable[[T], None]], cancel: threading.Event,
                     idle: Callable[[int], None] = lambda slot: None) -> None:
    """Each worker (one per slot) takes the next item until none is left; with one worker, in this thread.

    Ctrl-C or SIGTERM (a KeyboardInterrupt in this thread) sets `cancel`: each worker's runner stops its child and
    raises KeyboardInterrupt in that worker, which writes what it measured; once all have stopped it is raised
    here. A worker's error (the results file cannot be written) stops the others the same way and is raised here.
    """
    if len(workers) == 1:
        for item in items:
            workers[0](item)
        return
    queue, lock = iter(items), threading.Lock()
    errors: list[BaseException] = []

    # Each worker's end is an Event, not its thread's join: a join that Ctrl-C or SIGTERM interrupts can leave a
    # living thread marked as ended (CPython gh-90882, seen on 3.11), and the sweep would then exit while that
    # worker still runs, its child killed at exit and recorded as an error.
    ended = [threading.Event() for _ in workers]

    def loop(slot: int) -> None:
        try:
            while not cancel.is_set():
                with lock:
                    item = next(queue, _END)
                if item is _END:
                    break
                workers[slot](item)  # type: ignore[arg-type]
            idle(slot)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            cancel.set()
        finally:
            ended[slot].set()

    threads = [threading.Thread(target=loop, args=(slot,), name=f"gcbench slot {slot}", daemon=True)
               for slot in range(len(workers))]
    try:
        with signals_held():  # interrupted half-way, a worker would run on with no one waiting for it
            for t in threads:
                t.start()
        for end in ended:
            while not end.wait(0.1):  # a timeout: Ctrl-C reaches this thread between the waits
                pass
    except KeyboardInterrupt:
        cancel.set()
        for end in ended:
            end.wait()
        raise
    real = [e for e in errors if not isinstance(e, KeyboardInterrupt)]
    if real:
        raise real[0]
    if errors:
        raise KeyboardInterrupt


def threads_within_slots(specs: list[ResolvedRun], slots: list[Slot], given: bool) -> list[ResolvedRun]:
    """With --jobs, each config's torch threads: by default as many as its slot's cores (the fewest of any slot,
    so that every config of the grid is the same wherever it runs); more than that is refused."""
    cores = min((len(slot.cpus) for slot in slots if slot.cpus), default=None)
    if cores is None:
        return specs
    if given:
        over = max(spec.threads for spec in specs)
        if over > cores:
            raise GcbenchError(f"--threads {over} is more than the {cores} core(s) each of --jobs {len(slots)} gets")
        return specs
    return [spec.replace(threads=cores) for spec in specs]
