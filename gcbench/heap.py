"""The garbage collector around gcbench's runs and simulations: what is collected before one, and what is frozen
(gc.freeze) so that no later collection walks it. Torch-free: a fork's worker calls it before anything else."""

from __future__ import annotations

import gc
import sys

_modules_frozen: set[str] = set()  # the modules imported when freeze_heap last froze the heap (empty: never)
_made_nothing_yet = False  # a command's process before its first freeze (made_nothing_yet)


def made_nothing_yet() -> None:
    """Say that this process has made nothing of a run yet: a command's, from its entry point (__main__.py). Its
    first freeze then comes without a collection before it, which would walk the ~10^6 objects of torch and
    transformers (0.2 s on 2 cores, the first run's) for the little garbage their imports leave: frozen with the
    rest, never freed inside a step either (the gc module's docs advise no collection before a freeze; the
    sweep's fork server does the same). Not for a process that may hold a run's memory in a cycle (a notebook
    calling gcbench): frozen, a cycle through it would keep that memory for good."""
    global _made_nothing_yet
    _made_nothing_yet = True


def collect_garbage(freeze: bool = True) -> None:
    """The reference cycles made since the heap was frozen, collected (gc.collect), before a run or a simulation that
    must not see them freed inside its step. Where nothing froze it yet (the fork server does, for its children; a
    command's process freezes at its first call without collecting: made_nothing_yet), the first call collects the
    whole heap once, then freezes what survives (gc.freeze: the gc module's permanent generation, never walked
    again): each later call walks only what came after, not the ~10^6 objects of torch and transformers (0.22 s a
    call on 2 CPU cores, a quarter of a tiny model's simulation). So again after a module was imported since (peft,
    bitsandbytes, a family's modeling code: ~86,000 objects that would otherwise be walked by every later call, 0.05
    s each on 2 cores). A cycle among the frozen objects is never freed, so never inside a step either; so `freeze`
    only where nothing of a run may be alive still (not at a session's end, where the run's model may be: frozen, a
    cycle through it would keep its memory for good)."""
    global _made_nothing_yet
    if freeze and _made_nothing_yet:
        _made_nothing_yet = False
        freeze_heap()  # nothing of a run exists yet, and nothing before the freeze is walked again
        return
    _made_nothing_yet = False
    gc.collect()
    if freeze and heap_grew():
        freeze_heap()


def freeze_heap() -> None:
    """gc.freeze, noting which modules were imported then (heap_grew): where gcbench freezes the heap (but for a
    command's exit, __main__.py, after which nothing runs)."""
    global _modules_frozen
    gc.freeze()
    _modules_frozen = set(sys.modules)


def heap_grew() -> bool:
    """Whether collect_garbage would freeze: the heap never frozen by freeze_heap, or a module imported since it
    last was. Read off the modules alone: gc.get_freeze_count() walks the frozen objects one by one (26 ms for
    torch's and transformers' ~300,000 on 2 cores, and a run asks twice)."""
    return not _modules_frozen.issuperset(sys.modules)
