"""Panels stay readable however long a model setup's name or however many policies a panel holds."""

from __future__ import annotations

from matplotlib.figure import Figure

from gcbench.report.figure_layout import CROWDED, TITLE_CHARS, panel_title, policy_ticks

LONG = "llama-7b · 8 layers · bf16 · adamw8bit · optimizer in backward"


def test_a_long_setup_wraps_between_its_parts_and_keeps_every_word():
    ax = Figure().subplots()
    panel_title(ax, LONG, "seq 2048 x batch 4")
    lines = ax.get_title().split("\n")
    assert lines == ["llama-7b · 8 layers · bf16 · adamw8bit", "optimizer in backward", "seq 2048 x batch 4"]
    assert all(len(line) <= TITLE_CHARS for line in lines)
    panel_title(ax, "gpt2 · bf16 · adamw", "seq 1024")
    assert ax.get_title() == "gpt2 · bf16 · adamw\nseq 1024"


def test_policy_names_slant_only_where_a_panel_is_crowded():
    ax = Figure().subplots()
    policy_ticks(ax, ["none", "full"])
    assert {t.get_rotation() for t in ax.get_xticklabels()} == {15}
    many = [f"every-k:k={k}" for k in range(CROWDED + 1)]
    policy_ticks(ax, many)
    labels = ax.get_xticklabels()
    assert [t.get_text() for t in labels] == many
    assert {t.get_rotation() for t in labels} == {35} and {t.get_horizontalalignment() for t in labels} == {"right"}
