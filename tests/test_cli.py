"""The CLI through typer's CliRunner: what the user sees and what lands in the results file."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.results.schema import SCHEMA_VERSION
from gcbench.results.store import read_records
from tests.helpers import assert_refused

runner = CliRunner()
TINY_RUN = ["run", "--model", "tiny-llama", "--seq", "32", "--batch", "2", "--device", "cpu", "--warmup", "1",
            "--steps", "2"]
REQUIRED = ["schema_version", "model", "n_layers", "n_params", "seq_len", "batch_size", "policy", "policy_options",
            "precision", "optimizer", "device", "status", "step_ms", "step_ms_median", "tokens_per_s",
            "peak_tracked_bytes", "activation_peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes",
            "saved_activation_bytes", "flops", "env"]


@pytest.mark.parametrize("policy", ["none", "full", "every-k:k=2", "segments:k=2", "sqrtn"])
def test_run_writes_one_valid_record(tmp_path, policy):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*TINY_RUN, "--policy", policy, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "step time" in result.stdout and "tokens/s" in result.stdout
    [record] = read_records(out)
    assert set(REQUIRED) <= set(record)
    assert record["schema_version"] == SCHEMA_VERSION and record["status"] == "ok"
    assert record["policy"] == policy.partition(":")[0] and record["model"] == "tiny-llama"
    assert len(record["step_ms"]) == 2 and record["step_ms_median"] > 0
    assert record["peak_tracked_bytes"] > record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"]
    assert record["env"]["torch"] == torch.__version__
    assert "peak_allocated_bytes" not in record  # a CPU run never claims CUDA allocator numbers


def test_a_run_predicts_by_the_simulation_only_when_asked_and_a_resume_does_not_run_again_for_it(tmp_path):
    """The analytic prediction costs nothing and every record has it; the simulation (about a second for a tiny
    model, seconds for 7B) comes with --predict, exact on CPU. A sweep resumed with --predict runs nothing again:
    the numbers it would measure are the same."""
    out = tmp_path / "r.jsonl"
    assert runner.invoke(app, [*TINY_RUN, "--out", str(out)]).exit_code == 0
    result = runner.invoke(app, [*TINY_RUN, "--predict", "on", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plain, asked = read_records(out)
    assert plain["predict"] is False and plain["prediction_method"] == "analytic"
    assert plain["predicted_peak_bytes_simulate"] is None and plain["predicted_peak_bytes_analytic"] > 0
    assert asked["predict"] is True and asked["prediction_method"] == "simulate"
    assert asked["predicted_peak_bytes"] == asked["peak_tracked_bytes"]
    assert asked["predicted_peak_bytes_analytic"] == plain["predicted_peak_bytes_analytic"]
    sweep = ["sweep", *TINY_RUN[1:], "--policy", "none", "--isolation", "none", "--no-paired", "--out", str(out)]
    assert runner.invoke(app, [*sweep, "--predict", "on"]).exit_code == 0
    assert len(read_records(out)) == 2  # the run's record resumed the sweep's one config


def test_run_appends_and_keeps_earlier_records(tmp_path):
    out = tmp_path / "r.jsonl"
    for policy in ("none", "full"):
        assert runner.invoke(app, [*TINY_RUN, "--policy", policy, "--out", str(out)]).exit_code == 0
    assert [r["policy"] for r in read_records(out)] == ["none", "full"]


def test_memory_cap_makes_an_oom_record(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*TINY_RUN, "--memory-cap", "5MiB", "--out", str(out)])
    assert result.exit_code == 1
    [record] = read_records(out)
    assert record["status"] == "oom" and "memory cap" in record["error"]


def test_every_commands_help_reads_whole_at_80_columns():
    # rich cuts a word that does not fit its column with an ellipsis: an option's name (--slurm-array-parallelism)
    # or a long token in its help (torch.cuda.max_memory_allocated;)
    import typer.main

    for name in [*typer.main.get_command(app).commands, None]:
        result = runner.invoke(app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, name
        assert "\u2026" not in result.output, (name, [line for line in result.output.splitlines() if "\u2026" in line])
        assert max(map(len, result.output.splitlines())) <= 80, name


def test_the_command_list_gives_each_summary_as_one_paragraph():
    # typer kept a docstring's line breaks in `gcbench --help`: "--out adds figures" / "and a report to share."
    import re

    out = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert re.search(r"report +Tables of many runs .*--out adds figures and a report to share\.", out)
    assert re.search(r"fit +The largest batch .* bisected; then the fastest recommended", out)


def test_models_and_policies_list_the_registries(monkeypatch):
    from rich.console import Console

    from gcbench import cli
    from gcbench.models import MODELS
    from gcbench.policies import POLICIES

    monkeypatch.setattr(cli, "console", Console(width=250))

    models = runner.invoke(app, ["models"])
    assert models.exit_code == 0
    for name in MODELS:
        assert name in models.stdout
    assert "6.74 B" in models.stdout and "Llama-2 7B" in models.stdout  # params from the meta-device build
    # a model of two stacks: its blocks per stack (tiny-bart's encoder 3, decoder 2; llava's vision 24, language 32)
    assert re.search(r"tiny-bart +bart +0\.5 M +3\+2 ", models.stdout) and " 24+32 " in models.stdout
    monkeypatch.setattr(cli, "console", Console(width=80))
    narrow = runner.invoke(app, ["models"]).stdout
    assert all(len(line) <= 80 for line in narrow.splitlines()) and "…" not in narrow  # nothing cut
    assert all(name in narrow for name in MODELS) and " 4096" in narrow  # llama-7b's longest --seq
    policies = runner.invoke(app, ["policies"])
    assert policies.exit_code == 0
    for name in POLICIES:
        assert name in policies.stdout
    assert "k=2" in policies.stdout


BAD_INPUT = [
    (["--model", "nope"], "unknown model"),
    (["--policy", "bogus"], "unknown policy"),
    (["--policy", "every-k:k=0"], "out of range"),
    (["--policy", "segments:k=999"], "out of range"),
    (["--seq", "0"], "--seq: must be an integer from 1"),
    (["--batch", "-1"], "--batch: must be an integer from 1"),
    (["--layers", "99"], "--layers 99 is out of range"),
    (["--precision", "fp8"], "unknown precision"),
    (["--memory-cap", "lots"], "cannot read 'lots' as a size"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_and_results_untouched(tmp_path, args, message):
    out = tmp_path / "r.jsonl"
    out.write_text('{"keep": "me"}\n')
    result = runner.invoke(app, [*TINY_RUN, *args, "--out", str(out)])
    assert_refused(result, message)
    assert "Traceback" not in result.output
    assert out.read_text() == '{"keep": "me"}\n'


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA message")
def test_cuda_without_cuda(tmp_path):
    result = runner.invoke(app, [*TINY_RUN[:-6], "--device", "cuda", "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2 and "CUDA is not available" in result.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_unwritable_out_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, [*TINY_RUN, "--out", str(blocker / "sub" / "r.jsonl")])
    assert result.exit_code == 2 and "cannot write results" in result.stderr
    assert blocker.read_text() == ""


def test_model_too_large_for_the_device_is_refused_at_once(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", "llama-7b", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 2
    assert "GiB for parameters, gradients and adamw state" in result.stderr and "--layers" in result.stderr
    assert not out.exists()


def test_local_config_json(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128}))
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*TINY_RUN[:2], str(config), *TINY_RUN[3:], "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_records(out)[0]["n_layers"] == 2
    config.write_text(json.dumps({"model_type": "speech_to_text"}))
    bad = runner.invoke(app, [*TINY_RUN[:2], str(config), *TINY_RUN[3:], "--out", str(out)])
    assert bad.exit_code == 2 and "encoder-decoder" in bad.stderr


def test_usage_errors_through_the_entry_point_are_one_line():
    """Type errors are caught by click before our code runs; main() still makes them one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "gcbench", "run", "--seq", "abc"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--seq" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # four installed-command runs, each starting torch
def test_exit_codes_reach_the_shell(tmp_path):
    """Through the real entry point: a domain error exits 2, an OOM record exits 1 (not 0)."""
    entry = [sys.executable, "-m", "gcbench"]
    bad = subprocess.run([*entry, "run", "--model", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("gcbench: error: unknown model")
    oom = subprocess.run([*entry, *TINY_RUN, "--memory-cap", "5MiB", "--out", str(tmp_path / "r.jsonl")],
                         capture_output=True, text=True)
    assert oom.returncode == 1


@pytest.mark.slow  # 5.4 s (a whole process): the default suite neared its 5 minutes; CI runs it
def test_the_entry_point_leaves_its_heap_to_the_exit_not_to_a_last_collection():
    """The interpreter's last garbage collection would walk every object torch, transformers and the command
    made (about a second on 2 cores, after the record is written): the entry point freezes them, however the
    command ends."""
    code = ("import atexit, gc, sys\nfrom gcbench.__main__ import main\nsys.argv = ['gcbench', 'models']\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 10_000))\nmain()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["frozen", "True"], done.stderr


# A process ending by the entry point, its first argument a file: an atexit handler says so on stdout, and the file
# is held open with a write only the interpreter's finalization would flush ("thread": another thread runs until
# the main thread has ended)
_ENDING = ("import atexit, sys, threading\nfrom gcbench.__main__ import main\n"
           "held = open(sys.argv.pop(1), 'w')\nheld.write('finalized')\n"
           "atexit.register(lambda: print('atexit ran'))\n"
           "if 'thread' in sys.argv:\n    sys.argv.remove('thread')\n"
           "    threading.Thread(target=lambda: (threading.main_thread().join(), print('thread done'))).start()\n"
           "main()")


@pytest.mark.parametrize("argv, code", [(["models"], 0), (["run", "--model", "no-such-model"], 2)])
def test_an_ended_command_exits_with_its_code_its_output_whole_and_without_the_finalization(tmp_path, argv, code):
    """The entry point ends a command's process at once (gcbench/__main__.py): its exit code and every line it wrote
    come out as they would, the atexit handlers run, and the interpreter's finalization (which tears down torch's
    and transformers' objects one by one, and would flush the held file) does not."""
    held = tmp_path / "held.txt"
    done = subprocess.run([sys.executable, "-c", _ENDING, str(held), *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout.rstrip().endswith("atexit ran") and held.read_text() == ""
    if code == 0:
        assert "llama-7b" in done.stdout
    else:
        assert done.stderr.startswith("gcbench: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_command_that_leaves_a_thread_running_exits_as_python_does(tmp_path):
    """Another thread still running at the end: Python's own exit waits for it, so the entry point leaves the end
    to it, finalization included."""
    held = tmp_path / "held.txt"
    done = subprocess.run([sys.executable, "-c", _ENDING, str(held), "thread", "policies"], capture_output=True,
                          text=True, timeout=120)  # policies: torch loaded, 1.5 s (models builds 37 presets: 7 s)
    assert done.returncode == 0, done.stderr
    assert "thread done" in done.stdout and "atexit ran" in done.stdout and held.read_text() == "finalized"


@pytest.mark.parametrize("watch", ["sys.setprofile(lambda *a: None)", "sys.settrace(lambda *a: None)"])
def test_a_profiled_or_traced_process_keeps_python_s_own_exit(tmp_path, watch):
    """A profiler (cProfile) or a tracer (coverage, a debugger) writes what it saw at the interpreter's exit: the
    entry point's early end leaves such a process to it."""
    held = tmp_path / "held.txt"
    code = (f"import sys\nfrom gcbench.__main__ import _end_now\nheld = open({str(held)!r}, 'w')\n"
            f"held.write('finalized')\n{watch}\n_end_now(0)\nsys.setprofile(None)\nsys.settrace(None)\n"
            "print('returned')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "returned", done.stderr
    assert held.read_text() == "finalized"


def test_a_command_whose_output_was_closed_at_its_start_still_ends_cleanly():
    """stdout closed when the process starts (`gcbench ... >&-`): Python sets sys.stdout to None, which the early
    end skips as Python's own exit does (no traceback, exit 0)."""
    done = subprocess.run([sys.executable, "-m", "gcbench", "policies"], stderr=subprocess.PIPE, text=True,
                          timeout=120, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [["policies"], ["--version"]])
def test_output_to_a_full_disk_is_one_line_and_exit_1(argv):
    # `gcbench models > /dev/full` was a traceback ending in OSError: [Errno 28] (policies: the same table path)
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "gcbench", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert done.returncode == 1 and done.stderr == "gcbench: error: cannot write the output: No space left on " \
                                                   "device\n", done.stderr


def test_only_a_write_to_the_output_is_taken_for_a_lost_output():
    # an EIO from a read, or from a file no handler caught, is a bug's: its traceback stays
    import errno

    from gcbench.__main__ import _writing_output

    def raised(where):
        try:
            where()
        except OSError as e:
            return e

    def read_failed():
        raise OSError(errno.EIO, "Input/output error")

    def write_failed(file=sys.stdout):  # as click's echo holds its stream
        raise OSError(errno.EIO, "Input/output error")

    assert not _writing_output(raised(read_failed)) and _writing_output(raised(write_failed))



def test_a_model_too_large_is_told_what_would_fit_and_never_that_nothing_does_when_something_would():
    # Mistral-Nemo (12B) on a 22 GiB CPU was told "even one block does not fit; choose a smaller model", and
    # --layers 1 then ran: the hint left half the memory to activations; the refusal takes 90% for the state
    import math

    import pytest

    from gcbench.resolved import resolve
    from gcbench.runner import WontFit, check_fits, model_size, model_state_bytes
    from gcbench.spec import RunSpec
    from gcbench.units import fmt_bytes

    for precision, suffix in (("fp32", ", or --precision bf16"), ("bf16", "")):
        spec = resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=1, device="cpu", precision=precision))
        size = model_size(spec)
        need = model_state_bytes(spec, size.shapes, False, size.frozen_bytes)
        block = model_state_bytes(spec, size.block_shapes, False, size.block_frozen_bytes)
        rest = need - block * size.n_blocks
        assert rest < 2.7 * block  # what makes the first case below refused, with room for a block
        for free, hint in ((2 * (rest + block), "; try --layers 1" + suffix),
                           (math.ceil((rest + 1.5 * block) / 0.9), "; try --layers 1 (its model state then within "
                                                                    "90%, little left for activations)" + suffix),
                           (rest, f"; its embeddings and head alone need {fmt_bytes(rest)}; choose a smaller model"
                                  + suffix),
                           # those alone within 90%, not with a block: the block is what does not fit
                           (math.ceil((rest + 0.5 * block) / 0.9), f"; one block with its embeddings and head needs "
                                                                    f"{fmt_bytes(rest + block)}; choose a smaller "
                                                                    "model" + suffix)):
            with pytest.raises(WontFit) as refused:
                check_fits(spec, size, free)
            assert str(refused.value).endswith(hint), str(refused.value)
