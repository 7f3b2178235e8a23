"""The table `gcbench models` prints: the presets, grouped by what they train, each group under its name."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from gcbench.results.schema import stack_counts
from gcbench.text import markup

NUMBERS = ("params", "layers", "hidden", "heads", "vocab", "max seq")


def models_table(rows: list[dict[str, Any]], wide: bool) -> Table:
    """`rows`: models.describe's, in the order shown (a group of one modality after another); `wide`: with the
    one-line summaries (where they need not wrap)."""
    table = Table(title="model presets (random weights, built from their config.json)", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True,
                  caption="heads: query/key-value heads · layers: a model of two stacks' per stack (encoder+decoder, "
                  "vision+language) · sources of the values: docs/models.md"
                  + ("" if wide else "\n(summaries in a terminal of 120 columns or more)"), caption_justify="left")
    for col in ("name", "family", *NUMBERS, *(["summary"] if wide else [])):
        table.add_column(col, justify="right" if col in NUMBERS else "left", no_wrap=col != "summary")
    for i, row in enumerate(rows):
        if i == 0 or row["modality"] != rows[i - 1]["modality"]:
            table.add_row(f"[bold]{markup(row['modality'])}[/bold]")
        params = f"{row['params'] / 1e9:.2f} B" if row["params"] >= 1e9 else f"{row['params'] / 1e6:.1f} M"
        last = i + 1 == len(rows) or row["modality"] != rows[i + 1]["modality"]
        counts = stack_counts(row.get("stacks"))  # None for a model of one stack
        layers = "+".join(count for _, count in counts) if counts else row["layers"]
        table.add_row(markup(row["name"]), markup(row["family"]), params, markup(layers), str(row["hidden"]),
                      f"{row['heads']}/{row['kv_heads']}", str(row["vocab"] or "-"), str(row["max_seq"] or "-"),
                      *([markup(row["summary"])] if wide else []), end_section=last and i + 1 < len(rows))
    return table
