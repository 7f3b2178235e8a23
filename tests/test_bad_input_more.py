"""Bad input of issue 30 (a wider pass): names that read as rich markup or carry escape sequences, files nested or
numbered past what a parser or a record holds, a terminal that is not UTF-8, Slurm asked for where there is none,
numbers that are no numbers, more ranks than cores, and asking `estimate --fit` for a method. Each refused before
any work with one line on stderr and exit code 2 (tests/test_bad_input.py: `refused`), or shown as it is."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gcbench.cli import app
from gcbench.resolved import resolve
from gcbench.results.schema import new_record
from gcbench.results.store import read_records
from gcbench.spec import RunSpec
from tests.test_bad_input import FAST, LLAMA, RUN, refused, runner


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if a run starts measuring: what is refused must be refused before any work."""
    import gcbench.runner

    def measure(*args, **kwargs):
        raise AssertionError("measured although the input was refused")

    monkeypatch.setattr(gcbench.runner, "_measure", measure)


# ------------------------------------------------------------------------ crashes instead of one line


def _model_dir(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 64}))
    return folder


def test_a_model_path_that_reads_as_rich_markup_is_shown_as_it_is(tmp_path, monkeypatch):
    """`m[1][/1]` closes a tag never opened: rich raised MarkupError after the run had written its record, and a
    sweep could never finish. Shown literally in every table, title, caption and progress line."""
    monkeypatch.chdir(tmp_path)  # a short relative path: table titles wrap between words, not inside one
    _model_dir(tmp_path, "m[1][/1]")
    model = "m[1][/1]/config.json"
    run = runner.invoke(app, [*RUN, "--model", model, "--out", "r.jsonl"])
    assert run.exit_code == 0 and model in run.stdout, run.output
    assert read_records(tmp_path / "r.jsonl")[0]["model"] == model
    sweep = runner.invoke(app, ["sweep", "--model", model, "--seq", "16", "--batch", "1,2", "--policy", "none",
                                *FAST, "--isolation", "none", "--out", "s.jsonl"])
    assert sweep.exit_code == 0 and model in sweep.stdout and model in sweep.stderr, sweep.output
    assert len(read_records(tmp_path / "s.jsonl")) == 2
    estimate = runner.invoke(app, ["estimate", "--model", "m[1][/1]", "--seq", "16", "--method", "analytic"])
    assert estimate.exit_code == 0 and "m[1][/1]" in estimate.stdout, estimate.output
    fit = runner.invoke(app, ["estimate", "--model", "m[1][/1]", "--seq", "16", "--fit", "--gpu", "l4-24gb",
                              "--policy", "none", "--method", "analytic"])
    assert fit.exit_code == 0 and "gcbench fit --model 'm[1][/1]'" in fit.stdout, fit.output


def test_an_escape_sequence_in_a_path_never_reaches_the_terminal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model_dir(tmp_path, "e\x1b[31mx")
    estimate = runner.invoke(app, ["estimate", "--model", "e\x1b[31mx", "--seq", "16", "--method", "analytic"])
    assert estimate.exit_code == 0 and "ex" in estimate.stdout, estimate.output
    run = runner.invoke(app, [*RUN, "--model", "e\x1b[31mx", "--out", "o\x1b]0;title\x07.jsonl"])
    assert run.exit_code == 0 and "record appended to o.jsonl" in run.stdout, run.output
    missing = runner.invoke(app, [*RUN, "--model", "e\x1b[31mx/nothing.json"])
    refused(missing, "cannot read model config", "nothing.json")
    for result in (estimate, run, missing):
        assert "\x1b" not in result.output and "\x07" not in result.output


def test_a_toml_nested_past_the_parsers_depth_is_one_line(tmp_path):
    for text in ("seq = " + "[" * 100_000 + "]" * 100_000, "a = " + "{x=" * 3000 + "1" + "}" * 3000):
        config = tmp_path / "deep.toml"
        config.write_text(text)
        refused(runner.invoke(app, ["sweep", "--config", str(config), "--dry-run"]), "deep.toml",
                "nested too deeply")
    # a value nested less deep is quoted in a line of readable length
    config.write_text('model = "tiny-llama"\nbatch = 1\nseq = ' + "[" * 300 + "1" + "]" * 300)
    assert len(refused(runner.invoke(app, ["sweep", "--config", str(config), "--dry-run"]), "not an integer")) < 200


@pytest.mark.parametrize("field,value", [("step_ms_median", 10**400), ("peak_tracked_bytes", 10**30),
                                         ("seq_len", 2**64), ("step_ms", [1.0, -10**20])])
def test_an_integer_no_record_holds_is_a_refused_line_naming_where(tmp_path, no_measuring, field, value):
    good = new_record(resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=1, device="cpu")).as_record())
    results = tmp_path / "r.jsonl"
    content = json.dumps(good) + "\n" + json.dumps({**good, field: value, "batch_size": 2}) + "\n"
    results.write_text(content)
    for args in (["report", str(results)], ["compare", str(results), str(results)],
                 [*RUN, "--out", str(results)]):
        refused(runner.invoke(app, args), "r.jsonl:2: corrupt results line", "digits", "64 bits")
    assert results.read_text() == content


@pytest.mark.slow  # whole gcbench processes under two locales (~12 s); CI runs it
def test_output_that_cannot_take_a_character_degrades_instead_of_failing(tmp_path):
    from gcbench.__main__ import ERRORS, _degrade_output

    _degrade_output()  # registers the stand-ins (in a test, stdout is pytest's)
    assert "seq ≤ 2 · 3×4 — ok…\udcff".encode("ascii", ERRORS) == b"seq <= 2 - 3x4 - ok...\\xff"
    for env in ({"PYTHONIOENCODING": "ascii"}, {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0"}):
        done = subprocess.run([sys.executable, "-m", "gcbench", "estimate", "--model", "tiny-llama", "--seq", "16",
                               "--method", "analytic", "--policy", "bogus"], capture_output=True,
                              env={**os.environ, **env}, timeout=300)
        assert done.returncode == 2 and done.stderr.decode("ascii").startswith("gcbench: error: "), done.stderr
        done = subprocess.run([sys.executable, "-m", "gcbench", "estimate", "--model", "tiny-llama", "--seq", "16",
                               "--method", "analytic", "--gpu-memory", "1MiB"], capture_output=True,
                              env={**os.environ, **env}, timeout=300)
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
        out = " ".join(done.stdout.decode("ascii").split())  # ASCII only, with stand-ins; the caption's wrap aside
        assert "tiny-llama - predicted peak" in out and "fits = peak <= 1.00 MiB" in out


def test_a_slurm_sweep_without_slurm_is_one_line_before_anything(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no srun, whatever this machine has
    out = tmp_path / "new" / "r.jsonl"
    refused(runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST,
                                "--executor", "slurm", "--out", str(out)]), "--executor slurm", "no Slurm here",
            "--executor local")
    assert not (tmp_path / "new").exists()
    # the plan is still shown without Slurm (a dry run submits nothing)
    dry = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST,
                              "--executor", "slurm", "--out", str(out), "--dry-run"])
    assert dry.exit_code == 0, dry.output


# ------------------------------------------------------------------------------ accepted nonsense


@pytest.mark.parametrize("timeout", ["nan", "0", "-5", "-inf"])
def test_fit_refuses_a_timeout_that_is_no_number_of_seconds(tmp_path, no_measuring, timeout):
    out = tmp_path / "new" / "fit.jsonl"
    refused(runner.invoke(app, ["fit", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", "--memory",
                                "1GiB", "--range", "1..2", "--policy", "none", "--timeout", timeout, "--out",
                                str(out)]), "--timeout", str(float(timeout)))
    assert not (tmp_path / "new").exists()


def test_more_cpu_ranks_than_cores_are_refused_with_the_number_available(tmp_path, monkeypatch, no_measuring):
    import gcbench.resolved

    monkeypatch.setattr(gcbench.resolved, "cores_available", lambda: 2)
    out = tmp_path / "new" / "r.jsonl"
    sharded = ["--shard", "fsdp2", "--precision", "fp32"]
    refused(runner.invoke(app, [*RUN, *sharded, "--nproc", "4096", "--out", str(out)]), "--nproc 4096",
            "2 cores are available")
    refused(runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST, *sharded,
                                "--nproc", "3", "--out", str(out)]), "--nproc 3", "2 cores")
    assert not (tmp_path / "new").exists()
    # a prediction starts no rank: any number of them can be estimated
    result = runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", *sharded, "--nproc", "64",
                                 "--method", "analytic", "--device", "cpu"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("make_out", [
    lambda t: (t / "null.jsonl").symlink_to("/dev/null") or t / "null.jsonl",
    lambda t: (t / "dir.jsonl").mkdir() or t / "dir.jsonl",
    lambda t: (t / "to-dir.jsonl").symlink_to(t) or t / "to-dir.jsonl",
    lambda t: os.mkfifo(t / "fifo.jsonl") or t / "fifo.jsonl",
])
@pytest.mark.parametrize("command", [
    RUN, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST],
    ["fit", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", "--memory", "1GiB", "--range", "1..2"],
])
def test_an_out_that_is_not_a_regular_file_is_refused(tmp_path, no_measuring, make_out, command):
    out = make_out(tmp_path)
    refused(runner.invoke(app, [*command, "--out", str(out)]), "regular file")


def test_a_refused_command_leaves_no_folder_behind(tmp_path, no_measuring):
    out = tmp_path / "a" / "b" / "r.jsonl"
    refused(runner.invoke(app, [*RUN, "--seq", "2048", "--batch", "100000", "--out", str(out)]), "predicted peak")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a").mkdir()  # a folder that was there stays
    refused(runner.invoke(app, [*RUN, "--seq", "2048", "--batch", "100000", "--out", str(out)]), "predicted peak")
    assert [p.name for p in tmp_path.rglob("*")] == ["a"]


# --------------------------------------------------------------------------------- silent misses


@pytest.mark.slow  # simulations of a fit (~7 s); CI runs it
def test_estimate_fit_predicts_by_the_method_asked_for(tmp_path):
    # a budget that not even batch 1 fits: the method is chosen per policy before the search, and a search of one
    # size shows it (at 64 MiB each policy's search simulated 12-14 sizes: 46 s)
    args = ["estimate", "--model", "tiny-llama", "--seq", "16", "--fit", "--gpu-memory", "1MiB", "--format",
            "json"]

    def methods(*more):
        result = runner.invoke(app, [*args, *more])
        assert result.exit_code == 0, result.output
        return {row["policy"]: row["method"] for row in map(json.loads, result.stdout.splitlines())}

    assert methods("--policy", "none,full", "--method", "simulate") == {"none": "simulate", "full": "simulate"}
    # both (the default): analytic where it knows the policy
    assert methods("--policy", "none,sac") == {"none": "analytic", "sac:mm=all": "simulate"}
    refused(runner.invoke(app, [*args, "--policy", "sac", "--method", "analytic"]), "analytic model does not know",
            "--method simulate")
    refused(runner.invoke(app, [*args, "--method", "guess"]), "--method 'guess'")
