"""What the host does in a step that no dispatched op shows, told to the step-time model
(estimators/step_clock.py) as it happens: who issues the ops running inside a backward (Python forward code
recomputing, the optimizer stepped by a hook, else autograd's engine), and each op a policy's Python dispatch mode
handles. Real runs tell nobody: with no listener, each call is a list check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

# Told of each op a Python dispatch mode of a policy handles (SAC's caching modes call gcbench's policy function for
# every op of a checkpointed block, forward and recompute): the step-time model charges the host time that costs. A
# list, not a context variable: CUDA runs the backward (and so the recompute) on autograd's own thread.
_PYTHON_DISPATCH: list[Callable[[], None]] = []


@contextmanager
def listening_to_python_dispatch(listener: Callable[[], None]):
    _PYTHON_DISPATCH.append(listener)
    try:
        yield
    finally:
        _PYTHON_DISPATCH.remove(listener)


def note_python_dispatch() -> None:
    """A policy's Python dispatch mode handled one op (a no-op unless a step-time model listens)."""
    if _PYTHON_DISPATCH:
        _PYTHON_DISPATCH[-1]()


# What Python code is issuing ops inside a backward, innermost last: "forward" (a checkpoint's recompute, the model's
# Python forward again), "optimizer" (the optimizer stepped in backward by a hook). Elsewhere in a backward, autograd's
# C++ engine issues them. The step-time model charges host time by who issues (estimators/step_time.py). A list, not a
# context variable: CUDA runs the backward on autograd's own thread.
PYTHON_ISSUING: list[str] = []


# The step-time clocks now watching (estimators/step_clock.py registers itself): with none, nothing is noted, and
# nothing here is called that torch.compile would have to trace (a compiled block's checkpoint runs this code).
WATCHING: list[object] = []


def python_issuing(what: str):
    """A context in which `what` ("forward", "optimizer") issues the ops, where a clock watches; else nothing."""
    return _issuing(what) if WATCHING else nullcontext()


@contextmanager
def _issuing(what: str) -> Iterator[None]:
    PYTHON_ISSUING.append(what)
    try:
        yield
    finally:
        PYTHON_ISSUING.pop()


def recompute_issuing() -> Iterator[None]:
    """python_issuing("forward") where a clock watches and this thread runs a backward (a checkpoint's recompute,
    autograd's graph task), else nothing."""
    if WATCHING and torch._C._current_graph_task_id() != -1:
        return python_issuing("forward")
    return nullcontext()
