"""`gcbench sweep`: grid expansion, isolation, OOM/timeout/error as results, resume after a kill, bad input.

Tiny presets, seq 32, one warm-up and one timed step: each config is a fraction of a second of compute.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.resolved import resolve, resolve_record
from gcbench.results.schema import SCHEMA_VERSION
from gcbench.results.store import read_records
from gcbench.spec import RunSpec
from gcbench.results.schema import config_key as spec_key
from gcbench.grid import SweepSpec
from gcbench.sweeps.orchestrate import NOT_YET_PAIRED, OomFrontier
from gcbench.runner import run
from tests.helpers import assert_refused, policy_examples

runner = CliRunner()
FAST = dict(device="cpu", warmup=1, steps=1)
FAST_ARGS = ["--device", "cpu", "--warmup", "1", "--steps", "1"]
# Exact live-tensor bytes of tiny-llama at seq 32 (fp32, adamw), measured: batch 1 'none' peaks at 4.89 MiB,
# batch 2 at 5.94 MiB, batch 4 at 8.05 MiB; 'full' stays under 5 MiB up to batch 4. A 5.5 MiB cap sits between.
CAP = "5.5MiB"


def statuses(records):
    return [(r["seq_len"], r["batch_size"], r["policy"], r["status"]) for r in records]


def test_toml_and_cli_grids_expand_identically(tmp_path):
    toml = tmp_path / "grid.toml"
    toml.write_text('model = ["tiny-llama", "tiny-gpt2"]\nseq = [64, 32]\nbatch = 2\n'
                    'policy = ["none", "every-k:k=2", "segments"]\ndevice = "cpu"\nmemory_cap = "1GiB"\n')
    from_toml = SweepSpec.load(toml).expand()
    from_cli = SweepSpec.load(None, {"model": "tiny-llama,tiny-gpt2", "seq": "32,64", "batch": "2",
                                     "policy": "none,every-k:k=2,segments:k=2", "device": "cpu",
                                     "memory-cap": "1GiB"}).expand()
    assert from_toml == from_cli
    assert len(from_toml) == 2 * 2 * 1 * 3
    # seq ascending (smallest first, so an OOM can skip the larger ones), policies innermost
    assert [(s.model, s.seq_len, str(s.policy)) for s in from_toml[:4]] == [
        ("tiny-llama", 32, "none"), ("tiny-llama", 32, "every-k:k=2"), ("tiny-llama", 32, "segments:k=2"),
        ("tiny-llama", 64, "none")]
    assert {s.memory_cap_bytes for s in from_toml} == {2**30}
    # a multi-option policy in a comma list stays one policy
    from gcbench.fields import run_field
    assert run_field("policy").parse_many("none,every-k:k=3,full") == ("none", "every-k:k=3", "full")


def test_every_runspec_field_is_a_grid_option(tmp_path):
    """Declared once in fields.py: any field takes several values in a sweep, on the command line or in TOML."""
    toml = tmp_path / "grid.toml"
    toml.write_text('model = "tiny-llama"\nseq = 32\nbatch = 1\npolicy = "none"\nlayers = [1, 2]\n'
                    'precision = ["fp32", "bf16"]\ndevice = "cpu"\n')
    specs = SweepSpec.load(toml).expand()
    assert [(s.layers, s.precision) for s in specs] == [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")]
    assert SweepSpec.load(None, {"model": "tiny-llama", "seq": "32", "batch": "1", "seed": "1,2", "policy": "none",
                                 "device": "cpu"}).expand()[1].seed == 2


def test_smoke_toml_is_the_16_config_tiny_cpu_grid():
    grid = SweepSpec.load(Path(__file__).parent.parent / "sweeps" / "smoke.toml")
    specs = grid.expand()
    assert len(specs) == 16 and {s.model for s in specs} == {"tiny-llama"} and {s.device for s in specs} == {"cpu"}


def test_runspec_json_round_trip():
    """What resume and the child rely on, for every registered policy (with its default options)."""
    for policy in ("every-k:k=3", "segments:k=2", *policy_examples()):
        spec = resolve(RunSpec("tiny-gpt2", 32, 2, policy, layers=3, device="cpu", memory_cap_bytes=10**9, seed=7))
        stored = json.loads(json.dumps({**spec.as_record(), "status": "ok", "step_ms": [1.0]}))
        assert resolve_record(stored) == spec
        assert spec_key(stored) == spec_key(spec.as_record())


def test_dry_run_prints_the_grid_and_writes_nothing(tmp_path):
    out = tmp_path / "sub" / "r.jsonl"
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32,64", "--batch", "1,2", "--policy",
                                 "none,full", *FAST_ARGS, "--out", str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "8 configs (8 to run, 0 already in" in result.stdout
    assert result.stdout.count("tiny-llama") == 8
    assert not out.parent.exists()


def test_a_dry_run_stopped_by_ctrl_c_says_nothing_was_run(tmp_path, monkeypatch):
    # it said "finished configs are in r.jsonl, run the same command again to resume"
    from gcbench.sweeps import Sweep

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Sweep, "plan", interrupted)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST_ARGS,
                                 "--out", str(out), "--dry-run"])
    assert result.exit_code == 130 and "gcbench: interrupted; nothing was run (--dry-run)" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["sweep", "estimate"])
def test_a_grid_past_its_cap_is_refused_before_any_config_is_made(tmp_path, command):
    # 200 seq by 60 batch: 12,000 configs, which a sweep's dry run spent a minute expanding in silence
    out = tmp_path / "r.jsonl"
    seqs, batches = ",".join(map(str, range(16, 216))), ",".join(map(str, range(1, 61)))
    args = ["--out", str(out), "--policy", "none"] if command == "sweep" else ["--method", "analytic"]
    result = runner.invoke(app, [command, "--model", "tiny-llama", "--seq", seqs, "--batch", batches, *args])
    assert_refused(result, "the grid holds 12,000 combinations (200 --seq x 60 --batch): at most 10,000 in one command")
    assert not out.exists()


def _bad(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_INPUT = [
    (lambda t: ["--config", _bad(t, "a.toml", "model = [tiny-llama\n")], "malformed TOML"),
    (lambda t: ["--config", _bad(t, "b.toml", 'model = "tiny-llama"\nseq = 32\nbatch = 1\nsteps = 1\nwarmpu = 2\n')],
     "unknown option 'warmpu'"),
    (lambda t: ["--config", _bad(t, "c.toml", 'model = "tiny-llama"\nseq = []\nbatch = 1\n')], "grid would be empty"),
    (lambda t: ["--model", "tiny-llama", "--seq", "", "--batch", "1"], "grid would be empty"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32", "--batch", "1,2,1"], "duplicate value 1"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy", "every-k,every-k:k=2"],
     "duplicate value every-k:k=2"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32,x", "--batch", "1"], "--seq: 'x' is not"),
    (lambda t: ["--model", "tiny-llama", "--batch", "1"], "no --seq given"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32", "--batch", "1", "--layers", "8"],
     "--layers 8 is out of range: the model has 4 blocks (config: tiny-llama, seq 32, batch 1, none)"),
    (lambda t: ["--model", "tiny-llama,nope", "--seq", "32", "--batch", "1"], "unknown model 'nope'"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32", "--batch", "1", "--isolation", "thread"],
     "unknown isolation"),
    (lambda t: ["--model", "tiny-llama", "--seq", "32", "--batch", "1", "--timeout", "0"], "must be a number of seconds above 0"),
]


@pytest.mark.parametrize("make_args,message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, make_args, message):
    out = tmp_path / "out" / "r.jsonl"
    result = runner.invoke(app, ["sweep", *make_args(tmp_path), *FAST_ARGS, "--out", str(out)])
    assert_refused(result, message)
    assert not out.parent.exists()


def test_unwritable_output_and_other_schema_are_refused(tmp_path):
    grid = ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST_ARGS]
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, [*grid, "--out", str(blocker / "r.jsonl")])
    assert result.exit_code == 2 and "cannot write results" in result.stderr
    other = tmp_path / "old.jsonl"
    content = json.dumps({"schema_version": SCHEMA_VERSION + 1, "model": "x"}) + "\n"
    other.write_text(content)
    result = runner.invoke(app, [*grid, "--out", str(other)])
    assert_refused(result, "schema_version")
    assert other.read_text() == content


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_oom_is_a_result_and_larger_batches_are_skipped(tmp_path):
    """Process isolation: the child's OOM comes back as a record, and the larger batch is skipped."""
    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(model="tiny-llama", seq=32, batch=[1, 2, 4], policy="none", memory_cap=CAP, out=out,
                            progress=False, **FAST)
    assert statuses(records) == [(32, 1, "none", "ok"), (32, 2, "none", "oom"), (32, 4, "none", "skipped")]
    assert records == read_records(out)
    oom, skipped = records[1], records[2]
    assert "memory cap" in oom["error"] and oom["env"]["torch"]
    assert "seq 32 batch 2" in skipped["error"] and "--no-skip" in skipped["error"]
    assert skipped["config_wall_ms"] is None and skipped["env"] is not None
    assert {r["sweep_id"] for r in records} == {records[0]["sweep_id"]}
    assert all(r["isolation"] == "process" and "pytorch_cuda_alloc_conf" in r["env"] for r in records)

    # --no-skip runs what was skipped (in-process here: the status is the same); the rest is resumed.
    again = gcbench.sweep(model="tiny-llama", seq=32, batch=[1, 2, 4], policy="none", memory_cap=CAP, out=out,
                          isolation="none", skip_after_oom=False, progress=False, **FAST)
    assert [r["status"] for r in again] == ["ok", "oom", "oom"]
    assert read_records(out) == again and len(out.read_text().splitlines()) == 3  # the skipped one's line taken


def test_memory_cap_bites_in_warm_up():
    """From the second warm-up step on (optimizer state exists), a too-small cap stops the run in warm-up."""
    phases = []
    record = run(RunSpec("tiny-llama", 32, 4, device="cpu", warmup_steps=2, measure_steps=1,
                         memory_cap_bytes=int(5.5 * 2**20)), progress=phases.append)
    assert record["status"] == "oom" and phases[-1] == "warm-up 2/2"


def test_skip_rule_covers_larger_seq_and_batch_only():
    frontier = OomFrontier()
    frontier.add({**resolve(RunSpec("tiny-llama", 64, 2, device="cpu")).as_record(), "status": "oom"})
    skipped = lambda seq, batch, **kw: frontier.skip_reason(resolve(RunSpec("tiny-llama", seq, batch, device="cpu",
                                                                            **kw)))
    assert skipped(64, 4) and skipped(128, 2) and skipped(128, 8)
    assert not skipped(32, 8) and not skipped(128, 1)  # not larger in both: may fit
    assert not skipped(64, 4, policy="full") and not skipped(64, 4, layers=2)  # other options: may fit


def test_timeout_kills_the_child(tmp_path):
    import multiprocessing

    out = tmp_path / "r.jsonl"
    t0 = time.monotonic()
    [record] = gcbench.sweep(model="tiny-llama", seq=32, batch=1, policy="none", device="cpu", warmup=1,
                             steps=100_000, timeout=1, out=out, progress=False)
    assert record["status"] == "timeout" and "no result within 1 s" in record["error"]
    assert time.monotonic() - t0 < 60
    assert multiprocessing.active_children() == []


def test_error_in_a_child_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # Valid when the sweep is made (the parent builds every config's model on the meta device); edited before its
    # child starts, so that it fails in the child.
    from gcbench.sweeps.orchestrate import Sweep

    config = tmp_path / "edited.json"
    fields = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "vocab_size": 128}
    config.write_text(json.dumps(fields))
    run_grid = Sweep.run

    def edit_then_run(self):
        config.write_text(json.dumps({**fields, "hidden_act": "no-such-activation"}))
        return run_grid(self)

    monkeypatch.setattr(Sweep, "run", edit_then_run)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", "--model", f"{config},tiny-llama", "--seq", "32", "--batch", "1",
                                 "--policy", "none", *FAST_ARGS, "--out", str(out)])
    assert result.exit_code == 1, result.output  # an error (unlike an OOM) makes the command fail
    bad, good = read_records(out)
    assert bad["status"] == "error" and "exited with code 1" in bad["error"] and "no-such-activation" in bad["error"]
    assert "no-such-activation" in bad["stderr_tail"]  # the child's own output
    assert good["status"] == "ok" and good["step_ms_median"] > 0
    assert "error" in result.stderr and "ok" in result.stderr  # one line per finished config
    assert "1 error" in result.stdout


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_truncated_last_line_is_warned_about_and_ignored(tmp_path):
    out = tmp_path / "r.jsonl"
    opts = dict(model="tiny-llama", seq=32, batch=1, out=out, isolation="none", progress=False, **FAST)
    gcbench.sweep(policy="none", **opts)
    with open(out, "a") as f:
        f.write('{"schema_version": 1, "model": "tiny-ll')  # a writer killed mid-line
    with pytest.warns(UserWarning, match="truncated last line"):
        records = gcbench.sweep(policy=["none", "full"], **opts)
    assert [r["policy"] for r in records] == ["none", "full"]
    assert [r["policy"] for r in read_records(out)] == ["none", "full"]  # the file loads cleanly again
    assert all(json.loads(line)["schema_version"] for line in out.read_text().splitlines())  # the torn line is gone


def test_rerun_runs_everything_again(tmp_path):
    out = tmp_path / "r.jsonl"
    opts = dict(model="tiny-llama", seq=32, batch=1, policy="none", out=out, isolation="none", progress=False,
                **FAST)
    first = gcbench.sweep(**opts)
    assert gcbench.sweep(**opts) == first  # resumed: nothing ran
    again = gcbench.sweep(rerun=True, **opts)
    assert again[0]["sweep_id"] != first[0]["sweep_id"] and read_records(out) == again  # on the first one's line


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _wait_gone(pids: set[int], seconds: float = 20) -> set[int]:
    deadline = time.monotonic() + seconds
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}
        time.sleep(0.1)
    return pids


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _start_sweep(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gcbench", "sweep", "--model",
                             "tiny-llama", "--seq", "32", "--batch", "1,2,4", "--policy", "none", *FAST_ARGS,
                             "--out", str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_records(out: Path, n: int, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if out.exists() and out.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {n} record(s) within {seconds} s")


@pytest.mark.slow  # a fresh interpreter and fork server: two imports of torch + transformers
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the child processes")
def test_resume_after_kill_runs_every_config_exactly_once(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = _start_sweep(out)
    _wait_for_records(out, 1, proc)
    family = _descendants(proc.pid)  # the fork server and the running child
    proc.kill()  # kill -9: no chance to clean up
    proc.communicate()
    assert _wait_gone(family) == set(), "children outlived a killed sweep"
    before = read_records(out)
    assert 1 <= len(before) < 3

    records = gcbench.sweep(model="tiny-llama", seq=32, batch=[1, 2, 4], policy="none", out=out, progress=False,
                            **FAST)
    stored = read_records(out)
    assert len(stored) == 3 and len({spec_key(r) for r in stored}) == 3  # every config exactly once
    assert stored[: len(before)] == before and records == stored
    assert all(r["status"] == "ok" for r in stored)


@pytest.mark.slow  # a fresh interpreter and fork server: two imports of torch + transformers
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the child processes")
def test_sigterm_stops_the_child_and_exits_cleanly(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = _start_sweep(out)
    _wait_for_records(out, 1, proc)
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert _wait_gone(family) == set()
    assert all(r["status"] == "ok" for r in read_records(out))  # only whole records, no partial or error line


# A sweep whose second config (`full`) never ends: the first one has finished when it starts (the marker file).
HANG_ON_FULL = """
import pathlib, sys, time
from gcbench.launch.process import ProcessRunner
call, marker = ProcessRunner.__call__, pathlib.Path(sys.argv[1])
def hang_on_full(self, spec, on_phase):
    if spec.policy.name == "full":
        marker.touch()
        time.sleep(600)
    return call(self, spec, on_phase)
ProcessRunner.__call__ = hang_on_full
from gcbench.cli import main
sys.argv = ["gcbench", *sys.argv[2:]]
main()
"""


@pytest.mark.slow  # a fresh interpreter and fork server: two imports of torch + transformers
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the child processes")
def test_kill_9_loses_no_finished_config_and_the_resume_runs_it_not_again(tmp_path):
    """README: a kill loses at most the config in flight. `none` has finished, `full` is running (its pairing with
    `none` to come): kill -9 keeps `none`, and the resumed sweep runs only `full`, then pairs both."""
    out, started = tmp_path / "r.jsonl", tmp_path / "full-started"
    grid = ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy", "none,full", *FAST_ARGS,
            "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", HANG_ON_FULL, str(started), *grid], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    family = _descendants(proc.pid)
    proc.kill()
    proc.communicate()
    assert _wait_gone(family) == set()
    [kept] = read_records(out)
    assert kept["policy"] == "none" and kept["status"] == "ok"
    assert kept["paired_error"] == NOT_YET_PAIRED

    records = gcbench.sweep(model="tiny-llama", seq=32, batch=1, policy=["none", "full"], out=out, progress=False,
                            **FAST)
    assert [r["policy"] for r in records] == ["none", "full"]
    assert records[0]["sweep_id"] == kept["sweep_id"] != records[1]["sweep_id"]  # none not run again
    assert all("time_ratio" in r and "paired_error" not in r for r in records)  # paired with the resumed one
    assert read_records(out) == records


@pytest.mark.slow  # a fresh interpreter and fork server: two imports of torch + transformers
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the child processes")
def test_kill_9_of_a_sweep_leaves_no_child_log_behind(tmp_path):
    # short: the fork server's socket lives in TMPDIR, and an AF_UNIX path has 107 bytes at most (pytest's tmp_path
    # under a clean clone's CI folder and a high pytest-N ran past it)
    temp = Path(tempfile.mkdtemp(prefix="k9-", dir="/tmp"))
    proc = subprocess.Popen([sys.executable, "-m", "gcbench", "sweep", "--model", "tiny-llama", "--seq", "32",
                             "--batch", "1", "--policy", "none", "--device", "cpu", "--steps", "100000",
                             "--max-time", "600", "--timeout", "600", "--out", str(tmp_path / "r.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(temp)})
    deadline = time.monotonic() + 180
    while not (child := _config_child(proc.pid)):  # forked by the fork server: the config is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    family = _descendants(proc.pid)
    proc.kill()
    proc.communicate()
    assert _wait_gone(family) == set(), "children outlived a killed sweep"
    assert child in family
    left = sorted(p.name for p in temp.rglob("gcbench-child-*"))
    shutil.rmtree(temp, ignore_errors=True)
    assert left == []


def _config_child(pid: int) -> int | None:
    """A process forked by the fork server among `pid`'s descendants (a config's child), if any: a fork, so its
    command line is the server's, not that of a program the server runs while it warms up (git, for the sha)."""
    def forked(p: int) -> bool:
        try:
            return b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return False

    for server in filter(forked, _descendants(pid)):
        if children := [c for c in _descendants(server) if forked(c)]:
            return children[0]
    return None


@pytest.mark.slow  # two fresh interpreters and fork servers at once
def test_two_identical_sweeps_on_one_file_run_each_config_once(tmp_path):
    out = tmp_path / "r.jsonl"
    command = [sys.executable, "-m", "gcbench", "sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1,2,4",
               "--policy", "none,full", *FAST_ARGS, "--out", str(out)]
    sweeps = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in sweeps]
    assert [p.returncode for p in sweeps] == [0, 0], results
    stored = read_records(out)
    assert len(stored) == 6 and len({spec_key(r) for r in stored}) == 6  # 3 batches x 2 policies, each once
    assert len({r["record_id"] for r in stored}) == 6
    assert all(r["status"] == "ok" and "time_ratio" in r for r in stored)
    assert not (tmp_path / ".r.jsonl.claims").exists()  # no claim left behind


@pytest.mark.slow  # a fresh interpreter: an import of torch + transformers
def test_a_run_waiting_for_a_locked_results_file_says_so_and_sigterm_ends_it(tmp_path):
    import fcntl

    out, err = tmp_path / "r.jsonl", tmp_path / "stderr"
    out.write_text("")
    with open(out, "a") as holder, open(err, "w") as stderr:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another gcbench appending, for ever
        proc = subprocess.Popen([sys.executable, "-m", "gcbench", "run", "--model", "tiny-llama", "--seq", "32",
                                 "--batch", "1", *FAST_ARGS, "--out", str(out)], stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True)
        deadline = time.monotonic() + 180
        while "gcbench: waiting for" not in err.read_text():  # measured; now waiting for the lock
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
    said = err.read_text()
    assert proc.returncode == 130, said
    assert f"gcbench: waiting for {out}: locked by process {os.getpid()} (Ctrl-C stops waiting)" in said
    assert f"gcbench: interrupted; nothing was written to {out}" in said and "Traceback" not in said
    assert out.read_text() == ""


@pytest.mark.slow  # a fresh process, so that its fork server starts in the directory under test
def test_a_folder_named_gcbench_in_the_working_directory_is_not_imported_by_the_children(tmp_path):
    """The fork server starts as `python -c`, which would put the working directory first on sys.path."""
    script = Path(sys.executable).parent / "gcbench"  # the installed command: its own directory leads sys.path
    if not script.exists():
        pytest.skip("gcbench is not installed beside this python")
    (tmp_path / "gcbench").mkdir()  # e.g. the parent directory of a clone
    done = subprocess.run([str(script), "sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy",
                           "none", "--steps", "2", "--device", "cpu", "--no-paired", "--out", "s.jsonl"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [record] = read_records(tmp_path / "s.jsonl")
    assert record["status"] == "ok"


def test_a_sweep_starts_its_fork_server_before_it_resolves_its_configs(monkeypatch, tmp_path):
    """The fork server's imports (torch, transformers, the models' code: seconds) run beside the sweep's own
    checks, not after them: the sweep asks for it as soon as its options are read, naming the models to warm."""
    import gcbench.launch.server
    import gcbench.sweeps

    calls = []
    monkeypatch.setattr(gcbench.launch.server, "start", lambda models: calls.append(("server", list(models))))

    class Resolving:
        def __init__(self, grid, **options):
            calls.append(("sweep", None))
            raise gcbench.GcbenchError("stop here")

    monkeypatch.setattr(gcbench.sweeps, "Sweep", Resolving)
    args = ["sweep", "--model", "tiny-llama,tiny-gpt2", "--seq", "32", "--batch", "1", *FAST_ARGS, "--out",
            str(tmp_path / "r.jsonl")]
    assert runner.invoke(app, args).exit_code == 2
    assert calls == [("server", ["tiny-llama", "tiny-gpt2"]), ("sweep", None)]
    calls.clear()
    assert runner.invoke(app, [*args, "--isolation", "none"]).exit_code == 2
    assert calls == [("sweep", None)]  # nothing to fork


def test_children_start_with_the_fork_servers_heap_out_of_the_collectors_sight():
    """A child's gc.collect (every run ends with one) walks only what the child made: the fork server froze what
    it imported (gc.freeze) before forking anyone."""
    import gc

    from gcbench.launch.server import context

    with context(["tiny-llama"]).Pool(1) as pool:
        frozen = pool.apply(gc.get_freeze_count)
    assert frozen > 100_000  # torch, transformers and gcbench: about a million objects


def test_a_switch_that_changes_no_config_takes_one_value(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", "--model", "tiny-llama", "--seq", "32", "--batch", "1", *FAST_ARGS,
                                 "--predict", "on,off", "--dry-run", "--out", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert "--predict takes one value here: it does not change the config, which would be run twice" in result.output


def test_a_finished_line_never_parts_a_number_from_its_unit_at_80_columns():
    from rich.console import Console

    from gcbench.sweeps.progress import _finished_line

    record = {"status": "ok", "model": "tiny-llama", "seq_len": 64, "batch_size": 2, "policy": "full",
              "step_ms_median": 12.34, "peak_tracked_bytes": 9_000_000, "device": "cpu"}
    for extra, lines in (({}, 1), ({"adapter": "lora:r=8", "loss": "chunked"}, 2)):
        console = Console(width=80, record=True)
        console.print(_finished_line({**record, **extra}, (), console.width), highlight=False)
        shown = console.export_text().splitlines()
        assert len(shown) == lines and shown[-1].endswith("12.3 ms/step, peak 8.58 MiB")  # whole, on one line
        assert max(map(len, shown)) <= 80
    # an error too long for the label's line: under it, each of its lines indented (it wrapped at column 0)
    error = "live tensors need 12.12 MiB, 91.71 KiB past the memory cap of 12.00 MiB " * 2
    console = Console(width=80, record=True)
    console.print(_finished_line({**record, "status": "oom", "error": error}, (), 80), highlight=False)
    shown = console.export_text().splitlines()
    assert len(shown) == 3 and all(line.startswith(" " * 8) and line[8] != " " for line in shown[1:])
    assert max(map(len, shown)) <= 80 and "past the memory cap" in shown[1], shown


def test_the_progress_bar_keeps_its_count_and_eta_whole_at_80_columns():
    # the config's label took the line's width first: the bar, its count and the ETA were squeezed out
    import io

    from rich.console import Console

    from gcbench.sweeps.progress import SweepProgress

    console = Console(width=80, force_terminal=True, file=io.StringIO(), color_system=None)
    with SweepProgress(console, 16, 0) as view:
        view.counts.update({"ok": 3, "oom": 1})
        view._bar.update(view._task, advance=4, counts=view._counts_text())
        view._show(0, "tiny-llama seq 64 batch 2 full · lora:r=8 · loss chunked · measuring peaks per phase " * 2)
        shown = Console(width=80, record=True, file=io.StringIO())
        shown.print(view._live.renderable)
    bar, what = shown.export_text().splitlines()[:2]
    assert "4/16" in bar and "eta" in bar and bar.rstrip().endswith("ok 3 · oom 1") and "…" not in bar
    assert what.startswith("  tiny-llama seq 64 batch 2 full") and what.rstrip().endswith("…") and len(what) <= 80


def test_all_five_statuses_wrap_under_themselves_and_leave_the_count_and_eta_whole_at_80_columns():
    # with every status seen the counts took 45 columns: rich cut the count to "1100/12…" and the ETA to "e…"
    import io

    from rich.console import Console

    from gcbench.sweeps.progress import SweepProgress

    console = Console(width=80, force_terminal=True, file=io.StringIO(), color_system=None)
    with SweepProgress(console, 1200, 0) as view:
        view.counts.update({"ok": 1000, "oom": 30, "timeout": 10, "error": 20, "skipped": 40})
        view._bar.update(view._task, advance=1100, counts=view._counts_text())
        shown = Console(width=80, record=True, file=io.StringIO())
        shown.print(view._live.renderable)
    first, second = shown.export_text().splitlines()[:2]
    assert "…" not in first + second and "1100/1200" in first and " eta " in first and "━" in first
    counts = " ".join((first.split("-:--:--")[1] + second).split())
    assert counts == "ok 1000 · oom 30 · timeout 10 · error 20 · skipped 40"
