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
from typing import Any, Literal

from gcbench.fields import DERIVED_TYPES, RUN_FIELDS
from gcbench.units import MAX_BYTES
from gcbench.values import shown

Check = Callable[[Any], bool]
# A run field's value as a record stores it, by its kind's python_type (values.py): a policy as its name
SPEC_TYPES: dict[str, Any] = {"int": int, "int | str": int | Literal["auto"], "float": float, "bool": bool,
                              "str": str, "Policy": str}
SCALAR = str | int | float | bool  # an `env` value: versions, names, counts, flags (env.capture_env)
# What a measurement can be: bytes from 0 to 1 EiB (units.MAX_BYTES), milliseconds from 0 to about four months (a
# step longer than that was never measured), a time ratio above 0, rates and spreads from 0. A value past these
# is no measurement (a crafted or damaged file) and would break a table's scale or a figure's axis.
MAX_MS = 1e10
RANGES = {"_bytes": (0, MAX_BYTES), "step_ms": (0, MAX_MS), "wall_ms": (0, MAX_MS), "_ms_median": (0, MAX_MS),
          "_ms_iqr": (0, MAX_MS), "compile_ms": (0, MAX_MS), "config_wall_ms": (0, MAX_MS), "_per_s": (0, math.inf),
          "_rel_iqr": (0, math.inf), "time_ratio": (0, math.inf), "mfu": (0, math.inf)}
# A text field (a name, an error, a child's last lines of output: kilobytes) past this is no record's: a table would
# spend minutes wrapping it
MAX_TEXT = 2**18


def field_problem(name: str, value: Any, schema: type) -> str | None:
    """Why `value` cannot be the record's `name` field, as `schema` (a TypedDict: schema.Record) declares it, or
    as a measurement (RANGES); None where it can (or where the schema does not say). A run field by its type only,
    not by today's limits on what a command accepts: a record keeps what the gcbench that wrote it accepted (an
    older one took --warmup 0)."""
    if value is None:
        return None
    check, hint, bounds = _checks(schema).get(name) or (None, None, None)
    if check is not None and not check(value):
        return f"{name} is {shown(value)}, not {_words(hint)}"
    if bounds is None:
        return None
    values = [v for v in value if v is not None] if isinstance(value, list) else [value]
    lo, hi = bounds
    if not values or lo <= min(values) and max(values) <= hi and not (name == "time_ratio" and min(values) == 0):
        return None
    bad = next(v for v in values if not (lo <= v <= hi) or (name == "time_ratio" and v == 0))
    return f"{name} is {shown(bad)}, " + ("not above 0" if name == "time_ratio" else
                                          f"outside {lo:g}..{hi:g}" if hi < math.inf else "below 0")


@cache
def _checks(schema: type) -> dict[str, tuple[Check, Any, tuple[float, float] | None]]:
    """Each field's check, its declared type and, for a measurement, its bounds; null taken apart (field_problem
    returns on it first), so that `int | None` checks as `int`."""
    hints = typing.get_type_hints(schema)
    hints["env"] = dict[str, SCALAR]
    hints.update(DERIVED_TYPES)
    for f in RUN_FIELDS:
        hints.setdefault(f.name, SPEC_TYPES.get(f.kind.python_type, Any))
    bounds = {name: next((b for suffix, b in RANGES.items() if name.endswith(suffix)), None) for name in hints}
    return {name: (_check(_without_none(hint)), hint, bounds[name]) for name, hint in hints.items()}


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = tuple(a for a in typing.get_args(hint) if a is not type(None))
        return parts[0] if len(parts) == 1 else typing.Union[parts]
    return hint


def _check(hint: Any) -> Check:
    """A predicate for `hint`: bool apart from int, int apart from bool, a float any finite number, containers
    item by item; a hint it does not know (Any) takes anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_check(a) for a in args]
        return lambda v: any(p(v) for p in parts)
    if origin is Literal:
        return lambda v: isinstance(v, str) and v in args
    if origin is list and args and args[0] in (int, float):  # a run's steps: thousands of numbers, checked at C speed
        kinds = {int} if args[0] is int else {int, float}
        return lambda v: type(v) is list and set(map(type, v)) <= kinds and math.isfinite(sum(v))
    if origin is list:
        item = _check(_without_none(args[0])) if args else _anything
        return lambda v: type(v) is list and all(x is None or item(x) for x in v)
    if origin is dict:
        item = _check(_without_none(args[1])) if len(args) == 2 else _anything
        return lambda v: type(v) is dict and all(type(k) is str and (x is None or item(x)) for k, x in v.items())
    simple: dict[Any, Check] = {
        type(None): lambda v: v is None,
        bool: lambda v: type(v) is bool,
        int: lambda v: type(v) is int,
        float: lambda v: type(v) is int or type(v) is float and math.isfinite(v),
        str: lambda v: type(v) is str and len(v) <= MAX_TEXT,
    }
    return simple.get(hint, _anything)


def _anything(value: Any) -> bool:
    return True


def _words(hint: Any) -> str:
    """`int | None` -> "an int"; list[float] -> "a list of finite numbers"; dict[str, int] -> "an object of ints"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_words(a) for a in args if a is not type(None))
    if origin is Literal:
        return " or ".join(map(repr, args))
    if origin in (list, dict):
        return ("a list of " if origin is list else "an object of ") + (_nouns(args[-1]) if args else "values")
    return {bool: "true or false", int: "an int", float: "a finite number",
            str: f"a string of at most {MAX_TEXT:,} characters"}.get(hint, str(hint))


def _nouns(hint: Any) -> str:
    parts = [a for a in typing.get_args(hint) or (hint,) if a is not type(None)]
    nouns = {bool: "flags", int: "ints", float: "finite numbers", str: "strings"}
    return " or ".join(nouns.get(a, "values") for a in parts)
