"""The cards gcbench knows by name: a budget is the card's memory less what a process holds beside the step's
tensors, measured where gcbench has run on the card and assumed (and said so) elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcbench.errors import GcbenchError
from gcbench.gpus import CUDA_CONTEXT_BYTES, for_device, gpu

H200 = Path(__file__).resolve().parent.parent / "results" / "gpu" / "nvidia-h200"
H200_CONTEXT, H200_FIT = H200 / "cuda-context.txt", H200 / "fit.jsonl"


def test_the_h200_budget_is_what_a_process_found_on_one():
    """CUDA's total as cuda_context.py read it; outside the allocator what the fit's probe found there once a
    matmul had run forward and backward: the budget is the fit's own, less the workspaces a step allocates."""
    reading = json.loads(H200_CONTEXT.read_text().splitlines()[-2])  # the JSON line before "exit 0"
    fit_budget = {json.loads(line)["fit_budget_bytes"] for line in H200_FIT.read_text().splitlines()}
    card = gpu("h200-141gb")
    assert card.cuda_bytes == reading["total_bytes"] < card.memory_bytes  # the driver keeps some from CUDA
    assert {card.cuda_bytes - card.context} == fit_budget
    assert card.context > reading["after_matmul_bytes"] > CUDA_CONTEXT_BYTES  # the backward's thread adds more
    assert card.workspace_bytes == reading["forward_workspace_bytes"] + reading["backward_workspace_bytes"]
    assert card.usable_bytes == fit_budget.pop() - card.workspace_bytes
    assert "(CUDA's total, measured)" in card.budget_words() and "(measured)" in card.budget_words()


def test_a_card_not_measured_takes_nvidia_smi_total_and_the_assumed_context_and_says_so():
    card = gpu("h100-80gb")
    assert card.cuda_bytes is None and card.context == CUDA_CONTEXT_BYTES
    assert card.usable_bytes == card.memory_bytes - CUDA_CONTEXT_BYTES - card.workspace_bytes
    words = card.budget_words()
    assert words.startswith("h100-80gb: 81,559 MiB (nvidia-smi's total) less 512.00 MiB of CUDA context (assumed)")


def test_a_device_at_hand_is_matched_by_the_total_torch_reports():
    reading = json.loads(H200_CONTEXT.read_text().splitlines()[-2])
    assert for_device("NVIDIA H200", reading["total_bytes"]) is gpu("h200-141gb")
    assert for_device("NVIDIA H200", reading["total_bytes"] // 2) is None  # a slice of one is not the card
    assert for_device("NVIDIA A100 80GB PCIe", 81_920 * 2**20) is None  # "A100" matches the 40 GB entry


def test_a_card_is_named_by_its_leading_words_where_they_name_it_alone():
    # as results/gpu/ (nvidia-h200), nvidia-smi ("NVIDIA H200") and people ("h200", "H200") name it
    for name in ("h200-141gb", "h200", "H200", "nvidia-h200", "NVIDIA H200", " h200_141GB "):
        assert gpu(name).name == "h200-141gb", name
    assert gpu("h100-pcie").name == "h100-pcie-80gb" and gpu("h100-80gb").name == "h100-80gb"
    assert gpu("l4").name == "l4-24gb"  # a word, not a prefix of one: l40s-48gb is not named by l4
    # as nvidia-smi and torch.cuda.get_device_name() name them: a card's name and more words
    assert gpu("NVIDIA H100 80GB HBM3").name == "h100-80gb" and gpu("NVIDIA H100 PCIe").name == "h100-pcie-80gb"
    assert gpu("NVIDIA GeForce RTX 4090").name == gpu("rtx 4090").name == "rtx4090-24gb"
    assert gpu("NVIDIA A100-SXM4-80GB").name == "a100-80gb" and gpu("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    for other_board in ("NVIDIA A100 80GB PCIe", "h100-80gb-pcie", "NVIDIA H100 NVL"):  # not the SXM entries' rates
        with pytest.raises(GcbenchError, match="unknown --gpu"):
            gpu(other_board)
    for name, cards in (("h100", "h100-pcie-80gb, h100-80gb"), ("a100", "a100-80gb, a100-40gb")):
        with pytest.raises(GcbenchError, match=f"names 2 cards: {cards}; give one"):
            gpu(name)
    for name in ("h20", "nvidia", "", "-", "h200-80gb", "v100"):  # v100: matched by a device's name only
        with pytest.raises(GcbenchError, match="unknown --gpu"):
            gpu(name)


def test_the_commands_show_a_short_card_name_as_the_cards_own():
    from typer.testing import CliRunner

    from gcbench.cli import app

    shown = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--method", "analytic",
                                     "--policy", "none", "--fit", "--gpu", "H200", "--format", "json"])
    assert shown.exit_code == 0, shown.output
    assert {json.loads(line)["gpu"] for line in shown.stdout.splitlines()} == {"h200-141gb"}
    table = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--method", "analytic",
                                     "--gpu", "H200"])
    assert table.exit_code == 0, table.output
    assert "h200-141gb" in table.stdout and "H200" not in table.stdout.replace("NVIDIA H200", "")
    plan = CliRunner().invoke(app, ["validate", "--dry-run", "--gpu", "h100"])
    assert plan.exit_code == 2 and "the plan is made for h100-80gb, h200-141gb" in plan.stderr
