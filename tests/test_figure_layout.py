"""Panels stay readable however long a model setup's name or however many policies a panel holds; labels name
what sets configs apart."""

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
    options = "qlora:r=16,alpha=32,dropout=0.05,targets=q_proj+k_proj+v_proj+o_proj"  # one part, no spaces
    panel_title(ax, f"llama-7b · {options}", "seq 512")
    lines = ax.get_title().split("\n")
    assert all(len(line) <= TITLE_CHARS for line in lines) and "".join(lines[1:-1]) == options


def test_policy_names_slant_only_where_a_panel_is_crowded():
    ax = Figure().subplots()
    policy_ticks(ax, ["none", "full"])
    assert {t.get_rotation() for t in ax.get_xticklabels()} == {15}
    many = [f"every-k:k={k}" for k in range(CROWDED + 1)]
    policy_ticks(ax, many)
    labels = ax.get_xticklabels()
    assert [t.get_text() for t in labels] == many
    assert {t.get_rotation() for t in labels} == {35} and {t.get_horizontalalignment() for t in labels} == {"right"}


def test_a_config_label_names_the_precision_where_it_is_not_the_device_default():
    """Two configs of one sweep never read alike: the precision sweep's progress lines name fp32 and the amp ones
    on a GPU, where bf16 (the default there) goes unnamed, and bf16 on a CPU, where fp32 is the default."""
    from gcbench.results.schema import config_label

    base = {"model": "llama-7b", "seq_len": 2048, "batch_size": 1, "policy": "full", "device": "cuda"}
    labels = [config_label({**base, "precision": p}) for p in ("bf16", "fp32", "amp-bf16", "amp-fp16")]
    assert labels == ["llama-7b seq 2048 batch 1 full", "llama-7b seq 2048 batch 1 full · fp32",
                      "llama-7b seq 2048 batch 1 full · amp-bf16", "llama-7b seq 2048 batch 1 full · amp-fp16"]
    assert config_label({**base, "device": "cpu", "precision": "bf16"}).endswith("full · bf16")
    assert config_label({**base, "device": "cpu", "precision": "fp32", "loss": "chunked"}) == \
        "llama-7b seq 2048 batch 1 full · loss chunked"


def test_a_figure_of_too_many_panels_keeps_the_largest_configs_in_their_order():
    import pandas as pd

    from gcbench.report.figure_layout import largest_panels

    # sorted by setup name, as figures 1 and 5 hand them over: the largest ("a ...", 8,192 tokens) come first
    sizes = [8192, 2048, 8192, *[2048] * 10, 4096]
    groups = [(f"{chr(97 + i)} setup", pd.DataFrame({"tokens": [t] * (3 if i == 1 else 1)}))
              for i, t in enumerate(sizes)]
    kept, note = largest_panels(groups, 4)
    assert [k for k, _ in kept] == ["a setup", "b setup", "c setup", "n setup"]  # b: the most policies of the 2,048s
    assert note == " Showing the 4 largest of 14 configs."
