"""What a plan across levers may search (levers.py): each lever's candidate values, made of the fields'
declarations, and the levers searched and fixed by a command's --levers and values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.fields import RUN_FIELDS, default_precision, run_field

# The candidate values of each lever a plan searches: the one table, made of the fields' declarations (fields.py:
# `plan`, `plan_role`). `policy` there: fit's policies less `plan` (itself a search over kinds of block, a
# simulation per kind at every size tried) and `sqrtn` (it recomputes as much as `full` and, in the middle of the
# backward, keeps more: ceil(N/k) inputs and k blocks' internals against N inputs and one block's; it fits more
# only where a block's internals are under sqrt(N) inputs, or where the logits put the peak at the backward's start:
# docs/levers.md). A value its field does not declare (yet) is left out when a plan is made.
CANDIDATES: dict[str, tuple[Any, ...]] = {f.name: f.plan for f in RUN_FIELDS if f.plan is not None}
LEVERS = tuple(CANDIDATES)  # what --levers may name
AUTO = tuple(f.name for f in RUN_FIELDS if f.plan is not None and f.plan_role != "named")
CUDA_ONLY = ("qlora", "paged_adamw8bit", "paged_adamw32bit")  # values for a CUDA target only: CUDA's kernels
CPU_PRECISIONS = {"bf16": "fp32", "amp-bf16": "bf16"}  # a CPU target's default is fp32; bf16 the lever


def lever_default(name: str, target: str) -> Any:
    """A lever's value where it is not given: its field's default; the precision `gcbench run` picks on `target`."""
    if name == "precision":
        return default_precision(target)
    return run_field(name).default


def lever_space(levers: str, given: Mapping[str, tuple[Any, ...]], target: str
                ) -> tuple[dict[str, tuple[Any, ...]], dict[str, Any]]:
    """(the levers searched -> their candidates, the levers fixed -> their value) from --levers (auto or
    comma-separated names) and the values given on the command line (field -> values): one value fixes a lever
    (not searched; an error where --levers names it), several are its candidates."""
    words = tuple(n.strip().replace("-", "_") for n in levers.split(","))
    unknown = [n for n in words if n not in (*LEVERS, "auto")]
    twice = [n for i, n in enumerate(words) if n in words[:i]]
    why = (f"unknown lever {unknown[0]!r}" if unknown else "auto (every lever) stands alone: give auto or lever names"
           if "auto" in words and len(words) > 1 else f"lever {twice[0]!r} named twice" if twice else None)
    if why:
        raise GcbenchError(f"--levers {levers!r}: {why} (auto, or some of {', '.join(LEVERS)})")
    names = AUTO if words == ("auto",) else words
    searched: dict[str, tuple[Any, ...]] = {}
    fixed: dict[str, Any] = {}
    for name in names:
        values = tuple(given.get(name, ()))
        if len(values) == 1:
            if words != ("auto",):
                raise GcbenchError(f"--levers names {run_field(name).flag} and --{run_field(name).flag} fixes it to "
                                   f"{values[0]}: search it (leave --{run_field(name).flag} out or give several "
                                   "values) or leave it out of --levers")
            fixed[name] = values[0]
        elif name == "grad_accum":
            if values:
                raise GcbenchError("--levers grad_accum derives the accumulation from the global batch (--batch): "
                                   "give no --grad-accum")
            searched[name] = ()
        else:
            searched[name] = values or _declared(name, target)
    for name, values in given.items():
        if name not in searched and len(values) > 1:
            raise GcbenchError(f"--{run_field(name).flag} takes one value here (several are for levers --levers "
                               "searches)")
        if name not in searched:
            fixed[name] = values[0]
    return searched, fixed


def _declared(name: str, target: str) -> tuple[Any, ...]:
    """The table's candidates of a lever that its field declares (and that run on the target)."""
    values = []
    for value in CANDIDATES[name]:
        if target != "cuda" and value in CUDA_ONLY:
            continue
        if name == "precision" and target != "cuda":
            value = CPU_PRECISIONS[value]
        try:
            run_field(name).parse(value)
        except GcbenchError:  # not declared (yet) by its field
            continue
        values.append(value)
    return tuple(values)
