"""A newcomer's sharp edges (issue 30): sizes in units, singular counts, the option the user gave, docs that agree
with the code on schema versions, the CPU's model name, `load` of a folder, estimate tables that fit 80 columns,
`run --format json`, and a compiled policy's CPU run that says what it does not measure."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import gcbench
from gcbench import cli
from gcbench.cli import app
from gcbench.env import capture_env, cpu_model
from gcbench.errors import GcbenchError
from gcbench.fields import RUN_FIELDS, DeviceKind, run_field
from gcbench.fits.fit import Fit, FitSpec
from gcbench.measure import LiveTensorTracker
from gcbench.policies import parse_policy
from gcbench.report.cells import environment_grid
from gcbench.report.estimate_table import estimate_table
from gcbench.report.run_table import before_run_notes, run_table
from gcbench.report.tables import terminal_tables
from gcbench.results.frame import results_frame
from gcbench.results.schema import READABLE_VERSIONS, SCHEMA_VERSION, blocks_text, new_record
from gcbench.results.store import append_record, read_records
from gcbench.runner import run
from tests.helpers import tiny_spec

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()
TINY_RUN = ["run", "--model", "tiny-llama", "--seq", "32", "--batch", "2", "--device", "cpu", "--warmup", "1",
            "--steps", "2"]


@pytest.fixture(scope="module")
def record() -> dict:
    """One real CPU record of tiny-llama, shown by the tests below in several ways."""
    return run(tiny_spec("tiny-llama", "none", seq_len=32, warmup_steps=1, measure_steps=2))


def text_of(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


# ------------------------------------------------------------------------------------ sizes, counts, option names

def test_the_cpu_out_of_memory_message_gives_sizes_in_units():
    tracker = LiveTensorTracker(cap_bytes=2**20)
    with pytest.raises(torch.OutOfMemoryError) as caught, tracker:
        torch.empty(2**20 + 4096, dtype=torch.uint8)
    message = str(caught.value)
    assert message == "live tensors need 1.00 MiB, 4.00 KiB past the memory cap of 1.00 MiB"
    assert not re.search(r"\d{4,}", message)  # no raw byte counts


def test_counts_of_one_are_singular(record):
    one_block = {**record, "n_layers": 1, "layers": 1}
    assert "(1 block)" in text_of(run_table(one_block)).replace("\n", " ")
    assert run_field("layers").text({"layers": 1}) == "1 layer"
    assert run_field("layers").text({"layers": 2.0}) == "2 layers"  # a frame's float column
    assert run_field("nproc").text({"nproc": 1, "shard": "fsdp2"}) == "1 rank"
    rows = [{"model": "tiny-llama", "layers": 1, "seq_len": 32, "batch_size": 1, "policy": "none",
             "policy_options": {}, "method": "analytic", "target": "cpu", "peak_bytes": 2**20, "param_bytes": 1,
             "grad_bytes": 1, "optimizer_bytes": 1, "activation_bytes": 1, "peak_phase": "backward",
             "n_params": 1, "attention_kernel": "cpu-flash", "seconds": 0.01, "stands_in": None,
             "not_available": None, "precision": "fp32", "optimizer": "adamw"}]
    assert "tiny-llama (1 block)" in text_of(estimate_table(rows))
    frame = results_frame(_load([record]))
    assert " — 1 config;" in str(terminal_tables(frame)[0])


def test_a_model_of_two_stacks_is_named_stack_by_stack_and_a_vlm_by_its_images(record):
    two = {**record, "model": "tiny-llava", "family": "llava", "n_layers": 4, "layers": 2,
           "stacks": "vision:2,language:2", "images": 2}
    title = " ".join(text_of(run_table(two)).split())
    assert "tiny-llava (2 vision + 2 language blocks) · seq" in title and " · 2 images · " in title
    assert blocks_text({"stacks": "vision:2,[b]x[/b]"}) == "vision:2,[b]x[/b]"  # not name:count: shown as it is
    rows = [{"model": "tiny-t5", "layers": 2, "stacks": "encoder:2,decoder:2", "seq_len": 32, "batch_size": 1,
             "policy": "none", "policy_options": {}, "method": "simulate", "target": "cpu", "peak_bytes": 2**20,
             "param_bytes": 1, "grad_bytes": 1, "optimizer_bytes": 1, "activation_bytes": 1,
             "peak_phase": "backward", "n_params": 1, "attention_kernel": "cpu-flash", "seconds": 0.01,
             "stands_in": None, "not_available": None, "precision": "fp32", "optimizer": "adamw", "images": None}]
    assert "tiny-t5 (2 encoder + 2 decoder blocks)" in text_of(estimate_table(rows))
    vlm = [{**rows[0], "model": "tiny-llava", "stacks": "vision:2,language:2", "images": 3}]
    assert " · 3 images · " in " ".join(text_of(estimate_table(vlm)).split())


def test_fit_names_the_memory_option_the_user_gave(tmp_path):
    out = tmp_path / "f.jsonl"
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--device", "cpu", "--memory", "1MiB",
                                 "--out", str(out)])
    assert result.exit_code == 2
    assert "--memory allows 1.00 MiB" in result.stderr and "--memory-cap" not in result.stderr
    result = runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "64", "--device", "cpu", "--memory", "1MiB",
                                 "--headroom", "5%", "--out", str(out)])
    assert "--memory less --headroom 5% allows" in result.stderr and "--memory-cap" not in result.stderr


def test_a_fit_trial_not_run_for_the_budget_names_memory_not_memory_cap(tmp_path, monkeypatch):
    """A trial whose predicted peak is far past the budget is recorded without running (runner.check_fits): its
    reason names the budget as the user gave it."""
    def not_run(spec, on_phase):
        return new_record(spec.as_record(), "oom", f"not run: the predicted peak is 9.00 MiB but --memory-cap allows "
                          f"{spec.memory_cap_bytes / 2**20:.2f} MiB; try a smaller --seq or --batch",
                          oom_predicted=True, oom_limit="cap")

    monkeypatch.setattr("gcbench.fits.fit.launcher", lambda *a, **k: not_run)
    spec = FitSpec({"model": "tiny-llama", "seq_len": 64, "device": "cpu"}, ("none",), "batch_size", 1, 8,
                   memory=12 * 2**20, out=tmp_path / "fit.jsonl", isolation="none", paired=False)
    Fit(spec).run()
    trials = read_records(spec.out)
    assert trials and all("but --memory allows 12.00 MiB" in t["error"] and "--memory-cap" not in t["error"]
                          for t in trials)


# ---------------------------------------------------------------------------------------------- schema versions

VERSIONS = re.compile(r"\bversions? (\d+)(?: (?:to|and) (\d+))?")


def _schema_sentences() -> list[tuple[str, str]]:
    """Every sentence of the README, the docs and the package's docstrings and comments that names a schema
    version by number."""
    texts = [(p, p.read_text()) for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]]
    texts += [(p, p.read_text()) for p in sorted((REPO / "gcbench").rglob("*.py"))]
    found = []
    for path, text in texts:
        for sentence in re.split(r"(?<=\.)\s+(?=[A-Z`*])|\n\s*\n", text):
            flat = " ".join(sentence.split())
            if re.search(r"schema[ _]version", flat, re.I) and VERSIONS.search(flat):
                found.append((path.relative_to(REPO).as_posix(), flat))
    return found


def test_every_mention_of_schema_versions_agrees_with_the_code():
    found = _schema_sentences()
    assert {path for path, _ in found} >= {"docs/reporting.md", "docs/sweep.md"}
    wrote = f"writes schema version {SCHEMA_VERSION} and reads versions {min(READABLE_VERSIONS)} to " \
        f"{max(READABLE_VERSIONS)}"
    assert READABLE_VERSIONS == tuple(range(min(READABLE_VERSIONS), max(READABLE_VERSIONS) + 1))
    for path, sentence in found:
        # one way of saying what this gcbench writes and reads, so that it is checked, and every other version
        # named (its history: "version 2 added ...") one it reads
        assert wrote in sentence or not re.search(r"\b(reads?|writes?|read)\b", sentence), (path, sentence)
        for low, high in VERSIONS.findall(sentence):
            assert {int(low), int(high or low)} <= set(READABLE_VERSIONS), (path, sentence)


# --------------------------------------------------------------------------------------------- the CPU's name

def test_the_cpu_model_name_comes_from_cpuinfo(tmp_path, monkeypatch):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 106\n"
                   "model name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\ncpu MHz\t\t: 2000.000\n\n"
                   "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz\n")
    assert cpu_model(x86) == "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"
    pi = tmp_path / "pi"
    pi.write_text("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd08\n\nHardware\t: BCM2835\n"
                  "Model\t\t: Raspberry Pi 4 Model B Rev 1.4\n")
    assert cpu_model(pi) == "Raspberry Pi 4 Model B Rev 1.4"
    graviton = tmp_path / "graviton"  # part numbers only: no name to give
    graviton.write_text("processor\t: 0\nBogoMIPS\t: 243.75\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    monkeypatch.setattr("platform.processor", lambda: "aarch64")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    monkeypatch.setattr("platform.system", lambda: "Linux")
    assert cpu_model(graviton) is None
    monkeypatch.setattr("platform.system", lambda: "Darwin")  # no /proc: sysctl names it
    monkeypatch.setattr("gcbench.env._run", lambda *cmd: "Apple M2" if cmd[-1] == "machdep.cpu.brand_string" else None)
    assert cpu_model(tmp_path / "absent") == "Apple M2"


def test_the_record_and_the_host_lines_name_the_cpu_model(record, monkeypatch):
    monkeypatch.setattr("gcbench.env.cpu_model", lambda: "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz")
    env = capture_env("cpu", 1)
    assert env["cpu_model"] == "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz" and env["cpu"]
    named = {**record, "env": env}
    assert "CPU Intel Xeon Gold 6338 CPU @ 2.00GHz (1 thread)" in " ".join(text_of(run_table(named)).split())
    frame = results_frame(_load([named]))
    assert "[/] (Intel Xeon Gold 6338 CPU @ 2.00GHz) — 1 config;" in str(terminal_tables(frame)[0])
    assert ["CPU model", "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"] in environment_grid(frame).rows
    # a record from before the name was kept still reads, and says only "CPU"
    older = {**record, "env": {k: v for k, v in env.items() if k != "cpu_model"}}
    assert "fp32 CPU (1 thread)" in " ".join(text_of(run_table(older)).split())  # the device its own title line
    assert "Xeon" not in str(terminal_tables(results_frame(_load([older])))[0])


def _load(records: list[dict]):
    """The frame of `records`, as `gcbench.load` makes it from a file."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.jsonl"
        for r in records:
            append_record(path, r)
        return gcbench.load(path)


# ------------------------------------------------------------------------------------------- load of a folder

def test_loading_a_folder_reads_its_own_files_and_not_its_subfolders(tmp_path, record):
    append_record(tmp_path / "runs.jsonl", record)
    append_record(tmp_path / "cpu" / "examples.jsonl", {**record, "seq_len": 999})
    with pytest.warns(UserWarning, match="subfolders are not read unless named.*cpu"):
        df = gcbench.load(tmp_path)
    assert list(df["seq_len"]) == [32]
    assert list(gcbench.load(tmp_path / "cpu")["seq_len"]) == [999]  # named, it is read
    with pytest.raises(GcbenchError, match=r"no \*\.jsonl results .*subfolders are not read unless named.*only-sub/a"):
        gcbench.load(_only_sub(tmp_path))
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "subfolders are not read unless named" in result.stderr and "999" not in result.stdout


def _only_sub(tmp_path: Path) -> Path:
    folder = tmp_path / "only-sub"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "x.jsonl").write_text((tmp_path / "runs.jsonl").read_text())
    return folder


def test_the_projects_own_records_are_in_subfolders_of_results():
    """What the commands write by default is results/*.jsonl (gitignored); what this project commits under
    results/ sits in subfolders, so that `gcbench.load("results/")` never mixes it in."""
    try:
        committed = subprocess.run(["git", "-C", str(REPO), "ls-files", "results"], capture_output=True, text=True,
                                   check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert committed and all("/" in name.removeprefix("results/") for name in committed), committed


# ----------------------------------------------------------------------------------- estimate tables, 80 columns

def readme_estimates() -> list[list[str]]:
    """The README's `gcbench estimate` commands (without --fit), as arguments, a Hub id swapped for its preset (no
    network in tests) and one method: analytic, instant, whose rows are as wide as the simulation's."""
    commands = []
    for line in (REPO / "README.md").read_text().splitlines():
        line = line.strip().strip("`")
        if not line.startswith("gcbench estimate ") or "--fit" in line:
            continue
        words = shlex.split(line.split(" #")[0])[2:]
        if "--method" in words:
            del words[words.index("--method"):words.index("--method") + 2]
        commands.append([("qwen2.5-7b" if w == "Qwen/Qwen2.5-7B" else w) for w in words] + ["--method", "analytic"])
    return commands


def test_the_readme_has_several_estimate_examples():
    assert len(readme_estimates()) >= 5


@pytest.mark.parametrize("args", readme_estimates(), ids=lambda a: " ".join(a[:6]))
def test_every_readme_estimate_table_fits_80_columns_piped_and_in_a_terminal(args, monkeypatch):
    piped = runner.invoke(app, ["estimate", *args])  # CliRunner's stdout is no terminal: a pipe
    assert piped.exit_code == 0, piped.output
    lines = piped.stdout.splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    terminal = Console(width=80, force_terminal=True, record=True, file=open("/dev/null", "w"))
    monkeypatch.setattr(cli, "console", terminal)
    assert runner.invoke(app, ["estimate", *args]).exit_code == 0
    shown = terminal.export_text()
    assert max(map(len, shown.splitlines())) <= 80
    # nothing squeezed: every number of the piped table is whole in the terminal's (times of prediction aside)
    numbers = lambda text: re.findall(r"\d+\.\d\d", text.partition("time per prediction")[0])  # noqa: E731
    assert numbers(shown) == numbers(piped.stdout) and numbers(shown)


def test_a_table_too_wide_for_the_terminal_leaves_out_its_spare_columns_and_says_so():
    rows = [{"model": model, "layers": None, "seq_len": 4096, "batch_size": 16, "policy": "every-k",
             "policy_options": {"k": 2}, "method": method, "target": "cuda", "peak_bytes": 70 * 2**30,
             "param_bytes": 14 * 2**30, "grad_bytes": 14 * 2**30, "optimizer_bytes": 28 * 2**30,
             "activation_bytes": 14 * 2**30, "peak_phase": "backward", "n_params": 7 * 10**9,
             "attention_kernel": "flash", "seconds": 10.0, "stands_in": None, "not_available": None,
             "precision": "bf16", "optimizer": optimizer}
            for model in ("llama-3.1-8b", "qwen2.5-7b") for method in ("analytic", "simulate")
            for optimizer in ("adamw-loop", "adafactor")]
    shown = text_of(estimate_table(rows, 80 * 2**30, width=80))
    assert max(map(len, shown.splitlines())) <= 80
    assert "left out at this width: B/p" in shown and "--format json has every value" in shown
    assert " B/p " in text_of(estimate_table(rows, 80 * 2**30, width=None))


# ----------------------------------------------------------------------------------------------- run --format json

def test_run_format_json_prints_the_record_alone_on_stdout(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*TINY_RUN, "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)  # one JSON object and nothing else
    assert printed == json.loads(json.dumps(read_records(out)[0]))
    assert "record appended to" in result.stderr
    assert "format" not in printed and all(f.flag != "format" for f in RUN_FIELDS)  # display, not a run field


def test_run_format_must_be_table_or_json_before_anything_runs(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*TINY_RUN, "--format", "yaml", "--out", str(out)])
    assert result.exit_code == 2 and result.stdout == "" and not out.exists()
    assert result.stderr.strip() == "gcbench: error: unknown --format 'yaml' (table, json)"


# ----------------------------------------------------------------------------------------- budget on CPU says why

def test_a_compiling_policy_on_cpu_says_before_it_starts_what_it_will_not_measure():
    cpu = SimpleNamespace(policy=parse_policy("budget"), device_kind=DeviceKind.CPU)
    compile_note, unmeasured = before_run_notes(cpu)
    assert "torch.compile" in compile_note and "minutes on CPU" in compile_note
    assert "peak memory and FLOPs are not measured" in unmeasured and "uncompiled" in unmeasured
    cuda = SimpleNamespace(policy=parse_policy("budget"), device_kind=DeviceKind.CUDA)
    assert len(before_run_notes(cuda)) == 1  # on CUDA the peak is measured
    assert before_run_notes(SimpleNamespace(policy=parse_policy("full"), device_kind=DeviceKind.CPU)) == []


def test_the_run_table_says_why_a_compiled_cpu_run_has_no_peak_or_flops(record, tmp_path, monkeypatch):
    compiled = {**record, "policy": "budget", "policy_options": {"b": 0.5}, "compile_ms": 120_000.0,
                "peak_tracked_bytes": None, "fwd_bwd_peak_bytes": None, "activation_peak_bytes": None,
                "flops": None, "recompute_flops_ratio": None}
    shown = " ".join(text_of(run_table(compiled)).split())
    assert "not measured" in shown and "not counted" in shown and "uncompiled" in shown
    # and `gcbench run` says so before it starts (the measuring itself faked: compiling takes minutes)
    monkeypatch.setattr("gcbench.launch.run", lambda spec, progress, refuse_unfit: compiled)
    result = runner.invoke(app, [*TINY_RUN, "--policy", "budget", "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 0, result.output
    assert "minutes on CPU" in result.stderr and "not measured" in result.stdout


def test_checkpointing_is_said_to_lower_the_peak_only_where_saved_activations_hold_most_of_it(record):
    # a 1.7B model at seq 128: 29 MiB saved of 1.13 GiB above model state (its tied embedding's gradients), the
    # same peak under none and full, and the table said "activations hold the peak: checkpointing can lower it"
    temporaries = {**record, "peak_phase": "backward", "saved_activation_bytes": 29 * 2**20,
                   "activation_peak_bytes": 1157 * 2**20}
    said = " ".join(text_of(run_table(temporaries)).split())
    assert "saved activations are 29.00 MiB of the 1.13 GiB above model state: checkpointing can lower that part " \
           "only" in said and "activations hold the peak" not in said
    saved = {**temporaries, "saved_activation_bytes": 600 * 2**20}
    assert "activations hold the peak: checkpointing can lower it" in " ".join(text_of(run_table(saved)).split())
    stepped = {**temporaries, "peak_phase": "optimizer"}
    assert "the optimizer step holds it: checkpointing cannot lower it" in " ".join(
        text_of(run_table(stepped)).split())
