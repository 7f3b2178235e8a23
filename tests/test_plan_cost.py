"""benchmarks/plan_cost.py: a record whose wall time a later harness change moved is left out of its figures."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parent.parent


def _sha(rev: str) -> str:
    try:
        done = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        pytest.skip("no git here (plan_cost reads the records' commits through git)")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout with {rev} (plan_cost reads the records' commits through git)")
    return done.stdout.strip()


def test_a_qlora_record_made_before_its_base_moved_to_the_card_is_left_out():
    plan_cost = load_script(ROOT / "benchmarks" / "plan_cost.py")
    commit = plan_cost.MOVED_STARTS[0][0]
    before, after = _sha(f"{commit}~1"), _sha(commit)
    qlora = {"adapter": "qlora", "env": {"git_sha": before + "-dirty"}}
    assert plan_cost.moved_start(qlora).startswith(f"measured before {commit[:7]}: a QLoRA base was then built")
    assert plan_cost.moved_start({**qlora, "env": {"git_sha": after}}) is None  # made with the change
    assert plan_cost.moved_start({**qlora, "adapter": "lora"}) is None  # not what the change moved
    undecided: list[str] = []
    assert plan_cost.moved_start({**qlora, "env": {"git_sha": "0" * 40}}, undecided) is None  # git cannot say: kept
    assert undecided == ["git does not know 000000000000 or 8929740"]  # and the output says so
    assert plan_cost.moved_start({"adapter": "qlora", "env": {}}) is None


def test_without_git_a_record_is_kept_and_the_reason_told(monkeypatch):
    plan_cost = load_script(ROOT / "benchmarks" / "plan_cost.py")

    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "git")

    monkeypatch.setattr(plan_cost.subprocess, "run", no_git)
    undecided: list[str] = []
    assert plan_cost.moved_start({"adapter": "qlora", "env": {"git_sha": "926345a"}}, undecided) is None
    assert undecided == ["git did not run (No such file or directory)"]
