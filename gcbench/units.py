"""Sizes and counts for people: parsing what a user types (2GiB) and formatting stored raw values for display.

Binary units are binary (GiB = 2**30) and decimal units decimal (GB = 10**9), never mixed up. No torch, no pandas:
the CLI, the sweep's progress lines and the report all use these.
"""

from __future__ import annotations

import math
import re

from gcbench.errors import GcbenchError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15, "EB": 10**18,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50, "EIB": 2**60}


MAX_BYTES = 2**60  # 1 EiB: a size past this is a typo, and past 2**63 no longer an int64


def parse_bytes(text: str, option: str = "") -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '512B' -> 512 (GiB = 2**30, GB = 10**9). A number without its
    unit is refused: `--gpu-memory 80` meant 80 GiB or 80 GB, not 80 bytes (an int from a record or the Python API
    is bytes: `checked_bytes`). `option`: the option it was given to (--memory), named first in the error."""
    lead = f"{option}: " if option else ""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise GcbenchError(f"{lead}cannot read {text!r} as a size (examples: 24GiB, 512MiB, 80GB)")
    if not m.group(2) and float(m.group(1)) >= 1:
        number = m.group(1)
        raise GcbenchError(f"{lead}size {text!r} has no unit: write {number}GiB, {number}GB or {number}B (bytes)")
    return checked_bytes(float(m.group(1)) * _UNITS[m.group(2).upper()], text, lead)


def checked_bytes(value: float, text: object = None, lead: str = "") -> int:
    """`value` bytes as an int, refused below 1 byte or beyond MAX_BYTES (`text`: how it was given, for the
    error)."""
    shown = repr(text if text is not None else value)
    if not 1 <= value <= MAX_BYTES:
        raise GcbenchError(f"{lead}size {shown} must be at least 1 byte" if value < 1 else
                           f"{lead}size {shown} is beyond any memory (at most {fmt_bytes(MAX_BYTES)})")
    return int(value)


def fmt_bytes(n: float | None) -> str:
    """Binary units (GiB = 2**30), scaled to stay readable for tiny and 7B models alike."""
    if n is None:
        return "-"
    for scale, unit in ((2**60, "EiB"), (2**50, "PiB"), (2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_change(fraction: float) -> str:
    """A relative change or error as a signed percentage, one decimal: 0.123 -> '+12.3%'; never '-0.0%' (a
    change that rounds to nothing has no sign)."""
    return f"{round(fraction, 3) or 0.0:+.1%}"


def human_count(n: float | None, unit: str = "") -> str:
    """1.5e9 -> '1.50 G' + unit (decimal prefixes: FLOPs, parameters, tokens)."""
    if n is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".strip()


def plural(n: float, noun: str, many: str | None = None) -> str:
    """'1 block', '2 blocks', '0 blocks' (`many`: an irregular plural). Integral floats (counts read back from a
    DataFrame) print without '.0'."""
    shown = int(n) if isinstance(n, float) and n.is_integer() else n
    return f"{shown} {noun if n == 1 else many or noun + 's'}"


def byte_unit(max_bytes: float | None) -> tuple[int, str]:
    """One binary unit for a whole column (GiB = 2**30), so its values compare at a glance."""
    given = max_bytes is not None and not (isinstance(max_bytes, float) and math.isnan(max_bytes))
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if given and max_bytes >= scale:
            return scale, unit
    return 2**10, "KiB"


def round_up(nbytes: int, granularity_bytes: int) -> int:
    """`nbytes` rounded up to a multiple of `granularity_bytes` (512 models the CUDA caching allocator's blocks)."""
    return -(-nbytes // granularity_bytes) * granularity_bytes
