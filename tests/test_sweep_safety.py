"""Nothing lost, nothing run twice, nothing misleading: records on disk as each config ends, a lock wait that Ctrl-C
ends, sweeps sharing one results file, configs that cannot fit refused or marked as not run.

In this process (--isolation none, tiny models, one step): the subprocess versions (kill -9, two sweeps at once,
SIGTERM) are the slow tests in test_sweep.py.
"""

import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

import gcbench
from gcbench.cli import app
from gcbench.errors import raise_interrupt, signals_held
from gcbench.grid import SweepSpec
from gcbench.launch import failure_record
from gcbench.launch.inline import InProcessRunner
from gcbench.results import store
from gcbench.results.schema import Status, config_key, new_record
from gcbench.results.store import append_record, read_records
from gcbench.sweeps.claims import Claims
from gcbench.sweeps.orchestrate import NOT_YET_PAIRED, _policy_free_key
from tests.helpers import tiny_spec

runner = CliRunner()
FAST = dict(device="cpu", warmup=1, steps=1)
GRID = dict(model="tiny-llama", seq=32, batch=1, policy=["none", "full"], isolation="none", progress=False, **FAST)


def lines(path):
    return [line for line in path.read_text().splitlines() if line.strip()]


class Stopped(BaseException):
    """Stands for kill -9 at the paired timing: nothing after it runs in the sweep (no `except Exception` catches
    it, and the sweep writes nothing more on its way out)."""


def test_each_record_is_on_disk_before_the_paired_timing_and_gets_it_on_its_own_line(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    at_pairing = []
    pair = InProcessRunner.paired
    monkeypatch.setattr(InProcessRunner, "paired",
                        lambda self, *a: at_pairing.append(read_records(out)) or pair(self, *a))
    records = gcbench.sweep(out=out, **GRID)
    [on_disk] = at_pairing
    assert [r["policy"] for r in on_disk] == ["none", "full"]  # both finished configs, before their pairing
    assert all(r["paired_error"] == NOT_YET_PAIRED for r in on_disk)  # and they say what is still to come
    stored = read_records(out)
    assert stored == records and len(lines(out)) == 2  # each rewritten in place: one line per config
    assert [r["record_id"] for r in stored] == [r["record_id"] for r in on_disk]
    assert all("time_ratio" in r and "paired_error" not in r for r in stored)


def test_a_resumed_sweep_runs_no_finished_config_again_and_pairs_what_awaits_it(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"

    def killed(*args):
        raise Stopped

    monkeypatch.setattr(InProcessRunner, "paired", killed)
    with pytest.raises(Stopped):
        gcbench.sweep(out=out, **GRID)
    first = read_records(out)
    assert [(r["policy"], r["paired_error"]) for r in first] == [("none", NOT_YET_PAIRED), ("full", NOT_YET_PAIRED)]
    monkeypatch.undo()
    ran = []
    run = InProcessRunner.__call__
    monkeypatch.setattr(InProcessRunner, "__call__", lambda self, spec, on: ran.append(spec) or run(self, spec, on))
    records = gcbench.sweep(out=out, **GRID)
    assert ran == []  # both were finished: not run again
    assert [r["sweep_id"] for r in records] == [r["sweep_id"] for r in first]
    assert all("time_ratio" in r and "paired_error" not in r for r in records)  # paired now
    assert read_records(out) == records and len(lines(out)) == 2


def test_waiting_for_a_locked_results_file_says_for_what_and_ctrl_c_ends_it(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    out.write_text("")
    holder = open(out, "a")
    fcntl.flock(holder, fcntl.LOCK_EX)  # another writer (a flock conflicts across open files, even in one process)

    class Terminal(io.StringIO):
        def write(self, text):  # the notice: the user reads it, then presses Ctrl-C
            super().write(text)
            os.kill(os.getpid(), signal.SIGINT)
            return len(text)

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(store, "LOCK_NOTICE_S", 0.0)
    give_up = threading.Timer(60, fcntl.flock, (holder, fcntl.LOCK_UN))  # a wait that ignores Ctrl-C: fail, not hang
    # Ctrl-C as a terminal delivers it, whatever handler or mask an earlier test in this worker left behind (the
    # order of tests varies between pytest-xdist workers; one run on a clean clone saw no KeyboardInterrupt)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    give_up.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            append_record(out, {"schema_version": 3})
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    give_up.cancel()
    holder.close()
    said = f"gcbench: waiting for {out}: locked by process {os.getpid()} (Ctrl-C stops waiting)\n"
    assert terminal.getvalue() == said
    assert out.read_text() == ""  # nothing written


def test_a_signal_is_held_through_a_file_change_while_other_threads_run():
    """SIGTERM during a held step (a record's line, a rewrite's rename) is delivered after it, not inside, even with
    other threads running (a sweep's progress display, its workers): the kernel gives a signal the main thread
    masks to another thread, so a held step is a swapped handler, not a mask."""
    other = threading.Thread(target=time.sleep, args=(1.0,), daemon=True)
    other.start()
    steps: list[str] = []
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(20):  # the interpreter checks for signals between these
                    time.sleep(0.005)
                steps.append("whole")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps == ["whole"]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_claims_exclude_each_other_and_die_with_their_sweep(tmp_path):
    out = tmp_path / "r.jsonl"
    mine, other = Claims(out).take("a"), Claims(out).take("b")
    assert mine is not None and other is not None and Claims(out).take("a") is None
    mine.release()
    other.release()
    again = Claims(out).take("a")
    assert again is not None
    again.release()
    # a sweep killed while holding a claim: its claim is free at once, and its file is removed by the next sweep
    code = ("import os, sys; from pathlib import Path; from gcbench.sweeps.claims import Claims; "
            "Claims(Path(sys.argv[1])).take('a'); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    assert Claims(out).take("a") is None
    proc.kill()
    proc.wait()
    folder = Claims(out).folder
    assert len(list(folder.iterdir())) == 1  # left behind by the kill
    Claims(out).clean()
    assert not folder.exists()
    claim = Claims(out).take("a")
    assert claim is not None
    claim.release()
    assert not folder.exists()


def test_a_configuration_claimed_by_another_sweep_is_waited_for_not_run_again(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    options = dict(model="tiny-llama", seq=32, batch=[1, 2], policy="none", isolation="none", **FAST)
    first, second = SweepSpec.load(None, {**options, "out": out}).expand()
    other = Claims(out).take(_policy_free_key(first))  # another sweep is running batch 1

    def the_other_sweep():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out.exists() and "batch_size\": 2" in out.read_text()):
            time.sleep(0.02)
        append_record(out, failure_record(first, Status.SKIPPED, "written by the other sweep"))
        other.release()

    monkeypatch.setattr(store, "LOCK_NOTICE_S", 3600.0)
    thread = threading.Thread(target=the_other_sweep)
    thread.start()
    try:
        records = gcbench.sweep(out=out, progress=False, **options)
    finally:
        thread.join()
    assert records[0]["error"] == "written by the other sweep" and records[1]["status"] == "ok"
    stored = read_records(out)
    assert len(stored) == 2 and {config_key(r) for r in stored} == {config_key(s.as_record()) for s in (first, second)}
    assert not Claims(out).folder.exists()


def test_configs_the_host_cannot_hold_are_marked_not_run_and_not_drawn(tmp_path, monkeypatch):
    from gcbench.report import figures
    from gcbench.results.frame import load, results_frame
    from gcbench.sweeps import orchestrate

    monkeypatch.setattr(orchestrate, "free_without_context", lambda device: 2**30)
    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(out=out, **{**GRID, "model": ["tiny-llama", "llama-7b"], "layers": 2, "policy": "none"})
    tiny, big = records
    assert tiny["status"] == "ok"
    assert big["status"] == "oom" and big["oom_predicted"] and big["oom_limit"] == "free"
    assert big["error"].startswith("not run: llama-7b needs")
    drawn = []
    monkeypatch.setattr(figures, "FIGURES", [("1-peak", "peak", lambda rows, colors: drawn.append(rows) or "-")])
    figures.write_figures(results_frame(load(out)), tmp_path)
    assert list(drawn[0]["model"]) == ["tiny-llama"]  # the one that ran


@pytest.mark.slow  # plans by simulation (~4 s); CI runs it
def test_a_plan_no_mix_of_which_fits_is_refused_by_run(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["run", "--model", "tiny-llama", "--seq", "32", "--batch", "1", "--policy",
                                 "plan:memory=1KiB", "--device", "cpu", "--warmup", "1", "--steps", "1", "--out",
                                 str(out)])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("gcbench: error: no plan fits 1KiB: the smallest predicted peak is ")
    assert line.endswith("MiB (full)")
    assert not out.exists()


@pytest.mark.slow  # plans by simulation in a sweep (~5 s); CI runs it
def test_a_plan_no_mix_of_which_fits_is_recorded_as_not_run_in_a_sweep(tmp_path):
    out = tmp_path / "r.jsonl"
    none, plan = gcbench.sweep(out=out, **{**GRID, "policy": ["none", "plan:memory=1KiB"]})
    assert none["status"] == "ok"
    assert plan["status"] == "oom" and plan["oom_predicted"] and plan["oom_limit"] == "plan"
    assert plan["error"].startswith("not run: no plan fits 1KiB") and "step_ms_median" not in plan


def test_records_of_two_configs_never_replace_each_other_even_with_one_record_id(tmp_path):
    # A record_id is random (uuid4); a file merged by hand could still repeat one: only the same config is a
    # newer version of a record.
    out = tmp_path / "r.jsonl"
    a = {**new_record(tiny_spec().as_record()), "status": "ok", "record_id": "same"}
    b = {**new_record(tiny_spec(seq_len=64).as_record()), "status": "ok", "record_id": "same"}
    append_record(out, a)
    append_record(out, b)
    assert [r["seq_len"] for r in read_records(out)] == [128, 64]


def test_a_writer_stopped_while_waiting_for_the_lock_removes_no_file(tmp_path, monkeypatch):
    # It made the file, then waited for the lock of another writer that opened it meanwhile: the file is that
    # writer's now, and an unlinked file would swallow its record.
    out = tmp_path / "r.jsonl"

    def stopped(fd, path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "lock", stopped)
    with pytest.raises(KeyboardInterrupt):
        append_record(out, {**new_record(tiny_spec().as_record()), "status": "ok"})
    assert out.exists()
    monkeypatch.undo()
    append_record(out, {**new_record(tiny_spec().as_record()), "status": "ok"})
    assert len(read_records(out)) == 1
