"""Bad input and exhausted resources: refused before any work (one line on stderr, exit code 2, nothing written) or
recorded as a result; never a traceback, a torn results file or a lost record. One test per case of issue 11."""

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.resolved import resolve
from gcbench.results import store
from gcbench.results.schema import SCHEMA_VERSION, new_record
from gcbench.results.store import read_records
from gcbench.spec import RunSpec

runner = CliRunner()
FAST = ["--device", "cpu", "--warmup", "1", "--steps", "1"]
RUN = ["run", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST]


def refused(result, *words):
    """Exit code 2, one line on stderr naming `words`, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gcbench: error: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if a run starts measuring: what is refused must be refused before any work."""
    import gcbench.runner

    def measure(*args, **kwargs):
        raise AssertionError("measured although the input was refused")

    monkeypatch.setattr(gcbench.runner, "_measure", measure)


@pytest.mark.parametrize("policy,words", [
    ("full:", ["empty option list"]),
    ("every-k:", ["empty option list"]),
    ("every-k:k=", ["not an integer"]),
    ("every-k:k=2,k=3", ["given twice"]),
    ("every-k:,k=2", ["bad option"]),
])
def test_malformed_policy_is_refused(tmp_path, no_measuring, policy, words):
    out = tmp_path / "r.jsonl"
    refused(runner.invoke(app, [*RUN, "--policy", policy, "--out", str(out)]), *words)
    assert not out.exists()


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize("fields,words", [
    ({"hidden_size": -5}, ["hidden_size", "positive integer", "-5"]),
    ({"hidden_size": 30, "num_attention_heads": 4}, ["hidden size (30)", "multiple", "attention heads (4)"]),
    ({"num_attention_heads": 2, "num_key_value_heads": 3}, ["num_key_value_heads (3)", "divide"]),
    ({"intermediate_size": "64"}, ["intermediate_size", "positive integer", "'64'"]),
    ({"rms_norm_eps": "small"}, ["rms_norm_eps", "float"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers", "positive integer"]),
    ({"hidden_act": "no-such-activation"}, ["cannot build", "no-such-activation"]),
    ({"attention_dropout": 1.5}, ["attention_dropout", "dropout probability", "0 to 1", "1.5"]),  # torch's, mid-step
    ({"attention_dropout": "0.1"}, ["attention_dropout", "dropout probability", "'0.1'"]),
    ({"rms_norm_eps": float("nan")}, ["rms_norm_eps", "NaN"]),  # json.dumps writes NaN; Python's reader takes it
    ({"rms_norm_eps": -1e-06}, ["rms_norm_eps", "epsilon", "0 or more", "-1e-06"]),  # a NaN loss, no error
])
def test_config_json_that_transformers_rejects_is_one_line(tmp_path, no_measuring, fields, words):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA, **fields}))
    out = tmp_path / "r.jsonl"
    refused(runner.invoke(app, ["run", "--model", str(config), *RUN[3:], "--out", str(out)]), "config.json",
            *words)
    assert not out.exists()


def test_a_config_keeps_what_its_families_ship_as_dropout_flags_and_infinite_bounds():
    from gcbench.config_values import check_values

    # ESM's token_dropout is a flag; Mamba-2's time_step_limit is (0, inf), as transformers' defaults hold them
    check_values({"token_dropout": True, "time_step_limit": [0.0, float("inf")], "dropout": 0}, (), "c")
    with pytest.raises(GcbenchError, match=r"c: text_config\.resid_pdrop is a dropout probability.*-0\.1"):
        check_values({"text_config": {"resid_pdrop": -0.1}}, (), "c")
    with pytest.raises(GcbenchError, match=r"c: attn_drop_rate is a dropout probability"):  # MGP-STR's name
        check_values({"attn_drop_rate": 2.0}, (), "c")
    with pytest.raises(GcbenchError, match=r"c: layer_types must be a number, got NaN"):
        check_values({"layer_types": [[1.0, float("nan")]]}, (), "c")


@pytest.mark.parametrize("text,words", [("[1, 2]", ["one JSON object", "list"]), ("", ["not a JSON config"]),
                                        ('{"model_type": "speech_to_text"}', ["speech_to_text is a speech encoder-"
                                                                              "decoder", "gcbench does not make up"]),
                                        ('{"model_type": "my-own", "auto_map": {}}', ["'my-own' is not a family",
                                                                                      "trust_remote_code"])])
def test_config_json_that_is_no_config_is_one_line(tmp_path, text, words):
    config = tmp_path / "config.json"
    config.write_text(text)
    refused(runner.invoke(app, ["estimate", "--model", str(config), "--seq", "32", "--method", "analytic"]), *words)


def test_seq_past_the_models_positions_is_refused(tmp_path, no_measuring):
    out = tmp_path / "r.jsonl"
    # tiny-llama (RoPE) is made for 2048 positions; gpt2's table has 1024
    refused(runner.invoke(app, [*RUN, "--seq", "10000000", "--out", str(out)]), "--seq 10000000", "2048 positions")
    refused(runner.invoke(app, [*RUN, "--model", "tiny-gpt2", "--seq", "4096", "--out", str(out)]),
            "2048 learned positions")
    scaled = tmp_path / "long.json"  # a linear rope_scaling factor stretches the limit
    scaled.write_text(json.dumps({**LLAMA, "max_position_embeddings": 64,
                                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    assert RunSpec(model=str(scaled), seq_len=256, batch_size=1, device="cpu").seq_len == 256
    refused(runner.invoke(app, [*RUN, "--model", str(scaled), "--seq", "257", "--out", str(out)]), "256 positions")
    assert not out.exists()


def test_a_size_the_device_cannot_hold_is_refused_in_seconds_without_allocating(tmp_path, no_measuring):
    out = tmp_path / "r.jsonl"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    line = refused(runner.invoke(app, [*RUN, "--seq", "2048", "--batch", "100000", "--out", str(out)]),
                   "predicted peak", "TiB", "cpu has", "free")
    assert "try a smaller --seq or --batch" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1024**2  # under 1 GiB more, ever
    assert not out.exists()


def test_the_same_size_in_a_sweep_is_an_oom_record_without_allocating(tmp_path):
    out = tmp_path / "r.jsonl"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32,64", "--batch", "1,10000000",
                                 "--policy", "none", *FAST, "--isolation", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1024**2  # under 1 GiB more, ever
    by_shape = {(r["seq_len"], r["batch_size"]): r for r in read_records(out)}
    # the larger seq at the huge batch is skipped after the first one's (predicted) OOM, as after any OOM
    assert [r["status"] for r in by_shape.values()] == ["ok", "oom", "ok", "skipped"]
    huge = by_shape[32, 10000000]
    assert huge["oom_predicted"] and huge["error"].startswith("not run: the predicted peak")
    assert huge["predicted_peak_bytes"] > 2**40 and huge["env"] is not None
    # the reason, once, numbered under the table (after the note on the one-step timings)
    assert re.search(r"^\(\d\) not run: the predicted peak", result.stdout, re.M), result.stdout


def test_memory_cap_below_model_state_is_an_oom_in_human_units(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*RUN, "--memory-cap", "1MiB", "--out", str(out)])
    assert result.exit_code == 1, result.output  # an OOM is a result, as on a card that small
    [record] = read_records(out)
    assert record["status"] == "oom" and record["oom_predicted"]
    assert "--memory-cap allows 1.00 MiB" in record["error"] and "MiB for parameters" in record["error"]
    assert "oom" in result.stdout and "(None blocks)" not in result.stdout


def test_a_sweep_that_cannot_fit_at_all_starts_no_child(tmp_path, monkeypatch):
    """The README's llama-7b sweep on a machine too small: every config is known not to fit before the first child
    (model state 28 GiB in fp32 against 1 GiB free): refused with one line, rather than a file of oom records of
    configs never run (which a report would show as results)."""
    from gcbench.launch import process as isolation
    from gcbench.sweeps import orchestrate

    def no_child(self, spec, on_phase):
        raise AssertionError("a child was started for a config that cannot fit")

    monkeypatch.setattr(isolation.ProcessRunner, "__call__", no_child)
    monkeypatch.setattr(orchestrate, "free_without_context", lambda device: 2**30)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", "--model", "llama-7b", "--layers", "8", "--seq", "512,1024",
                                 "--batch", "1,2", "--policy", "none,full", *FAST, "--precision", "fp32",
                                 "--out", str(out)])
    refused(result, "none of the 8 configs fits: llama-7b needs 28.03 GiB", "cpu has 1.00 GiB free")
    assert not out.exists()


def a_record() -> str:
    """A record as a line of a results file (a config that has not run: the checks of a record pass)."""
    spec = resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=1, device="cpu"))
    return json.dumps(new_record(spec.as_record()))


def test_run_onto_a_torn_last_line_repairs_it_then_appends(tmp_path):
    out = tmp_path / "r.jsonl"
    good = a_record()
    out.write_text(good + "\n" + '{"schema_version": 1, "mod')
    result = runner.invoke(app, [*RUN, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "removed a truncated last line" in result.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and lines[0] == good and json.loads(lines[1])["status"] == "ok"


@pytest.mark.parametrize("text", ["hello", "hello\n", "notes\nmore notes"])
def test_a_file_whose_last_line_is_no_record_is_refused_never_cut_or_appended_to(tmp_path, no_measuring, text):
    # Only a line that starts as a record does ("{") can be one a killed writer cut short: "hello" says the file is
    # not a results file, which `--out` by mistake must not cut a line off or write a record after.
    out = tmp_path / "notes.txt"
    out.write_text(text)
    refused(runner.invoke(app, [*RUN, "--out", str(out)]), "notes.txt:", "not a results file?")
    refused(runner.invoke(app, ["report", str(out)]), "notes.txt:", "not a results file?")
    assert out.read_text() == text
    from gcbench.results.store import append_record

    if not text.endswith("\n"):  # where the append itself would have cut the line off as a torn record
        with pytest.raises(GcbenchError, match="not a JSON object .* not a results file"):
            append_record(out, {"schema_version": SCHEMA_VERSION})
        assert out.read_text() == text


@pytest.mark.parametrize("option, value", [("--seq", "32,,64"), ("--policy", "none,"), ("--batch", ",1")])
def test_an_empty_item_in_a_comma_list_is_refused_not_skipped(tmp_path, option, value):
    given = {"--seq": "32", "--batch": "1", option: value}
    args = ["sweep", "--model", "tiny-llama", *(x for item in given.items() for x in item), "--device", "cpu",
            "--dry-run", "--out", str(tmp_path / "s.jsonl")]
    refused(runner.invoke(app, args), option, "an empty item", repr(value))


@pytest.mark.parametrize("args, option", [
    (["estimate", "--model", "tiny-llama", "--seq", "32", "--method", "analytic,"], "--method"),
    (["validate", "--dry-run", "--tiers", "1,,2"], "--tiers"),
    ([*RUN, "--loss", "chunked:n=8,"], "--loss"),
    (["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--device", "cuda", "--devices", "cuda:0,",
      "--dry-run"], "--devices"),
])
def test_every_comma_list_refuses_an_empty_item(tmp_path, args, option):
    refused(runner.invoke(app, [*args, *(["--out", str(tmp_path / "r.jsonl")] if args[0] in ("run", "sweep")
                                         else [])]), option, "an empty item")


def test_several_cards_for_gpu_are_refused_as_such():
    refused(runner.invoke(app, ["estimate", "--model", "tiny-llama", "--seq", "32", "--method", "analytic", "--gpu",
                                "rtx4090-24gb,a100-80gb"]), "--gpu takes one card", "a command of its own")


def test_run_onto_a_newer_schema_is_refused_before_measuring(tmp_path, no_measuring):
    out = tmp_path / "r.jsonl"
    content = json.dumps({"schema_version": SCHEMA_VERSION + 1, "model": "x"}) + "\n"
    out.write_text(content)
    refused(runner.invoke(app, [*RUN, "--out", str(out)]), f"schema_version {SCHEMA_VERSION + 1}", "newer gcbench")
    assert out.read_text() == content


def _disk_fills_up(monkeypatch, after: int = 10):
    """Writes put `after` bytes on disk, then fail as a full disk does."""
    def write_all(fd, data):
        os.write(fd, data[:after])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "_write_all", write_all)


@pytest.mark.parametrize("existing", [True, False])
def test_full_disk_leaves_the_file_as_it_was_and_prints_the_record(tmp_path, monkeypatch, existing):
    out = tmp_path / "r.jsonl"
    before = a_record() + "\n"
    if existing:
        out.write_text(before)
    _disk_fills_up(monkeypatch)
    result = runner.invoke(app, [*RUN, "--out", str(out)])
    refused(result, "cannot write results", "the disk is full", "left as it was")
    assert out.read_text() == before if existing else not out.exists()
    record = json.loads(result.stdout.strip().splitlines()[-1])  # the measurement is not lost
    assert record["status"] == "ok" and record["model"] == "tiny-llama"


def test_full_disk_during_a_sweep_stops_it_and_keeps_earlier_records(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    args = ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy", "none,full", *FAST,
            "--isolation", "none", "--out", str(out)]
    assert runner.invoke(app, [*args[:-6], "--policy", "none", *FAST, "--isolation", "none", "--out",
                               str(out)]).exit_code == 0
    before = out.read_bytes()
    _disk_fills_up(monkeypatch)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].endswith("the disk is full; the file is left as it was")
    assert out.read_bytes() == before


@pytest.mark.parametrize("make_args", [
    lambda t: ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST, "--out", "/dev/full"],
    lambda t: [*RUN, "--out", "/dev/null"],
    lambda t: ["report", "/dev/zero"],
    lambda t: ["compare", "/dev/zero", "/dev/zero"],
    lambda t: ["report", str(t / "fifo.jsonl")],
    lambda t: ["report", str(t / "binary.jsonl")],
])
def test_results_must_be_regular_files(tmp_path, make_args):
    os.mkfifo(tmp_path / "fifo.jsonl")  # reading it would block forever
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    t0 = time.monotonic()
    line = refused(runner.invoke(app, make_args(tmp_path)))
    assert "regular file" in line or "not UTF-8" in line
    assert time.monotonic() - t0 < 60  # at once: nothing read from a device


def test_ctrl_c_during_run_says_nothing_was_written(tmp_path, monkeypatch):
    import gcbench.runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gcbench.runner, "_measure", interrupted)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, [*RUN, "--out", str(out)])
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines() == [f"gcbench: interrupted; nothing was written to {out}"]
    assert not out.exists()


def test_ctrl_c_while_the_record_is_written_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    out.write_text(a_record() + "\n")
    before = out.read_bytes()

    def write_all(fd, data):
        os.write(fd, data[:7])
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_write_all", write_all)
    result = runner.invoke(app, [*RUN, "--out", str(out)])
    assert result.exit_code == 130 and "nothing was written" in result.stderr
    assert out.read_bytes() == before


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_while_a_sweep_starts_up_exits_130_with_the_resume_message(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "gcbench", "sweep", "--model", "tiny-llama", "--seq", "32",
                             "--batch", "1", *FAST, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGTERM):  # the entry point's first act; imports follow
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.002)
    # SIGTERM is caught before torch is even loaded: the sweep's own handler would come only after that
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gcbench: interrupted") and "run the same command again" in last
    assert "Traceback" not in err and not out.exists()


def test_retry_failed_reruns_errors_and_timeouts_but_not_ooms(tmp_path):
    from gcbench.grid import SweepSpec
    from gcbench.sweeps.orchestrate import Sweep

    out = tmp_path / "r.jsonl"
    grid = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": [1, 2, 4], "policy": "none",
                                 "device": "cpu", "warmup": 1, "steps": 1, "out": out})
    for spec, status in zip(grid.expand(), ("error", "timeout", "oom")):
        store.append_record(out, new_record(spec.as_record(), status, "earlier"))

    def to_run(**how):
        return [p.spec.batch_size for p in Sweep(grid, **how).plan() if p.done is None]

    assert to_run() == []  # every status is final on a plain resume
    assert to_run(retry_failed=True) == [1, 2]
    assert to_run(rerun=True) == [1, 2, 4]
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1,2,4", "--policy",
                                 "none", *FAST, "--out", str(out), "--retry-failed", "--dry-run"])
    assert result.exit_code == 0 and "2 to run" in result.stdout


def test_pathological_files_and_names_are_one_line(tmp_path, no_measuring):
    deep = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit
    results = tmp_path / "deep.jsonl"
    results.write_text(json.dumps({"schema_version": SCHEMA_VERSION}) + "\n" + deep + "\n" + "{}\n")
    refused(runner.invoke(app, ["report", str(results)]), "deep.jsonl:2: corrupt results line")
    (tmp_path / "deep.json").write_text(deep)
    refused(runner.invoke(app, ["estimate", "--model", str(tmp_path / "deep.json"), "--seq", "16"]),
            "not a JSON config")
    long_name = tmp_path / ("b" * 5000 + ".jsonl")
    refused(runner.invoke(app, [*RUN, "--out", str(long_name)]), "cannot write results", "File name too long")
    refused(runner.invoke(app, [*RUN, "--model", str(tmp_path / ("a" * 5000 + ".json"))]), "cannot read model config")
    refused(runner.invoke(app, ["report", str(results), "--out", ""]), "--out: an empty path")


def test_retry_failed_checks_free_memory_ooms_again(tmp_path):
    from gcbench.grid import SweepSpec
    from gcbench.sweeps.orchestrate import Sweep

    out = tmp_path / "r.jsonl"
    grid = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": [1, 2], "policy": "none",
                                 "device": "cpu", "out": out})
    for spec, limit in zip(grid.expand(), ("free", "cap")):
        store.append_record(out, new_record(spec.as_record(), "oom", "not run: ...", oom_predicted=True,
                                            oom_limit=limit))
    assert [p.spec.batch_size for p in Sweep(grid, retry_failed=True).plan() if p.done is None] == [1]
    assert all(p.done for p in Sweep(grid).plan())


def test_a_torn_tail_is_cut_under_the_lock_when_appending(tmp_path):
    out = tmp_path / "r.jsonl"
    whole = json.dumps({"schema_version": SCHEMA_VERSION, "a": 1})
    out.write_text(whole + "\n" + '{"schema_version": 1, "a": ')
    assert store.append_record(out, {"schema_version": SCHEMA_VERSION, "a": 2}) == '{"schema_version": 1, "a": '
    assert [r["a"] for r in read_records(out)] == [1, 2]
    out.write_text(whole)  # a whole object without its newline stays
    assert store.append_record(out, {"schema_version": SCHEMA_VERSION, "a": 3}) is None
    assert [r["a"] for r in read_records(out)] == [1, 3]


@pytest.mark.parametrize("text", ["0.5", "0.5B", "0", "-1GiB", "1e99", "2EiB"])
def test_sizes_below_a_byte_or_beyond_any_memory_are_refused(text):
    from gcbench.errors import GcbenchError
    from gcbench.units import parse_bytes

    with pytest.raises(GcbenchError):
        parse_bytes(text)


@pytest.mark.parametrize("args", [
    [*RUN, "--memory-cap", "12"],
    ["estimate", "--model", "tiny-llama", "--seq", "32", "--method", "analytic", "--gpu-memory", "80"],
    ["fit", "--model", "tiny-llama", "--seq", "32", "--device", "cpu", "--memory", "12"],
])
def test_a_size_without_its_unit_is_refused_not_read_as_bytes(tmp_path, no_measuring, args):
    # `--gpu-memory 80` meant 80 GiB or GB: read as 80 bytes it made every estimate "does not fit"
    refused(runner.invoke(app, [*args, "--out", str(tmp_path / "r.jsonl")] if args[0] != "estimate" else args),
            "has no unit", "GiB")


def test_a_size_as_an_int_from_a_file_or_the_api_is_bytes():
    from gcbench.fields import BY_NAME

    size = BY_NAME["memory_cap_bytes"].kind
    assert size.parse(5 * 2**20) == 5 * 2**20 == size.parse("5MiB")
    with pytest.raises(GcbenchError, match="has no unit"):
        size.parse("5242880")


class FakeNvml:
    """pynvml with GPUs of the given names, each with `free` bytes = 1000 x (its NVML index + 1)."""

    class NVMLError(Exception):
        pass

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, names):
        self.names = names

    def nvmlInit(self): pass

    def nvmlShutdown(self): pass

    def nvmlDeviceGetCount(self): return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i): return i

    def nvmlDeviceGetHandleByUUID(self, uuid): return int(uuid.removeprefix("GPU-"))

    def nvmlDeviceGetName(self, h): return self.names[h]

    def nvmlDeviceGetMigMode(self, h): return (0, 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Memory", (), {"free": 1000 * (h + 1)})()


@pytest.mark.parametrize("names,env,index,free", [
    (["H100", "H100"], {}, 1, 2000),
    (["H100", "H100"], {"CUDA_VISIBLE_DEVICES": "1"}, 0, 2000),
    (["H100", "H100"], {"CUDA_VISIBLE_DEVICES": "GPU-1,GPU-0"}, 1, 1000),
    (["H100", "A100"], {}, 0, None),  # CUDA's fastest-first order is not NVML's
    (["H100", "A100"], {"CUDA_VISIBLE_DEVICES": "1"}, 0, None),  # a CUDA index, in CUDA's order
    (["H100", "A100"], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}, 0, 2000),
    (["H100", "H100"], {"CUDA_VISIBLE_DEVICES": "MIG-abc"}, 0, None),
    (["H100"], {}, 3, None),
])
def test_free_memory_without_a_cuda_context_finds_the_gpu_cuda_means(monkeypatch, names, env, index, free):
    from gcbench import instruments

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(names))
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert instruments.free_without_context(f"cuda:{index}") == free
