"""Beyond one device: a sweep's configs side by side on disjoint CPU cores (--jobs) or one per GPU (--devices, on
fake GPUs here), each config exactly once, resumable after the driver is killed."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError, raise_interrupt
from gcbench.estimators import estimate
from gcbench.grid import SweepSpec
from gcbench.resolved import resolve
from gcbench.results.schema import config_key
from gcbench.results.store import read_records
from gcbench.launch.torchrun import merge_ranks
from gcbench.spec import RunSpec
from gcbench.launch.slurm import job_failure, jobs_path
from gcbench.sweeps.orchestrate import Sweep
from gcbench.launch.slots import Slot, make_slots, run_side_by_side, side_by_side_fields
from tests.fake_cuda import read_log, subprocess_env
from tests.helpers import assert_refused, policy_examples

runner = CliRunner()
NEEDS_TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores and CPU affinity")
FAST = ["--device", "cpu", "--warmup", "1", "--steps", "1"]
GRID = ["--model", "tiny-llama", "--seq", "32", "--batch", "1,2,3,4", "--policy", "none,full"]


@pytest.fixture
def six_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)


def test_jobs_split_the_cores_into_disjoint_sets(six_cores):
    slots = make_slots(["cpu"], None, 4)
    assert [s.cpus for s in slots] == [(0, 1), (2, 3), (4,), (5,)]
    assert [s.name for s in slots] == ["cpus 0-1", "cpus 2-3", "cpu 4", "cpu 5"]
    assert make_slots(["cpu"], None, 1) == make_slots(["cpu"], None, None) == [Slot("here")]


@pytest.mark.parametrize("kinds, devices, jobs, message", [
    (["cpu"], None, 7, r"only 6 CPU core\(s\)"),
    (["cuda:0"], None, 2, "for GPUs use --devices"),
    (["cpu"], ("all",), None, "on CPU use --jobs"),
    (["cuda:0"], ("all",), 2, "give one"),
])
def test_slots_that_cannot_work_are_refused(six_cores, kinds, devices, jobs, message):
    with pytest.raises(GcbenchError, match=message):
        make_slots(kinds, devices, jobs)


def test_gpu_slots_follow_this_process_cuda_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    slots = make_slots(["cuda:0"], ("cuda:1", "cuda:2"), None)
    assert [(s.name, s.cuda_visible) for s in slots] == [("cuda:1", "6"), ("cuda:2", "7")]
    assert [s.cuda_visible for s in make_slots(["cuda:0"], ("all",), None)] == ["4", "6", "7"]
    with pytest.raises(GcbenchError, match="only 3 CUDA device"):
        make_slots(["cuda:0"], ("cuda:3",), None)


def test_each_item_runs_once_across_the_workers():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(slot):
        def work(item):
            time.sleep(0.001 * (item % 3))
            with lock:
                seen.append((slot, item))
        return work

    run_side_by_side(range(50), [worker(s) for s in range(3)], threading.Event())
    assert sorted(item for _, item in seen) == list(range(50))
    assert len({slot for slot, _ in seen}) > 1


def test_a_worker_error_stops_the_others_and_is_raised():
    cancel = threading.Event()
    done: list[int] = []

    def failing(item):
        raise GcbenchError("cannot write results: the disk is full")

    def slow(item):
        while not cancel.is_set():
            time.sleep(0.01)
        done.append(item)
        raise KeyboardInterrupt  # what a runner does when cancelled

    with pytest.raises(GcbenchError, match="disk is full"):
        run_side_by_side(range(4), [slow, failing], cancel)
    assert cancel.is_set() and len(done) == 1


def test_an_interrupted_wait_returns_only_after_every_worker_has_stopped(monkeypatch):
    """SIGTERM (made a KeyboardInterrupt, as gcbench's handler does) lands while the main thread starts or waits for
    two workers that are still running: it returns only once both stopped. A wait by Thread.join marked the running
    worker as ended on Python 3.11 (CPython gh-90882), and a signal between two starts left the second unwaited: the
    sweep exited under a worker, killing its child, recorded as an error."""
    cancel, stopped = threading.Event(), []
    interrupted = threading.Event()

    def worker(slot):
        def run(item):
            while not cancel.is_set():
                if slot == 0 and not interrupted.is_set():
                    interrupted.set()
                    os.kill(os.getpid(), signal.SIGTERM)  # while the main thread starts or waits
                time.sleep(0.01)
            time.sleep(0.2)  # stopping its child takes a moment; the main thread must still be waiting
            stopped.append(slot)
            raise KeyboardInterrupt
        return run

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_side_by_side(range(4), [worker(0), worker(1)], cancel)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(stopped) == [0, 1]


def test_cpu_records_side_by_side_say_their_time_is_not_comparable():
    slot = Slot("cpu 1", cpus=(1,))
    ok = side_by_side_fields({"status": "ok", "timing_notes": ["few steps"]}, slot, 2)
    assert ok["device_slot"] == "cpu 1" and ok["parallel_jobs"] == 2 and ok["timing_stable"] is False
    assert ok["timing_notes"][0] == "few steps" and "not comparable" in ok["timing_notes"][1]
    gpu = side_by_side_fields({"status": "ok"}, Slot("cuda:1", cuda_visible="1"), 2)
    assert gpu == {"device_slot": "cuda:1", "parallel_jobs": 2}  # a GPU of its own: its time stands


def test_jobs_give_each_config_its_slot_cores_as_threads(six_cores, tmp_path):
    grid = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "device": "cpu", "jobs": 3,
                                 "out": tmp_path / "r.jsonl"})
    assert {spec.threads for spec in Sweep(grid).specs} == {2}
    over = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "device": "cpu", "jobs": 3,
                                 "threads": 4, "out": tmp_path / "r.jsonl"})
    with pytest.raises(GcbenchError, match="--threads 4 is more than the 2 core"):
        Sweep(over)


def test_a_toml_list_of_devices_refuses_an_empty_item_as_the_comma_list_does(tmp_path):
    # ["cuda:0", ""] ran on cuda:0 alone: the empty string was dropped where "cuda:0," is refused
    with pytest.raises(GcbenchError, match=r"an empty item in \['cuda:0', ''\]"):
        SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "device": "cuda", "devices": ["cuda:0", ""],
                              "out": tmp_path / "r.jsonl"})


@pytest.mark.parametrize("args, message", [
    (["--jobs", "0"], "--jobs: must be an integer from 1"),
    (["--devices", "gpu1"], "--devices: expected all or a list of cuda:N"),
    (["--devices", "cuda:0,cuda:0"], "--devices: a GPU given twice"),
    (["--devices", "all"], "--devices spreads a sweep over GPUs"),
    (["--jobs", "2", "--isolation", "none"], "cannot run configs side by side"),
])
def test_bad_side_by_side_options_are_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", *GRID, *FAST, "--out", str(out), *args])
    assert_refused(result, message)
    assert not out.exists()


def _sweep(out: Path, *args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gcbench", "sweep", *GRID, *FAST, "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _jobs_2_with_a_configuration_written(out: Path) -> subprocess.Popen:
    """A `--jobs 2` sweep of GRID, once one configuration (its two policies) is in `out`."""
    proc = _sweep(out, "--jobs", "2")
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


@pytest.mark.slow  # two children at a time on the CI's two cores, and a driver killed and run again
@NEEDS_TWO_CORES
def test_jobs_2_runs_every_config_once_and_resumes_after_the_driver_is_killed(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = _jobs_2_with_a_configuration_written(out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    before = read_records(out)
    assert 2 <= len(before) < 8

    finished = _sweep(out, "--jobs", "2")
    stdout, stderr = finished.communicate(timeout=300)
    assert finished.returncode == 0, stderr
    stored = read_records(out)
    assert len(stored) == 8 and len({config_key(r) for r in stored}) == 8  # every config exactly once
    # The finished configs were not run again (those awaiting their paired timing get it, nothing else changes).
    assert [(r["record_id"], r["step_ms"]) for r in stored[:len(before)]] == [(r["record_id"], r["step_ms"])
                                                                               for r in before]
    assert all(r["status"] == "ok" for r in stored)
    resumed = [r for r in stored if r["sweep_id"] != before[0]["sweep_id"]]
    assert {r["device_slot"] for r in stored} <= {"cpu 0", "cpu 1"}
    assert {r["threads"] for r in stored} == {1} and {r["parallel_jobs"] for r in stored} == {2}
    assert all("not comparable" in r["timing_notes"][-1] for r in resumed)
    assert "not comparable" in stderr  # the warning as the sweep starts


@pytest.mark.slow  # a fresh interpreter with the fake GPUs installed in every process
def test_devices_all_runs_one_config_per_gpu_each_child_seeing_one(tmp_path):
    out, log = tmp_path / "r.jsonl", tmp_path / "cuda.log"
    args = [a if a != "cpu" else "cuda" for a in FAST]
    proc = subprocess.run([sys.executable, "-m", "gcbench", "sweep", *GRID, *args, "--devices", "all", "--out",
                           str(out)], env=subprocess_env(log, devices=2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = read_records(out)
    assert len(records) == 8 and len({config_key(r) for r in records}) == 8
    assert {r["device"] for r in records} == {"cuda:0"}  # each child's only GPU: the identity does not depend on it
    assert {r["device_slot"] for r in records} == {"cuda:0", "cuda:1"}
    inits = [c for c in read_log(log) if c.name == "cuda_init"]
    assert {c.args for c in inits} == {("0",), ("1",)}  # every child saw exactly one GPU, both GPUs were used
    # One initialisation per child (8 configs, 4 paired timings), none in the driver: it must hold no GPU memory.
    assert len(inits) == len({c.pid for c in inits}) == 12
    assert json.loads(out.read_text().splitlines()[0])["env"]["gpu_name"]


# ------------------------------------------------------------------------------------------ jobs through submitit

CLUSTER_GRID = ["--model", "tiny-llama", "--seq", "32", "--batch", "1,2", "--policy", "none,full", *FAST,
                "--memory-cap", "5.5MiB"]  # batch 2 without checkpointing runs out of it (tests/test_sweep.py)


@pytest.mark.parametrize("state, status", [("TIMEOUT", "timeout"), ("OUT_OF_MEMORY", "oom"), ("FAILED", "error"),
                                           ("CANCELLED by 1234", "error"), ("NODE_FAIL", "error")])
def test_a_job_slurm_ended_is_recorded_by_its_state(state, status):
    got, why = job_failure(state, "77_3", RuntimeError("Job 77_3 failed\nlast line of its stderr"))
    assert got == status and "77_3" in why and state.split()[0] in why


@pytest.mark.parametrize("args, message", [
    (["--slurm-partition", "gpu"], "--slurm-partition is for --executor slurm"),
    (["--executor", "local", "--jobs", "2"], "--devices, --jobs and --isolation none do not apply"),
    (["--executor", "pbs"], "--executor: unknown executor 'pbs' (slurm, local)"),
])
def test_bad_executor_options_are_one_line_exit_2(tmp_path, args, message):
    result = runner.invoke(app, ["sweep", *CLUSTER_GRID, "--out", str(tmp_path / "r.jsonl"), *args])
    assert_refused(result, message)
    assert not list(tmp_path.iterdir())


def test_a_slurm_driver_plans_cuda_configs_without_a_gpu_of_its_own(tmp_path):
    """The driver runs on a login node: --device cuda is checked for its form only, and auto is refused."""
    grid = [a if a != "cpu" else "cuda" for a in CLUSTER_GRID]
    result = runner.invoke(app, ["sweep", *grid, "--executor", "slurm", "--slurm-partition", "gpu", "--out",
                                 str(tmp_path / "r.jsonl"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "slurm jobs" in result.stdout and "device cuda" in result.stdout
    auto = [a if a != "cpu" else "auto" for a in CLUSTER_GRID]
    refused = runner.invoke(app, ["sweep", *auto, "--executor", "slurm", "--out", str(tmp_path / "r.jsonl")])
    assert refused.exit_code == 2 and "give --device cuda or --device cpu" in refused.stderr


def test_without_submitit_the_executor_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit raises ImportError
    result = runner.invoke(app, ["sweep", *CLUSTER_GRID, "--executor", "local", "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2 and "pip install 'gcbench[slurm]'" in result.stderr
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow  # each job is a fresh interpreter importing torch and transformers
def test_local_executor_runs_the_grid_into_one_file_with_its_oom(tmp_path):
    pytest.importorskip("submitit")
    out = tmp_path / "r.jsonl"
    result = subprocess.run([sys.executable, "-m", "gcbench", "sweep", *CLUSTER_GRID, "--executor", "local",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    got = {(r["batch_size"], r["policy"]): r["status"] for r in records}
    assert got == {(1, "none"): "ok", (1, "full"): "ok", (2, "none"): "oom", (2, "full"): "ok"}
    assert len({r["job_id"] for r in records}) == 2 and {r["executor"] for r in records} == {"local"}
    assert len({r["sweep_id"] for r in records}) == 1  # the driver's sweep, not each job's
    # Measured by the job's children, then paired (batch 1: both policies ran; the jobs finish in any order).
    by = {(r["batch_size"], r["policy"]): r for r in records}
    assert all(r["env"] for r in records) and "time_ratio" in by[1, "full"] and "time_ratio" not in by[2, "full"]
    assert not jobs_path(out).exists()  # every job collected

    again = subprocess.run([sys.executable, "-m", "gcbench", "sweep", *CLUSTER_GRID, "--executor", "local",
                            "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and read_records(out) == records  # resumed: nothing submitted, nothing added


@pytest.mark.slow  # jobs that outlive their driver, then a second driver collecting them
def test_a_killed_driver_collects_its_jobs_instead_of_submitting_again(tmp_path):
    pytest.importorskip("submitit")
    out = tmp_path / "r.jsonl"
    driver = _cluster_driver(out)
    deadline = time.monotonic() + 120
    while not jobs_path(out).exists():
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.05)
    submitted = {j["job_id"] for j in json.loads(jobs_path(out).read_text())["jobs"].values()}
    driver.send_signal(signal.SIGKILL)
    driver.communicate()

    again = _cluster_driver(out)
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    records = read_records(out)
    assert len(records) == 4 and len({config_key(r) for r in records}) == 4  # every config exactly once
    assert {r["job_id"] for r in records} <= submitted  # collected from the first driver's jobs, none new


def _cluster_driver(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gcbench", "sweep", *CLUSTER_GRID, "--executor", "local",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------------------------------ sharded runs (FSDP2)

SHARDED = ["--model", "tiny-llama", "--seq", "64", "--batch", "2", *FAST, "--warmup", "1", "--steps", "2"]


@pytest.mark.parametrize("fields, message", [
    (dict(nproc=2), "--nproc 2 needs --shard fsdp2"),
    (dict(shard="zero3", nproc=2), "unknown shard 'zero3'"),
    (dict(shard="fsdp2", policy="budget"), "compiles the blocks"),
    (dict(shard="fsdp2", optim_in_backward=True), "not with --shard fsdp2"),
])
def test_sharded_specs_that_cannot_run_are_refused(fields, message):
    with pytest.raises(GcbenchError, match=message):
        resolve(RunSpec(**{"model": "tiny-llama", "seq_len": 32, "batch_size": 1, "device": "cpu", **fields}))


def test_a_grid_crossing_shard_and_nproc_leaves_out_unsharded_ranks(tmp_path):
    grid = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "policy": "none", "device": "cpu",
                                 "shard": "none,fsdp2", "nproc": "1,2", "out": tmp_path / "r.jsonl"})
    assert [(s.shard, s.nproc) for s in grid.expand()] == [("none", 1), ("fsdp2", 1), ("fsdp2", 2)]
    assert "--nproc above 1 is a sharded run" in grid.left_out()


def _rank(rank: int, peak: int, param: int, step_ms: list[float], status: str = "ok", **extra) -> dict:
    return {"rank": rank, "status": status, "error": None, "peak_tracked_bytes": peak, "param_bytes": param,
            "grad_bytes": param, "optimizer_bytes": 2 * param, "step_ms": step_ms, "steps_stop": "fixed",
            "timing_stable": True, "timing_notes": [], "device": "cpu", **extra}


def test_ranks_merge_into_one_record_with_each_rank_and_the_slowest_step():
    spec = RunSpec(model="tiny-llama", seq_len=64, batch_size=2, device="cpu", shard="fsdp2", nproc=2)
    merged = merge_ranks(spec, [_rank(0, 100, 10, [5.0, 9.0, 7.0]), _rank(1, 120, 11, [6.0, 8.0, 7.5])])
    assert merged["world_size"] == 2 and merged["status"] == "ok" and "rank" not in merged
    assert merged["peak_tracked_bytes"] == 120 and merged["rank_peak_tracked_bytes"] == [100, 120]
    assert merged["param_bytes"] == 11 and merged["rank_param_bytes"] == [10, 11]
    assert merged["step_ms"] == [6.0, 9.0, 7.5] and merged["step_ms_median"] == 7.5
    assert merged["tokens_per_s"] == pytest.approx(2 * 2 * 64 / 7.5e-3)  # every rank's tokens
    assert merged["timing_stable"] is False and "gloo" in merged["timing_notes"][-1]  # CPU ranks: never trusted
    # each rank's own notes under its rank: three spreads without one read as the run's own, disagreeing
    spread = {"timing_notes": ["step times spread 24% of the median (IQR), above 10%"], "timing_stable": False,
              "timing_note_kinds": ["spread"]}
    noted = merge_ranks(spec, [_rank(0, 100, 10, [5.0, 9.0, 7.0], **spread), _rank(1, 120, 11, [6.0, 8.0, 7.5],
                                                                                   **spread)])
    assert noted["timing_notes"][:2] == [f"rank {k}: step times spread 24% of the median (IQR), above 10%"
                                         for k in (0, 1)]
    oom = merge_ranks(spec, [_rank(0, 100, 10, []), _rank(1, 130, 10, [], "oom", error="live tensors need ...")])
    assert oom["status"] == "oom" and oom["error"] == "rank 1: live tensors need ..."
    assert "step_ms_median" not in oom and "tokens_per_s" not in oom  # rank 0's alone: not the run's
    assert oom["rank_peak_tracked_bytes"] == [100, 130]
    lost = merge_ranks(spec, [_rank(0, 100, 10, [5.0])])
    assert lost["status"] == "error" and "only 1 of 2 ranks" in lost["error"]


@pytest.mark.slow  # about 6 s: keeps the default suite under 5 minutes (CI runs the slow set)
def test_the_per_rank_estimate_shards_model_state_and_adds_fsdp_terms():
    one = resolve(RunSpec(model="tiny-llama", seq_len=64, batch_size=2, device="cpu", shard="fsdp2", nproc=1))
    unsharded = estimate(one.replace(shard="none"), "simulate", "cpu")
    ranks = {n: estimate(one.replace(nproc=n), "simulate", "cpu") for n in (1, 2, 4)}
    # the simulation runs FSDP2 itself: each shard is 1/N, padded where a dimension does not divide by N (32 B here)
    assert 0 <= ranks[2].param_bytes - unsharded.param_bytes / 2 <= 64
    assert 0 <= ranks[4].optimizer_bytes - unsharded.optimizer_bytes / 4 <= 256
    modelled = estimate(one.replace(nproc=4), "analytic", "cpu")  # the per-rank model: 1/N, unpadded
    assert modelled.optimizer_bytes == pytest.approx(estimate(one.replace(shard="none"), "analytic", "cpu")
                                                     .optimizer_bytes / 4, abs=1)
    # At one rank FSDP only adds (its gathered copies): never less than the unsharded step.
    assert ranks[1].backward_peak_bytes > unsharded.backward_peak_bytes
    assert ranks[1].peak_bytes > ranks[2].peak_bytes > ranks[4].peak_bytes


@pytest.mark.slow  # torchrun: a fresh interpreter per rank
def test_every_policy_gives_the_unsharded_gradients_under_fsdp2(tmp_path):
    out = tmp_path / "grads.json"
    policies = [p for p in policy_examples() if not resolve(RunSpec(model="tiny-llama", seq_len=8, batch_size=1,
                                                                    device="cpu", policy=p)).policy.compiles]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tests.sharded_grads", str(out), *policies], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"none without dropout, vs one process over all rows", *policies}
    assert {k: v for k, v in results.items() if v != "ok"} == {}


@pytest.mark.slow  # torchrun: a fresh interpreter per rank, three sharded configs
def test_a_sweep_over_nproc_gives_per_rank_state_of_about_half(tmp_path):
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", *SHARDED, "--policy", "full", "--shard", "none,fsdp2", "--nproc", "1,2",
                                 "--predict", "on", "--out", str(out)])
    assert result.exit_code == 0, result.output
    by = {(r["shard"], r["nproc"]): r for r in read_records(out)}
    assert set(by) == {("none", 1), ("fsdp2", 1), ("fsdp2", 2)} and all(r["status"] == "ok" for r in by.values())
    one, two = by["fsdp2", 1], by["fsdp2", 2]
    assert two["world_size"] == 2 and len(two["rank_peak_tracked_bytes"]) == 2
    for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert two[name] == pytest.approx(one[name] / 2, rel=0.01)  # 1/N, but for FSDP2's padding
        assert all(v == pytest.approx(one[name] / 2, rel=0.01) for v in two[f"rank_{name}"])
    assert one["param_bytes"] == by["none", 1]["param_bytes"]  # one rank holds everything
    for r in (one, two):  # the per-rank prediction against the rank that peaked (exact on CPU: within 10%)
        assert r["predicted_peak_bytes"] == pytest.approx(r["peak_tracked_bytes"], rel=0.10)
    assert two["tokens_per_s"] > 0 and "gloo" in two["timing_notes"][-1]


def test_a_rank_runs_on_its_own_gpu_and_checks_only_the_launcher_count(monkeypatch):
    import torch

    from gcbench.launch.rank import rank_device

    assert rank_device("cuda:2", 1) == torch.device("cuda", 3) and rank_device("cpu", 1) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fields = dict(model="tiny-llama", seq_len=32, batch_size=1, shard="fsdp2", nproc=2, precision="fp32")
    resolve(RunSpec(device="cuda:0", **fields))  # the launcher: 2 ranks from cuda:0 on 2 GPUs
    with pytest.raises(GcbenchError, match="needs a GPU per rank from cuda:1: 2 here"):
        resolve(RunSpec(device="cuda:1", **fields))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # inside rank 1: its own GPU
    assert resolve(RunSpec(device="cuda:1", **fields)).device == "cuda:1"


@pytest.mark.parametrize("args", [["--jobs", "2"], ["--devices", "all", "--device", "cuda"]])
def test_a_sweep_refuses_sharded_runs_side_by_side(tmp_path, monkeypatch, args):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["sweep", *SHARDED, "--shard", "fsdp2", "--nproc", "2", "--precision", "fp32",
                                 "--out", str(out), *args])
    assert result.exit_code == 2 and "run it without --devices or --jobs" in result.stderr, result.output
    assert not out.exists()


def test_a_cluster_job_killed_for_host_memory_is_run_again_by_retry_failed(tmp_path):
    grid = SweepSpec.load(None, {"model": "tiny-llama", "seq": 32, "batch": 1, "policy": "none", "device": "cpu",
                                 "out": tmp_path / "r.jsonl"})
    host_oom = {"status": "oom", "oom_limit": "host"}
    assert Sweep(grid)._counts_as_done(host_oom) and not Sweep(grid, retry_failed=True)._counts_as_done(host_oom)
    assert Sweep(grid, retry_failed=True)._counts_as_done({"status": "oom"})  # a measured oom is a result


@pytest.mark.slow  # two children at a time, then SIGTERM to the driver
@NEEDS_TWO_CORES
def test_sigterm_stops_every_slot_and_keeps_only_whole_records(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = _jobs_2_with_a_configuration_written(out)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr
    records = read_records(out)
    assert 2 <= len(records) < 8 and all(r["status"] == "ok" for r in records)
    assert len({config_key(r) for r in records}) == len(records)
