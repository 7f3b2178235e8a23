"""What both published tables (rows.toml: memory, speed.toml: step times) hold every row to before a row's own
rules: the file is TOML with [[row]] entries, each row has the table's fields, its id is unique, and it has
exactly one outcome (spec, not_expressible, rejected); a library version a row names reads as "1.10"."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import legacy  # noqa: E402  (benchmarks/published/legacy.py, beside this file)
from gcbench.errors import GcbenchError
from gcbench.text import plain


def read_rows(path: Path, required: tuple[str, ...], what: str) -> list[dict[str, Any]]:
    """The rows of `path` (`what`: the table's words in an error), each checked as the module docstring says;
    GcbenchError naming the file and the first bad row."""
    try:
        rows = tomllib.loads(path.read_text(encoding="utf-8")).get("row", [])
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise GcbenchError(f"{plain(path)}: cannot read the {what}: {plain(e)}") from None
    if not rows:
        raise GcbenchError(f"{plain(path)}: no [[row]] entries")
    seen = set()
    for i, row in enumerate(rows, 1):
        name = plain(row.get("id", f"row {i}"))
        missing = [f for f in required if f not in row]
        if missing:
            raise GcbenchError(f"{plain(path)}: {name} lacks {', '.join(missing)}")
        if row["id"] in seen:
            raise GcbenchError(f"{plain(path)}: id {name} appears twice")
        seen.add(row["id"])
        if sum(k in row for k in ("spec", "not_expressible", "rejected")) != 1:
            raise GcbenchError(f"{plain(path)}: {name} needs exactly one of spec, not_expressible, rejected")
    return rows


def check_versions(path: Path, row: dict[str, Any]) -> None:
    """The torch and transformers versions a row names, each a version string like "1.10"."""
    for library in ("torch", "transformers"):
        if library in row and not is_version(row[library]):
            raise GcbenchError(f"{plain(path)}: {plain(row['id'])}: {library} {plain(row[library])!r} is not a "
                               "version string like \"1.10\"")


def is_version(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        legacy.parse_version(text)
    except ValueError:
        return False
    return True
