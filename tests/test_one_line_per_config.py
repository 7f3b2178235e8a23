"""A results file holds each config once, however the command that wrote it ended: read line by line with plain
json, with pandas.read_json(lines=True) and with jq, it says what gcbench.load says.

In this process (--isolation none, tiny models, one step); the subprocess kill -9 is test_sweep.py's.
"""

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pandas as pd
import pytest

import gcbench
from gcbench.errors import DeadlineReached
from gcbench.fits.fit import Fit, FitSpec
from gcbench.grid import SweepSpec
from gcbench.launch.inline import InProcessRunner
from gcbench.launch import failure_record
from gcbench.results import rewrite, store
from gcbench.results.rewrite import compact_records, replace_record
from gcbench.results.schema import ADDED_SPEC_FIELDS, SCHEMA_VERSION, config_key, new_record
from gcbench.results.store import append_record, read_records, records_after
from gcbench.sweeps.orchestrate import NOT_YET_PAIRED, Sweep
from tests.helpers import tiny_spec

FAST = dict(device="cpu", warmup=1, steps=1)
FIT_FAST = dict(warmup_steps=1, measure_steps=1)
# 2 seq x 2 batch x 2 policies: 8 configs, 4 paired timings
GRID = dict(model="tiny-llama", seq=[16, 32], batch=[1, 2], policy=["none", "full"], isolation="none",
            progress=False, **FAST)


def read_plainly(path):
    """The file as the ecosystem's tools read it: every line a record."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    frame = pd.read_json(path, lines=True)
    assert len(frame) == len(lines)
    if shutil.which("jq"):
        count = subprocess.run(["jq", "-s", "length", str(path)], capture_output=True, text=True, check=True)
        assert int(count.stdout) == len(lines)
    return lines


def assert_each_config_once(path, configs):
    lines = read_plainly(path)
    assert len(lines) == configs
    assert len({config_key(r) for r in lines}) == configs and len({r["record_id"] for r in lines}) == configs
    assert len(gcbench.load(path)) == configs
    assert [r["record_id"] for r in read_records(path)] == [r["record_id"] for r in lines]


def test_a_finished_sweep_and_its_resumption_hold_each_config_on_one_line(tmp_path):
    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(out=out, **GRID)
    assert_each_config_once(out, 8)
    lines = read_plainly(out)
    assert lines == json.loads(json.dumps(records, default=str))  # each line is the record, paired timing in it
    assert all("time_ratio" in r and "paired_error" not in r for r in lines)
    before = out.read_bytes()
    gcbench.sweep(out=out, **GRID)  # resumed: nothing to run, nothing written
    assert out.read_bytes() == before


def test_a_sweep_stopped_by_ctrl_c_and_resumed_holds_each_config_once(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    calls = []
    run = InProcessRunner.__call__

    def interrupted(self, spec, on):
        calls.append(spec)
        if len(calls) == 4:  # seq 16 batch 2's second policy: its first has run, its pairing never comes
            raise KeyboardInterrupt
        return run(self, spec, on)

    monkeypatch.setattr(InProcessRunner, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gcbench.sweep(out=out, **GRID)
    assert_each_config_once(out, 3)
    assert [r.get("paired_error") for r in read_plainly(out)] == [None, None, NOT_YET_PAIRED]
    monkeypatch.undo()
    gcbench.sweep(out=out, **GRID)
    assert_each_config_once(out, 8)
    assert all("time_ratio" in r for r in read_plainly(out))


def test_a_sweep_stopped_at_its_deadline_holds_each_config_once(tmp_path):
    out = tmp_path / "r.jsonl"
    grid = SweepSpec.load(None, {**{k: v for k, v in GRID.items() if k != "progress"}, "out": out})
    asked = []

    def stop_before(specs):
        asked.append(specs)
        return len(specs) > 1 and len(asked) > 4  # the second paired timing is one too many

    with pytest.raises(DeadlineReached):
        Sweep(grid, stop_before=stop_before).run()
    assert_each_config_once(out, 4)
    errors = [r.get("paired_error") for r in read_plainly(out)]
    assert errors[:2] == [None, None] and all("deadline" in e for e in errors[2:])


def test_an_oom_sweep_under_a_memory_cap_writes_one_line_per_config(tmp_path):
    out = tmp_path / "r.jsonl"
    records = gcbench.sweep(out=out, memory_cap="1MiB", **GRID)
    assert {r["status"] for r in records} == {"oom"}
    assert_each_config_once(out, 8)


def test_a_config_run_again_takes_its_earlier_records_line(tmp_path):
    out = tmp_path / "r.jsonl"
    first = gcbench.sweep(out=out, **{**GRID, "seq": 16, "batch": 1})
    again = gcbench.sweep(out=out, rerun=True, **{**GRID, "seq": 16, "batch": 1})
    assert_each_config_once(out, 2)
    assert [r["record_id"] for r in again] == [r["record_id"] for r in first]  # a newer version of each
    assert [r["sweep_id"] for r in read_plainly(out)] == [again[0]["sweep_id"]] * 2


def test_every_record_has_a_record_id_fit_trials_and_runs_included(tmp_path):
    spec = FitSpec({"model": "tiny-llama", "seq_len": 64, "device": "cpu", **FIT_FAST}, ("none",), "batch_size",
                   1, 4, memory=12 * 2**20, out=tmp_path / "fit.jsonl", isolation="none", paired=False)
    Fit(spec).run()
    trials = read_plainly(spec.out)
    assert trials and all(isinstance(r["record_id"], str) and len(r["record_id"]) == 32 for r in trials)
    assert len({r["record_id"] for r in trials}) == len(trials)
    assert new_record({})["record_id"] != new_record({})["record_id"]  # run's record is made by new_record too


def versions(rid="a", seq_len=128, **fields):
    return {**new_record(tiny_spec(seq_len=seq_len).as_record()), "record_id": rid, **fields}


def test_replacing_a_record_rewrites_its_line_atomically_keeping_the_files_mode(tmp_path):
    out = tmp_path / "r.jsonl"
    for record in (versions("a"), versions("b", 64), versions("c", 32)):
        append_record(out, record)
    os.chmod(out, 0o640)
    inode = os.stat(out).st_ino
    replace_record(out, versions("b", 64, time_ratio=1.25))
    lines = read_plainly(out)
    assert [(r["record_id"], r.get("time_ratio")) for r in lines] == [("a", None), ("b", 1.25), ("c", None)]
    assert os.stat(out).st_ino != inode and os.stat(out).st_mode & 0o777 == 0o640  # renamed over, same mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]  # no temporary file left
    replace_record(out, versions("d", 16))  # not in the file: appended
    assert [r["record_id"] for r in read_plainly(out)] == ["a", "b", "c", "d"]


def test_a_results_file_behind_a_link_is_rewritten_where_it_is(tmp_path):
    real = tmp_path / "kept" / "r.jsonl"
    real.parent.mkdir()
    link = tmp_path / "r.jsonl"
    link.symlink_to(real)
    append_record(link, versions("a"))
    replace_record(link, versions("a", time_ratio=1.2))
    assert link.is_symlink() and [r.get("time_ratio") for r in read_plainly(real)] == [1.2]


def test_a_writer_that_waited_for_the_lock_of_a_replaced_file_writes_to_the_new_one(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    append_record(out, versions("a"))
    os.link(out, tmp_path / "another-name")  # the old file keeps a link after the rename: no st_nlink test
    lock, raced = store.lock, []

    def lock_after_a_rewrite(fd, path, *args, **kwargs):
        if not raced:  # while this writer waits, another replaces the file (the rewrite takes the real lock)
            raced.append(True)
            monkeypatch.setattr(store, "lock", lock)
            replace_record(out, versions("a", time_ratio=1.5))
        return lock(fd, path, *args, **kwargs)

    monkeypatch.setattr(store, "lock", lock_after_a_rewrite)
    append_record(out, versions("b", 64))
    assert [(r["record_id"], r.get("time_ratio")) for r in read_plainly(out)] == [("a", 1.5), ("b", None)]


def test_the_next_writer_compacts_what_a_killed_writer_left(tmp_path):
    out = tmp_path / "r.jsonl"
    for record in (versions("a"), versions("b", 64), versions("a", time_ratio=1.1), versions("b", 64, x=1)):
        append_record(out, record)
    other_config = versions("a", 32)  # the same id on another config is another record: kept (a merged file)
    append_record(out, other_config)
    with open(out, "ab") as f:
        f.write(b'{"schema_version": 5, "mod')  # a writer killed mid-line
    assert compact_records(out) == 2
    lines = read_plainly(out)
    assert [(r["seq_len"], r.get("time_ratio"), r.get("x")) for r in lines] == [(128, 1.1, None), (64, None, 1),
                                                                                 (32, None, None)]
    before = out.read_bytes()
    assert compact_records(out) == 0 and out.read_bytes() == before  # nothing to do: the file is not touched


def test_another_sweep_sees_a_record_rewritten_in_place(tmp_path):
    """A sweep reads what others wrote by line: a config run again elsewhere keeps its record's id, and its new
    version is new to a sweep that saw the old one (else it would run the config a second time)."""
    out = tmp_path / "r.jsonl"
    append_record(out, versions("a", status="error"))
    seen = set()
    assert [r["status"] for r in records_after(out, seen)] == ["error"] and records_after(out, seen) == []
    replace_record(out, versions("a", status="ok"))
    assert [r["status"] for r in records_after(out, seen)] == ["ok"]


def test_an_older_schemas_line_is_replaced_by_its_newer_version(tmp_path):
    out = tmp_path / "r.jsonl"
    old = {k: v for k, v in versions("a").items() if k not in ADDED_SPEC_FIELDS} | {"schema_version": 4}
    out.write_text(json.dumps(old) + "\n")
    replace_record(out, versions("a", time_ratio=1.3))
    assert [(r["schema_version"], r["time_ratio"]) for r in read_plainly(out)] == [(SCHEMA_VERSION, 1.3)]
    out.write_text(json.dumps(old) + "\n" + json.dumps(versions("a", time_ratio=1.3)) + "\n")
    assert compact_records(out) == 1 and len(read_plainly(out)) == 1


def test_a_folder_that_takes_no_new_file_gets_the_newer_version_appended(tmp_path, monkeypatch):
    """A read-only or sticky folder of another user's: the rename cannot happen, the measurement is not lost."""
    out = tmp_path / "r.jsonl"
    append_record(out, versions("a"))

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rewrite.tempfile, "mkstemp", refused)
    replace_record(out, versions("a", time_ratio=1.4))
    assert [r.get("time_ratio") for r in read_plainly(out)] == [None, 1.4]
    assert [r["time_ratio"] for r in read_records(out)] == [1.4]


def test_a_rewrite_removes_what_a_killed_rewrite_left_and_archives_leave_hidden_files_out(tmp_path):
    from gcbench.validate.execute import archive

    folder = tmp_path / "results" / "gpu" / "nvidia-h200"
    folder.mkdir(parents=True)
    out = folder / "r.jsonl"
    append_record(out, versions("a"))
    stale = folder / ".r.jsonl.k1ll3d.rewrite"
    stale.write_text("half")
    packed = archive(folder, tmp_path / "out", "summary")
    with tarfile.open(packed) as tar:
        assert [Path(name).name for name in tar.getnames()] == ["r.jsonl"]
    replace_record(out, versions("a", time_ratio=1.1))
    assert not stale.exists() and sorted(p.name for p in folder.iterdir()) == ["r.jsonl"]


def test_a_config_run_again_never_puts_a_failure_over_an_ok_record(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    one = {**GRID, "seq": 16, "batch": 1, "policy": "none"}
    [first] = gcbench.sweep(out=out, **one)

    def failing(self, spec, on):
        return failure_record(spec, "error", "RuntimeError: a transient failure")

    monkeypatch.setattr(InProcessRunner, "__call__", failing)
    [again] = gcbench.sweep(out=out, rerun=True, **one)
    assert again["record_id"] != first["record_id"]  # a line of its own: the ok measurement stays
    assert [r["status"] for r in read_plainly(out)] == ["ok", "error"]
