"""What each field of a record may hold, read off the schema's own declarations: `schema.Record`'s annotations and
the run fields' kinds (fields.py). A reader refuses a record whose field holds another type (a `seed` of "zz", a
`step_ms` of [1, "a"], a peak of NaN) with one line naming it, instead of a table or a figure failing on it later.

Null stands for a field a record does not have (an older schema, a measurement that did not happen): every field may
be null here; which fields a record must have is schema.record_problem's to say. Numbers are finite: JSON's NaN and
Infinity, which Python's json reads, are no measurement.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.fields import RUN_FIELDS
from gcbench.units import MAX_BYTES
from gcbench.values import shown

Check = Callable[[Any], bool]
# A run field's value as a record stores it, by its kind's python_type (values.py): a policy as its name
SPEC_TYPES: dict[str, Any] = {"int": int, "int | str": int | str, "float": float, "bool": bool, "str": str,
                              "Policy": str}
SCALAR = str | int | float | bool  # an `env` value: versions, names, counts, flags (env.capture_env)
SPEC = {f.name: f for f in RUN_FIELDS}


def field_problem(name: str, value: Any, schema: type) -> str | None:
    """Why `value` cannot be the record's `name` field, as `schema` (a TypedDict: schema.Record) declares it; None
    where it can (or where the schema does not say). A run field's value is read by its kind, as a TOML file's is
    (a seq of 0, threads of "zz" are refused)."""
    if value is None:
        return None
    if (field := SPEC.get(name)) is not None:
        try:
            field.kind.parse(value)
        except GcbenchError as e:
            return f"{name}: {e}"
    check, hint = _checks(schema).get(name, (None, None))
    if check is None or check(value):
        return None
    return f"{name} is {shown(value)}, not {_words(hint)}"


# What a measurement can be: bytes from 0 to 1 EiB (units.MAX_BYTES), milliseconds from 0 to about four months (a
# step longer than that was never measured), a time ratio above 0, rates and spreads from 0. A value past these
# is no measurement (a crafted or damaged file) and would break a table's scale or a figure's axis.
MAX_MS = 1e10
# A text field (a name, an error, a child's last lines of output: kilobytes) past this is no record's: a table would
# spend minutes wrapping it
MAX_TEXT = 2**18
RANGES = {"_bytes": (0, MAX_BYTES), "step_ms": (0, MAX_MS), "wall_ms": (0, MAX_MS), "_ms_median": (0, MAX_MS),
          "_ms_iqr": (0, MAX_MS), "compile_ms": (0, MAX_MS), "config_wall_ms": (0, MAX_MS), "_per_s": (0, math.inf),
          "_rel_iqr": (0, math.inf), "time_ratio": (0, math.inf), "mfu": (0, math.inf)}


def range_problem(name: str, value: Any) -> str | None:
    """Why a measurement's number (or each of a list's) is no measurement (RANGES); None where it is one, where
    the field is no measurement, or where its type is wrong (field_problem says so)."""
    bounds = next((b for suffix, b in RANGES.items() if name.endswith(suffix)), None)
    values = value if isinstance(value, list) else [value]
    if bounds is None or not values or not set(map(type, values)) <= {int, float}:
        return None
    lo, hi = bounds
    if lo <= min(values) and max(values) <= hi and not (name == "time_ratio" and min(values) == 0):
        return None
    bad = next(v for v in values if not (lo <= v <= hi) or (name == "time_ratio" and v == 0))
    return f"{name} is {shown(bad)}, " + ("not above 0" if name == "time_ratio" else
                                          f"outside {lo:g}..{hi:g}" if hi < math.inf else "below 0")


@cache
def _checks(schema: type) -> dict[str, tuple[Check, Any]]:
    hints = typing.get_type_hints(schema)
    hints["env"] = dict[str, SCALAR]
    for f in RUN_FIELDS:
        hints.setdefault(f.name, SPEC_TYPES.get(f.kind.python_type, Any))
    return {name: (_check(hint), hint) for name, hint in hints.items()}


def _check(hint: Any) -> Check:
    """A predicate for `hint`: bool apart from int, int apart from bool, a float any finite number, containers
    item by item; a hint it does not know (Any) takes anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_check(a) for a in args]
        return lambda v: any(p(v) for p in parts)
    if origin is list and args and args[0] in (int, float):  # a run's steps: thousands of numbers, checked at C speed
        kinds = {int} if args[0] is int else {int, float}
        return lambda v: isinstance(v, list) and set(map(type, v)) <= kinds and math.isfinite(sum(v))
    if origin is list:
        item = _check(args[0]) if args else _anything
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        item = _check(args[1]) if len(args) == 2 else _anything
        return lambda v: isinstance(v, dict) and all(isinstance(k, str) and (x is None or item(x))
                                                      for k, x in v.items())
    simple: dict[Any, Check] = {
        type(None): lambda v: v is None,
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v),
        str: lambda v: isinstance(v, str) and len(v) <= MAX_TEXT,
    }
    return simple.get(hint, _anything)


def _anything(value: Any) -> bool:
    return True


def _words(hint: Any) -> str:
    """`int | None` -> "an int"; list[float] -> "a list of numbers"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_words(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {_words(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is dict:
        return "an object" + (f" of {_words(args[1]).removeprefix('a ').removeprefix('an ')}s" if args else "")
    return {bool: "true or false", int: "an int", float: "a finite number",
            str: f"a string of at most {MAX_TEXT:,} characters"}.get(hint, str(hint))
