"""Simulations shared within one process: each distinct one runs once, and side by side with the others where the
machine has cores to spare.

- Reuse: a fit's search, a plan's choice and the step time of the size found ask for the same simulation more
  than once (the plan's chosen mix is simulated to check it, then predicted as the plan, then counted for its
  FLOPs). Each is kept, by what the simulation reads of its run, for the life of the process: in memory only,
  never on disk.
- Cores: inside `sharing_cores`, simulations run in worker processes forked from this one once its imports are
  done (a worker starts in milliseconds with torch and transformers loaded), started by any thread of this
  process; `side_by_side` runs independent jobs (a grid's cells, a fit's policies) in threads of their own that
  wait on the workers. A worker returns the estimate, or the GcbenchError the simulation raised, unchanged.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from gcbench.heap import freeze_heap

T = TypeVar("T")
R = TypeVar("R")

KEPT = 512  # simulations kept per process (an estimate is a few hundred bytes; a fit makes a few dozen)

_lock = threading.Lock()
_kept: dict[Hashable, tuple[Future, frozenset[str]]] = {}  # key -> (the estimate to come, what it holds)
_pool: ProcessPoolExecutor | None = None
_in_worker = False


def shared(key: Hashable, holds: frozenset[str], compute: Callable[..., Any], *args: Any) -> Future:
    """The future result of `compute(*args)`, computed once per `key` in this process (again only where this one
    `holds` something the kept one does not: what a simulation carries beyond its peaks, "flops", "work"): in a
    worker inside `sharing_cores`, else here and now. `compute` and its arguments must pickle (a module-level
    function, or a functools.partial of one, and plain values). A GcbenchError is kept like a result."""
    with _lock:
        kept = _kept.get(key)
        if kept is not None and holds <= kept[1]:
            return kept[0]
        future = _pool.submit(compute, *args) if _pool is not None else Future()
        _kept[key] = (future, holds)
        while len(_kept) > KEPT:
            _kept.pop(next(iter(_kept)))
    if _pool is None:  # computed outside the lock: it may take seconds, and it may itself ask for others
        try:
            future.set_result(compute(*args))
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on it, as a worker's would be
            future.set_exception(e)
        except BaseException:  # an interruption is no result: not kept
            with _lock:
                _kept.pop(key, None)
            raise
    return future


def kept(key: Hashable) -> Future | None:
    """The kept future of `key` that counts FLOPs, if any."""
    with _lock:
        found = _kept.get(key)
    return found[0] if found is not None and "flops" in found[1] else None


def forget() -> None:
    """Drop every kept simulation (tests that change what a simulation sees call this)."""
    with _lock:
        _kept.clear()


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def sharing_cores(jobs: int, at_once: bool = False) -> Iterator[int]:
    """Within: simulations run in worker processes, one per core and at most one per job; `at_once` (independent
    jobs of about one length): all of them at once where they are at most two per core (three such on two cores
    end together after one and a half lengths, not two; measured: 7.7 s against 8.5 s for three 7B simulations).
    A search, whose jobs wait on each other, keeps one per core (a 7B fit: 33 s against 40 s). Yields the number
    of workers; 1 (nothing forked, everything in this process as before) with one core or one job, inside a worker
    or an outer `sharing_cores`, where fork does not exist, or in a process running other threads (a notebook's
    kernel, a server calling gcbench): a fork copies the locks they hold, and a worker could wait on one forever."""
    global _pool
    n = 1 if cores() < 2 else jobs if at_once and jobs <= 2 * cores() else min(cores(), jobs)
    if n < 2 or _pool is not None or _in_worker or "fork" not in multiprocessing.get_all_start_methods() \
            or threading.active_count() > 1:
        yield 1
        return
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_become_worker)
    # Fork every worker now, from the thread that holds no lock: a fork copies the locks other threads hold, and
    # side_by_side's threads start only after this (ProcessPoolExecutor forks all its workers on the first submit).
    pool.submit(int).result()
    _pool = pool
    try:
        yield n
    finally:
        _pool = None
        pool.shutdown(wait=True, cancel_futures=True)


def _become_worker() -> None:
    global _in_worker
    _in_worker = True
    # What the worker inherited, out of the collector's sight (gc.freeze, as the gc module's docs advise after a
    # fork without exec, and as the sweep's fork server does): the collection before its first simulation
    # (heap.collect_garbage) then walks only what the worker made, not the ~10^6 objects of torch, transformers
    # and the modeling code (0.2 s, at the head of the longest simulation, on 2 cores). The parent's heap is left
    # as it was: frozen there, a cycle holding a run's memory would be kept for good. The inherited garbage is a
    # copy, never freed inside a step, which is what the collection is for.
    freeze_heap()


def side_by_side(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(item) for item in items], in order; inside `sharing_cores` each in a thread of its own, so that the
    simulations they ask for run side by side in the workers. The first item's exception, in order, is raised."""
    items = list(items)
    if _pool is None or len(items) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(len(items)) as threads:
        return list(threads.map(fn, items))
