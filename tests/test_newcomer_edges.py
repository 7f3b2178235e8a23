"""Small things a newcomer or a hostile input hits first (issue 48, item 7): each case as the user met it."""

import io
import json
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gcbench import cli
from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.fields import DeviceKind
from gcbench.policies import parse_policy
from gcbench.report.estimate_table import estimate_table
from gcbench.report.run_table import before_run_notes

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def test_estimate_fit_ends_with_a_command_a_shell_runs_as_printed(monkeypatch):
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "64", "--layers", "1", "--fit",
                                 "--gpu", "rtx4090-24gb", "--policy", "none", "--optimizer", "adafactor",
                                 "--headroom", "5%", "--method", "analytic"])
    assert result.exit_code == 0, result.output
    line = result.stdout.splitlines()[-1]
    assert line.startswith("gcbench fit ") and "..." not in result.stdout, result.stdout
    # pasted into bash as printed (gcbench stands in as a function that prints the words it gets)
    shell = subprocess.run(["bash", "-c", 'gcbench() { printf "%s\\n" "$@"; }; ' + line], capture_output=True,
                           text=True, timeout=30, check=False)
    assert shell.returncode == 0, shell.stderr
    seen: dict = {}

    def fit_job(values, vary, range_, multiple_of, memory, headroom, *rest):
        seen.update(values, vary=vary, headroom=headroom)
        raise GcbenchError("stopped before any trial")

    monkeypatch.setattr("gcbench.cli.warm_children", lambda models: None)
    monkeypatch.setattr("gcbench.fits.command.fit_job", fit_job)
    fit = runner.invoke(app, shell.stdout.splitlines())
    assert fit.exit_code == 2 and "stopped before any trial" in fit.stderr, fit.output
    assert seen == {"model": ("tiny-llama",), "seq_len": (64,), "layers": (1,), "policy": ("none",),
                    "optimizer": ("adafactor",), "vary": "batch", "headroom": "5%"}


def _text(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _estimate_row(model: str, optimizer: str, method: str, **more) -> dict:
    """A row of `gcbench estimate` as a CUDA target with --gpu gives it: the allocator replayed (simulate), a time."""
    return {"model": model, "layers": None, "seq_len": 64, "batch_size": 1, "policy": "none", "policy_options": {},
            "method": method, "target": "cuda", "peak_bytes": 3 * 2**20, "param_bytes": 2**19, "grad_bytes": 2**19,
            "optimizer_bytes": 2**20 if optimizer == "adamw" else 2**15, "activation_bytes": 2**20,
            "peak_phase": "backward", "n_params": 2**18, "attention_kernel": "flash", "seconds": 0.1,
            "stands_in": None, "not_available": None, "precision": "bf16", "optimizer": optimizer,
            "runs_out": False if method == "simulate" else None,
            "reserved_bytes": 4 * 2**20 if method == "simulate" else None, "predicted_step_ms": 8.0,
            "predicted_tokens_per_s": 8000.0, "time_basis": "rtx4090-24gb: datasheet", "measured_configs": 0, **more}


@pytest.mark.parametrize("models, optimizers, timed, column", [
    (("tiny-llama",), ("adamw", "adafactor"), True, " method "),  # estimate --optimizer adamw,adafactor --gpu NAME
    (("llama-3.1-8b", "qwen2.5-7b"), ("adamw-loop", "adafactor"), False, " m "),  # so wide the method is a letter
])
def test_an_estimate_table_at_80_columns_tells_every_row_apart(models, optimizers, timed, column):
    """Two methods per config: at 80 columns the table dropped `method`, and the rows of one optimizer looked the
    same (issue 48). The method stays, as a letter where the table is that narrow."""
    wide = {"runs_out": None, "reserved_bytes": None, "predicted_step_ms": None, "predicted_tokens_per_s": None,
            "seq_len": 4096, "batch_size": 16, "policy": "every-k", "policy_options": {"k": 2}}
    rows = [_estimate_row(model, optimizer, method, **({} if timed else wide)) for model in models
            for optimizer in optimizers for method in ("analytic", "simulate")]
    text = _text(estimate_table(rows, 24 * 2**30, width=80))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, text
    header = next(i for i, line in enumerate(lines) if line.startswith(("seq", "model")))
    body = [line.rstrip() for line in lines[header + 2:header + 2 + len(rows)]]
    assert column in lines[header] + " " and len(set(body)) == len(rows), text
    if column == " m ":
        assert "m = the method: a(nalytic), s(imulate)" in " ".join(text.split())


def test_an_estimate_fits_caption_says_whose_memory_it_is():
    # --gpu NAME: what the card leaves usable; --gpu-memory: the number as given (it named "the card" with no card)
    rows = [_estimate_row("tiny-llama", "adamw", method) for method in ("analytic", "simulate")]
    named = " ".join(_text(estimate_table(rows, 24 * 2**30, width=None, card="rtx4090-24gb")).split())
    given = " ".join(_text(estimate_table(rows, 24 * 2**30, width=None)).split())
    assert "within 24.00 GiB, rtx4090-24gb less its context and those workspaces" in named
    assert "within 24.00 GiB, --gpu-memory as given" in given and "the card" not in given


def test_an_estimate_marks_its_host_bound_rows_and_times_no_row_it_could_not_predict():
    rows = [_estimate_row("tiny-llama", "adamw", "analytic", peak_bytes=None, not_available="no formula",
                          predicted_host_bound=True, measured_time_configs=3),
            _estimate_row("tiny-llama", "adamw", "simulate", predicted_host_bound=True),
            _estimate_row("tiny-llama", "adamw", "simulate", batch_size=2)]
    text = " ".join(_text(estimate_table(rows, width=None)).split())
    analytic, simulate, _ = (line for line in _text(estimate_table(rows, width=None)).splitlines()
                             if line.lstrip().startswith("64 "))
    assert "8*" in simulate.split() and "8" not in analytic.split() and "%" not in analytic
    assert analytic.split().count("n/a") >= 7  # its time and its time's band too
    assert "* = host-bound, the GPU waits on Python (1 of 2 rows)" in text  # the n/a row is not one of them


def test_compare_lists_the_specs_only_in_one_side_within_80_columns(tmp_path, monkeypatch):
    """Labels of 81-82 characters (model, levers, seq, batch, policy, the CPU and its threads) wrapped by the
    terminal restarted at the margin: broken after a ' · ' instead, the later lines indented (issue 48)."""
    records = (ROOT / "results/cpu/policies-beyond.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "old.jsonl").write_text("".join(records[:13]))
    (tmp_path / "new.jsonl").write_text("".join(records[6:]))
    monkeypatch.setattr(cli, "console", Console(width=80, record=True, file=io.StringIO()))
    result = runner.invoke(app, ["compare", str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl")])
    assert result.exit_code == 0, result.output
    text = cli.console.export_text()
    listed = text[text.index("only in OLD"):].splitlines()
    assert max(map(len, listed)) <= 80, text
    assert all(line.startswith(("only in", "  ")) for line in listed), text
    old_only = listed[1:listed.index(next(line for line in listed if line.startswith("only in NEW")))]
    assert "  tiny-llama · fp32 · adamw · seq 256 · batch 2 · every-k:k=2 · CPU x86_64 ·" in old_only
    assert sum(line.startswith("  tiny-llama") for line in old_only) == 6  # one spec, its own lines


def test_the_compile_warning_on_cpu_is_a_whole_sentence():
    """`run --compile blocks` on CPU warned "...; its step time and the bytes it saves for backward are" and
    stopped (issue 48)."""
    spec = SimpleNamespace(policy=parse_policy("full"), device_kind=DeviceKind.CPU, compile="blocks")
    _, unmeasured = before_run_notes(spec)
    assert unmeasured.endswith("its step time and the bytes it saves for backward are measured")
    budget = SimpleNamespace(policy=parse_policy("budget"), device_kind=DeviceKind.CPU)
    assert before_run_notes(budget)[1].endswith("are measured")


@pytest.mark.parametrize("args, message", [
    (["fit", "--memory", "-1", "--isolation", "none"], "--memory: cannot read '-1' as a size"),
    (["fit", "--memory", "1XB", "--levers", "policy"], "--memory: cannot read '1XB' as a size"),
    (["estimate", "--gpu-memory", "-1"], "--gpu-memory: cannot read '-1' as a size"),
    (["estimate", "--fit", "--gpu-memory", "0B"], "--gpu-memory: size '0B' must be at least 1 byte"),
    (["run", "--batch", "1", "--memory-cap", "0B"], "--memory-cap: size '0B' must be at least 1 byte"),
    (["run", "--batch", "1", "--memory-cap", "0"], "--memory-cap: size '0' must be at least 1 byte"),
    (["run", "--batch", "1", "--memory-cap", "12"], "--memory-cap: size '12' has no unit: write 12GiB, 12GB or 12B "
                                                    "(bytes)"),
])
def test_a_bad_size_names_its_option(tmp_path, args, message):
    """"cannot read '-1' as a size" did not say which option (issue 48)."""
    command, *rest = args
    result = runner.invoke(app, [command, "--model", "tiny-llama", "--seq", "16", "--device", "cpu", *rest,
                                 *(["--out", str(tmp_path / "r.jsonl")] if command != "estimate" else [])])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"gcbench: error: {message} (examples: 24GiB, 512MiB, 80GB)" \
        if "cannot read" in message else result.stderr.strip() == f"gcbench: error: {message}"
    assert not (tmp_path / "r.jsonl").exists()


def _readme_commands() -> list[tuple[str, str]]:
    """(command, its comment) of each `gcbench` line in the README's code blocks; a comment on its own line goes
    with the command after it."""
    found, above = [], ""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("# "):
            above = line
        elif line.startswith("gcbench "):
            command, _, comment = line.partition("  #")
            found.append((command.strip(), f"{above} {comment}"))
            above = ""
    return found


def test_no_readme_fit_example_needs_a_gpu_unless_it_says_so():
    """`fit --memory 24GiB` "what if I had a 24 GiB card" never ran on a CPU machine as written (issue 48)."""
    for command, comment in _readme_commands():
        if command.startswith("gcbench fit "):
            assert "--device cpu" in command or "GPU" in comment, command
    card = [command for command, comment in _readme_commands() if "24 GiB card" in comment]
    assert len(card) == 1 and card[0].startswith("gcbench estimate ") and " --fit " in card[0]


@pytest.mark.slow  # a 7B LoRA simulation per size tried: 30 s on 2 cores (CI's slow set runs it)
def test_the_readmes_24_gib_card_example_runs_on_a_cpu():
    command = next(command for command, comment in _readme_commands() if "24 GiB card" in comment)
    result = runner.invoke(app, [*shlex.split(command)[1:], "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert rows["none"]["value"] is None and rows["full"]["value"] == 7  # as the README says
