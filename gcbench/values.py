"""One parser per kind of value a run or a sweep takes: a whole number in a range, seconds, on/off, a size, a name,
one of a few choices, a device, a policy. The command line (a string), a TOML file (its types) and Python (its
types) all go through the same `parse`, so `on`, `true` and True are one switch value wherever a switch is taken.
Each kind raises GcbenchError with what it expected; the field that uses it (fields.Field) names the option.
Imports nothing above it and nothing heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gcbench.errors import GcbenchError
from gcbench.units import checked_bytes, parse_bytes

AUTO = "auto"  # --steps auto, --threads auto, --device auto


def shown(value: Any, most: int = 60) -> str:
    """A value as an error quotes it: its repr, cut to `most` characters (a TOML file may nest a value thousands
    deep: the error stays one readable line)."""
    text = repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def split_items(text: str) -> list[str]:
    """A comma list as typed: "512,1024" -> ["512", "1024"]; an empty item ("512,,1024", "512,") is refused, not
    skipped: a value may have been lost in typing. Empty text is no items (the caller says what that means)."""
    items = [s.strip() for s in text.split(",")]
    if any(items) and not all(items):
        raise GcbenchError(f"an empty item in {shown(text)} (a value between two commas, or after the last)")
    return [s for s in items if s]


def option_items(option: str, text: str) -> list[str]:
    """split_items for an option of its own (--method, --tiers, a lever's options): its error names the option."""
    try:
        return split_items(text)
    except GcbenchError as e:
        raise GcbenchError(f"{option}: {e}") from None


@dataclass(frozen=True)
class Kind:
    """A kind of value: how one value is read from what the command line, a TOML file or Python gives."""

    metavar = "VALUE"
    python_type = "Any"

    def parse(self, value: Any) -> Any:
        raise NotImplementedError

    def split(self, text: str) -> list[str]:
        """Several values in one string (a sweep's --seq 512,1024)."""
        return split_items(text)

    def show(self, value: Any) -> str:
        """A value as one would type it."""
        return str(value)


@dataclass(frozen=True)
class Int(Kind):
    """A whole number from `lo` to `hi`. Above the ranges given below: sizes no machine holds (int64 overflows in
    torch), step counts that would run for days, seeds torch.manual_seed refuses."""

    lo: int = 1
    hi: int = 2**31 - 1
    why_lo: str = ""  # why the lowest value is what it is, said when a value is below it
    metavar = "INT"
    python_type = "int"

    def parse(self, value: Any) -> int:
        # bool is an int in Python; `seq = true` in TOML is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, (int, str)) or \
                not re.fullmatch(r"\s*-?[0-9]+\s*", str(value)):
            raise GcbenchError(f"{shown(value)} is not an integer")
        number = int(value)
        if number < self.lo and self.why_lo:
            raise GcbenchError(f"must be at least {self.lo}, got {number}: {self.why_lo}")
        if not self.lo <= number <= self.hi:
            raise GcbenchError(f"must be an integer from {self.lo} to {self.hi:,}, got {number}")
        return number


@dataclass(frozen=True)
class IntOrAuto(Int):
    """A whole number, or "auto" (the field's own rule decides)."""

    metavar = "N|auto"
    python_type = "int | str"

    def parse(self, value: Any) -> int | str:
        if isinstance(value, str) and value.strip() == AUTO:
            return AUTO
        if isinstance(value, bool) or not re.fullmatch(r"\s*-?[0-9]+\s*", str(value)):
            raise GcbenchError(f"{shown(value)} is neither an integer nor 'auto'")
        try:
            return super().parse(value)
        except GcbenchError as e:
            raise GcbenchError(f"{e} (or auto)") from None


@dataclass(frozen=True)
class Seconds(Kind):
    """A positive number of seconds, at most `most`."""

    most: float = 86_400.0
    metavar = "SECONDS"
    python_type = "float"

    def parse(self, value: Any) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise GcbenchError(f"expected seconds, got {shown(value)}") from None
        if isinstance(value, bool) or not 0 < seconds <= self.most:
            most = f" and at most {self.most:g}" if self.most < float("inf") else ""
            raise GcbenchError(f"must be a number of seconds above 0{most}, got {shown(value)}")
        return seconds


SWITCH_WORDS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
                "0": False}


@dataclass(frozen=True)
class Switch(Kind):
    """on | off (true/false, yes/no, 1/0 too; a TOML or Python boolean as it is)."""

    metavar = "on|off"
    python_type = "bool"

    def parse(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in SWITCH_WORDS:
            return SWITCH_WORDS[value.strip().lower()]
        raise GcbenchError(f"expected on or off, got {shown(value)}")

    def show(self, value: Any) -> str:
        return "on" if value else "off"


@dataclass(frozen=True)
class Name(Kind):
    """A non-empty name (a model preset, a path, a Hub id)."""

    metavar = "NAME"
    python_type = "str"

    def parse(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise GcbenchError(f"expected a name, got {shown(value)}")
        return value.strip()


@dataclass(frozen=True)
class Choice(Name):
    """One of `choices`; `what` names the kind of thing in the error ("unknown precision 'fp8'")."""

    choices: tuple[str, ...] = ()
    what: str = "value"

    def parse(self, value: Any) -> str:
        name = super().parse(value)
        if name not in self.choices:
            raise GcbenchError(f"unknown {self.what} {name!r} ({', '.join(self.choices)})")
        return name


@dataclass(frozen=True)
class Device(Name):
    """auto | cpu | cuda | cuda:N, by its form (which GPUs exist is the spec's to check)."""

    def parse(self, value: Any) -> str:
        name = super().parse(value)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
            raise GcbenchError(f"unknown device {name!r} (auto, cpu, cuda, cuda:N)")
        return name


@dataclass(frozen=True)
class Size(Kind):
    """A positive number of bytes: text with its unit (2GiB, 500MB, 512B), or an int (bytes: a record's, the Python
    API's; a TOML file's size is text, grid.parse_options)."""

    metavar = "SIZE"
    python_type = "int"

    def parse(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise GcbenchError(f"expected a size such as 2GiB, got {shown(value)}")
        return checked_bytes(value) if isinstance(value, int) else parse_bytes(value)  # an int is bytes


@dataclass(frozen=True)
class OptionText(Kind):
    """`name` or `name:key=value[,key=value]`: a lever with options (`--adapter lora:r=16,alpha=32`, `--loss
    chunked:n=8`). Read here by its form only, stripped; which names and options exist is the lever's module to
    say when the run is resolved. Several values in one string split where a piece names a new lever (has no
    '=' or has a ':'), so "lora:r=8,alpha=16,none" is two values."""

    what: str = "value"
    metavar = "NAME[:K=V,...]"
    python_type = "str"

    def parse(self, value: Any) -> str:
        if not isinstance(value, str):
            raise GcbenchError(f"expected {self.what} as text (name or name:key=value), got {shown(value)}")
        if not value.strip():
            raise GcbenchError(f"expected {self.what}, got an empty string")
        return value.strip()

    def split(self, text: str) -> list[str]:
        return join_options(split_items(text))


def join_options(pieces: list[str]) -> list[str]:
    """Comma pieces put back together: a piece with '=' but no ':' is one more option of the value before it
    ("foo:a=1,b=2,none" -> ["foo:a=1,b=2", "none"])."""
    texts: list[str] = []
    for piece in pieces:
        if texts and "=" in piece and ":" not in piece:
            texts[-1] += "," + piece
        else:
            texts.append(piece)
    return texts


@dataclass(frozen=True)
class PolicyText(Kind):
    """`name` or `name:key=value[,key=value]` (`gcbench policies`). Read here by its form; which names and options
    exist is the policy registry's to say, when the spec is made. A Policy object from Python is taken as it is."""

    metavar = "POLICY"
    python_type = "Policy"

    def parse(self, value: Any) -> Any:
        if not isinstance(value, str):
            if callable(getattr(value, "options", None)):
                return value  # a Policy already
            raise GcbenchError(f"expected a policy string, got {shown(value)}")
        if not value.strip():
            raise GcbenchError("expected a policy, got an empty string")
        return value.strip()

    def split(self, text: str) -> list[str]:
        return join_options(split_items(text))
