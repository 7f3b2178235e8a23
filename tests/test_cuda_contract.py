"""The CUDA branch, driven without a GPU: torch.cuda reports one fake H100 (tests/fake_cuda.py) while torch's own
argument checks stay real. What is checked is the protocol (the order of calls, an explicit device in every call,
the memory cap set and lifted, no first error replaced by a later one) and the CUDA record's fields; the numbers
themselves come from a model of the caching allocator, not from a GPU."""

import contextlib
import functools
import json
import os
import re
import subprocess
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from gcbench.cli import app
from gcbench.errors import GcbenchError
from gcbench.instruments import CudaInstrument
from gcbench.timing import StepBudget
from gcbench.results.store import read_records
from gcbench.resolved import ResolvedRun, resolve, resolve_device
from gcbench.spec import RunSpec
from gcbench.runner import run
from tests.fake_cuda import DEVICE_ARG_POSITION, REPO_ROOT, is_explicit_device, read_log, subprocess_env

MiB = 2**20
FAKE_GPU = "NVIDIA H100 80GB HBM3"
# The timed steps, as DESIGN.md orders them: back to back, an event at each boundary, no synchronize and no
# memory-statistics call between them. Before them: synchronize, the allocator's retries, the start event, the first
# timed step's end event. Then per timed step: the next step's end event (none after a fixed count's last), a wait
# on the event before it (not on the device), the step's elapsed time. After them: the retries again.
TIMED = ["synchronize", "memory_stats", "Event.record", "Event.record"]
STEP = ["Event.record", "Event.synchronize", "Event.elapsed_time"]
# Then a memory step of its own: synchronize, reset peaks, baseline; per phase a reset as it starts (the reserved
# peak read before each reset) and its peak read as it ends; synchronize; the last reserved peak.
MEMORY_STEP = ["synchronize", "reset_peak_memory_stats", "memory_allocated",
               "max_memory_reserved", "reset_peak_memory_stats", "max_memory_allocated",
               "max_memory_reserved", "reset_peak_memory_stats", "max_memory_allocated",
               "max_memory_reserved", "reset_peak_memory_stats", "max_memory_allocated",
               "synchronize", "max_memory_reserved"]
PROTOCOL = set(TIMED + STEP + MEMORY_STEP)
CUDA_FIELDS = {"peak_allocated_bytes": int, "fwd_bwd_peak_bytes": int, "static_bytes": int, "forward_peak_bytes": int,
               "backward_peak_bytes": int, "optimizer_peak_bytes": int, "peak_phase": str,
               "activation_peak_bytes": int, "peak_reserved_bytes": int, "num_alloc_retries": int,
               "step_ms_median": float, "step_ms_iqr": float, "tokens_per_s": float, "mfu": float}


def cuda_spec(**fields) -> ResolvedRun:
    defaults = dict(model="tiny-llama", seq_len=64, batch_size=2, device="cuda", warmup_steps=1, measure_steps=3)
    return resolve(RunSpec(**(defaults | fields)))


def assert_every_device_explicit(calls, index: int = 0) -> None:
    """Every call names device `index` explicitly; events record while it is the current device."""
    implicit = [(c.name, c.args, c.kwargs) for c in calls if not _names(c, index)]
    assert implicit == [], f"torch.cuda calls without an explicit cuda:{index}: {implicit}"


def _names(call, index: int) -> bool:
    if call.name == "Event.record":  # events record on the current device's stream: it must be the run's device
        return call.args == (index,)
    if call.name in DEVICE_ARG_POSITION:
        return is_explicit_device(call.device) and torch.device("cuda", index) == _as_device(call.device)
    return True  # no device to name (is_available, device_count, empty_cache)


def _as_device(device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def assert_cuda_record(record: dict) -> None:
    assert record["status"] == "ok", record.get("error")
    assert record["device"] == "cuda:0" and record["precision"] == "bf16"
    for name, kind in CUDA_FIELDS.items():
        assert isinstance(record[name], kind), (name, record[name])
    assert all(isinstance(x, float) for x in record["step_ms"] + record["wall_ms"])
    assert len(record["step_ms"]) == len(record["wall_ms"]) == record["measure_steps"]
    assert record["env"]["gpu_name"] == FAKE_GPU and record["env"]["gpu_memory_bytes"] == 80 * 2**30
    assert "peak_tracked_bytes" not in record  # a CUDA run never reports the CPU tracker's number
    state = record["param_bytes"] + record["grad_bytes"] + record["optimizer_bytes"]
    assert record["peak_allocated_bytes"] >= record["fwd_bwd_peak_bytes"] > record["static_bytes"] >= state
    assert record["activation_peak_bytes"] == record["fwd_bwd_peak_bytes"] - record["static_bytes"]
    assert record["peak_reserved_bytes"] >= record["peak_allocated_bytes"]


# --------------------------------------------------------------------------------------------------- device


def test_auto_and_cuda_resolve_to_an_explicit_device(fake_cuda):
    assert resolve_device("auto") == resolve_device("cuda") == resolve_device("cuda:0") == "cuda:0"
    assert resolve(RunSpec(model="tiny-llama", seq_len=8, batch_size=1)).device == "cuda:0"
    with pytest.raises(GcbenchError, match="only 1 CUDA device"):
        resolve_device("cuda:1")


def test_torch_still_refuses_a_device_without_index(fake_cuda):
    # The fake keeps torch's own checks: this is the error the CUDA branch used to stop at.
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device("cuda")


def test_cuda_instrument_refuses_an_implicit_device():
    with pytest.raises(ValueError, match="explicit device"):
        CudaInstrument("cuda")


# --------------------------------------------------------------------------------------------------- gcbench run


def test_cuda_run_follows_the_protocol_with_an_explicit_device_in_every_call(fake_cuda):
    record = run(cuda_spec())
    assert_cuda_record(record)
    calls = fake_cuda.gcbench_calls()
    assert_every_device_explicit(calls)
    names = [c.name for c in calls]
    assert names.index("set_device") < names.index("mem_get_info") < names.index("synchronize")
    protocol = [n for n in names if n in PROTOCOL]
    assert protocol == TIMED + STEP * 2 + STEP[1:] + ["Event.synchronize", "memory_stats"] + MEMORY_STEP
    # Step times are the events' (the fake clock ticks per op: every step runs the same ops), not the wall clock.
    assert len(set(record["step_ms"])) == 1 and record["step_ms"][0] > 0
    assert record["memory_cap_kind"] is None and fake_cuda.fraction == 1.0


@pytest.mark.parametrize("fake_cuda", [{"devices": 2}], indirect=True)
def test_a_run_on_the_second_gpu_names_it_in_every_call(fake_cuda):
    record = run(cuda_spec(device="cuda:1"))
    assert record["status"] == "ok" and record["device"] == "cuda:1"
    assert_every_device_explicit(fake_cuda.gcbench_calls(), index=1)
    # The fake's statistics of a device not in use read zero: these come from cuda:1.
    assert record["peak_allocated_bytes"] > record["static_bytes"] > 0


@pytest.mark.parametrize("fake_cuda", [{"total_memory": 12 * MiB}], indirect=True)
def test_a_config_that_fits_only_with_its_checkpoints_runs_where_the_step_without_them_would_not(fake_cuda):
    """On an H200, fit's trials of llama-7b under `full` ran out of memory from batch 32 on: after the timed steps,
    the model FLOPs were counted by running the step once more without its checkpoints, which needs none's memory.
    (Here none reserves 18 MiB, full 6 MiB, on a 12 MiB card.)"""
    assert run(cuda_spec(policy="none", seq_len=64, batch_size=8, measure_steps=1))["status"] == "oom"
    record = run(cuda_spec(policy="full", seq_len=64, batch_size=8, measure_steps=1))
    assert record["status"] == "ok", record.get("error")
    assert record["peak_reserved_bytes"] <= 12 * MiB
    assert record["flops"] > record["model_flops"] > 0  # the recompute counted, and told apart


def test_cuda_offload_pins_host_memory(fake_cuda):
    record = run(cuda_spec(policy="offload"))
    assert record["status"] == "ok" and record["offloaded_bytes"] > 0
    assert any(c.name == "pin_memory" for c in fake_cuda.calls)


def test_cpu_offload_does_not_pin(fake_cuda):
    assert run(cuda_spec(policy="offload", device="cpu", precision="fp32"))["status"] == "ok"
    assert not any(c.name == "pin_memory" for c in fake_cuda.calls)
    assert fake_cuda.gcbench_calls() == []  # a CPU run on a machine with a GPU leaves CUDA alone


def test_memory_cap_caps_reserved_bytes_then_is_lifted(fake_cuda):
    record = run(cuda_spec(seq_len=64, batch_size=16, memory_cap_bytes=16 * MiB))
    assert record["status"] == "oom" and "CUDA out of memory" in record["error"]
    assert record["memory_cap_kind"] == "reserved"
    fractions = [c for c in fake_cuda.gcbench_calls() if c.name == "set_per_process_memory_fraction"]
    assert [c.args[0] for c in fractions] == [16 * MiB / (80 * 2**30), 1.0]
    assert all(is_explicit_device(c.device) for c in fractions)
    assert fake_cuda.fraction == 1.0
    assert run(cuda_spec(seq_len=64, batch_size=16))["status"] == "ok"  # the cap does not stick


def test_a_failing_cleanup_does_not_replace_the_first_error(fake_cuda, monkeypatch):
    from gcbench.step import TrainingStep

    def broken_step(self, *args):
        raise RuntimeError("the first error")

    def broken_lift(fraction, device):
        if fraction == 1.0:
            raise RuntimeError("lifting the cap failed")
        fake_cuda.set_fraction(fraction, device)

    monkeypatch.setattr(TrainingStep, "forward_backward", broken_step)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", broken_lift, raising=False)
    with pytest.raises(RuntimeError, match="the first error") as raised:
        run(cuda_spec(memory_cap_bytes=64 * MiB))
    assert any("lifting the cap failed" in note for note in raised.value.__notes__)


# --------------------------------------------------------------------------------------------------- the readings


class ScriptedStep:
    """A step whose forward+backward holds a temporary of the next size in `sizes` (bytes); its optimizer step
    hands cached memory back, so that reserved memory differs from step to step."""

    def __init__(self, sizes):
        self.sizes, self.batch = iter(sizes), {}

    def __call__(self, mark=lambda phase: None):
        mark("forward")
        self.forward_backward()
        mark("optimizer")
        self.optimizer_step()
        mark("end")

    def forward_backward(self):
        temporary = torch.empty(next(self.sizes), dtype=torch.uint8, device="cuda:0")
        del temporary

    def optimizer_step(self):
        torch.cuda.empty_cache()

    def static_tensors(self):
        return []


def test_the_memory_step_reads_the_reserved_peak_of_every_phase(fake_cuda):
    # The forward+backward reserves 64 MiB, the optimizer step hands it back: the step's reserved peak is the
    # forward's, not what is reserved when the step ends.
    instrument = CudaInstrument("cuda:0")
    with instrument.session():
        out = instrument.peak_fields(ScriptedStep([64 * MiB]), lambda _: None)
    assert out["peak_reserved_bytes"] == 64 * MiB and fake_cuda.reserved == 0
    assert out["peak_allocated_bytes"] == out["fwd_bwd_peak_bytes"] == 64 * MiB


def test_timed_steps_run_back_to_back_and_read_no_memory(fake_cuda):
    # Each timed step is the time between the events at its two boundaries; under auto the step after the last
    # timed one runs untimed (a fixed count launches none); nothing between two steps waits for the whole device.
    instrument = CudaInstrument("cuda:0")
    step = ScriptedStep([8 * MiB] * 4 + [8 * MiB] * 9)
    with instrument.session():
        fake_cuda.calls.clear()
        out = instrument.time_steps(step, StepBudget(fixed=4), lambda _: None)
        names = [c.name for c in fake_cuda.gcbench_calls()]
        assert len(list(step.sizes)) == 9  # 4 launched, no more
        step.sizes = iter([8 * MiB] * 9)
        auto = instrument.time_steps(step, StepBudget(step_limit=8), lambda _: None)
    first, last = names.index("Event.record"), len(names) - 1 - names[::-1].index("Event.elapsed_time")
    assert not {"synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"} \
        & set(names[first:last])
    assert len(out["step_ms"]) == len(out["wall_ms"]) == 4
    assert len(auto["step_ms"]) == 8 and next(step.sizes, None) is None  # 8 + 1 untimed
    assert "peak_allocated_bytes" not in out and out["gpu_throttled"] is None  # the fake NVML cannot tell


def test_a_paired_round_runs_its_steps_back_to_back(fake_cuda):
    # The device is synchronized once before the round and the last end event waited for once after it; each step
    # runs inside its context (its policy), between a start and an end event recorded inside it, so that switching
    # policies on the host is not the step's time; nothing between two steps waits for the device.
    instrument = CudaInstrument("cuda:0")
    step = ScriptedStep([8 * MiB] * 3)
    entered = []

    @contextlib.contextmanager
    def policy(label):
        entered.append(("in", label, len(fake_cuda.gcbench_calls())))
        yield
        entered.append(("out", label, len(fake_cuda.gcbench_calls())))

    with instrument.session():
        fake_cuda.calls.clear()
        times = instrument.timed_round([(functools.partial(policy, label), step) for label in "abc"])
        names = [c.name for c in fake_cuda.gcbench_calls()]
    assert len(times) == 3 and all(t >= 0 for t in times) and next(step.sizes, None) is None
    assert names == ["synchronize"] + ["Event.record"] * 6 + ["Event.synchronize"] + ["Event.elapsed_time"] * 3
    # each policy entered before its step's start event and left after its end event
    assert [(kind, label) for kind, label, _ in entered] == [(k, x) for x in "abc" for k in ("in", "out")]
    assert [at for *_, at in entered] == [1, 3, 3, 5, 5, 7]
    assert_every_device_explicit(fake_cuda.gcbench_calls())


def test_alloc_retries_count_the_measured_steps_only(fake_cuda):
    fake_cuda.num_alloc_retries = 5  # left by earlier configs in this process
    fake_cuda.retry_above_bytes = 16 * MiB  # every step below crosses it once
    instrument = CudaInstrument("cuda:0")
    step = ScriptedStep([32 * MiB] * 5)
    with instrument.session():
        instrument.warm_up(step, 2, lambda _: None)
        out = instrument.time_steps(step, StepBudget(fixed=3), lambda _: None)
    assert fake_cuda.num_alloc_retries == 5 + 2 + 3
    assert out["num_alloc_retries"] == 3


def test_warmup_of_zero_is_refused():
    with pytest.raises(GcbenchError, match="--warmup: must be at least 1"):
        RunSpec(model="tiny-llama", seq_len=8, batch_size=1, device="cpu", warmup_steps=0)
    result = CliRunner().invoke(app, ["run", "--model", "tiny-llama", "--device", "cpu", "--warmup", "0"])
    assert result.exit_code == 2
    assert "--warmup: must be at least 1" in result.stderr and "Traceback" not in result.output


# --------------------------------------------------------------------------------------------------- estimate


@pytest.mark.slow  # moved out of the default suite to keep it under 5 minutes; CI runs it
def test_estimate_for_a_cuda_target_is_the_same_with_a_gpu_present(fake_cuda, monkeypatch):
    args = ["estimate", "--model", "tiny-llama", "--seq", "64", "--policy", "none,sqrtn", "--format", "json"]
    with_gpu = CliRunner().invoke(app, args)
    assert with_gpu.exit_code == 0, with_gpu.output
    assert fake_cuda.gcbench_calls() == [] and fake_cuda.allocated == 0  # a prediction touches no GPU
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0, raising=False)
    without_gpu = CliRunner().invoke(app, args)
    rows = lambda out: [{k: v for k, v in json.loads(line).items() if k != "seconds"}  # noqa: E731
                        for line in out.splitlines()]
    assert rows(with_gpu.stdout) == rows(without_gpu.stdout) and len(rows(with_gpu.stdout)) == 4


# --------------------------------------------------------------------------------------------------- processes


def gcbench(args, log) -> subprocess.CompletedProcess:
    return subprocess.run(["gcbench", *args], env=subprocess_env(log), capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the installed command in a subprocess, starting torch
def test_gcbench_run_command_on_cuda(tmp_path):
    log, out = tmp_path / "calls.jsonl", tmp_path / "r.jsonl"
    result = gcbench(["run", "--model", "tiny-llama", "--seq", "32", "--batch", "2", "--warmup", "1", "--steps",
                      "2", "--out", str(out)], log)  # --device auto: the GPU
    assert result.returncode == 0, result.stderr
    assert FAKE_GPU in result.stdout and "max_memory_allocated" in result.stdout
    [record] = read_records(out)
    assert_cuda_record(record)
    calls = [c for c in read_log(log) if c.caller.startswith("gcbench")]
    assert_every_device_explicit(calls)
    # none in the timed steps: one as the memory step starts, then one per phase of it
    assert [c.name for c in calls].count("reset_peak_memory_stats") == 1 + 3


@pytest.mark.slow
def test_sweep_measures_cuda_configs_in_child_processes(tmp_path):
    """Each config in its own child forked from the fork server; the cap applies in each child; an OOM is a
    record; the fork server itself never initialises CUDA (the fake enforces the fork rule)."""
    log, out = tmp_path / "calls.jsonl", tmp_path / "sweep.jsonl"
    result = gcbench(["sweep", "--model", "tiny-llama", "--seq", "64", "--batch", "1,16", "--policy",
                      "none,offload", "--warmup", "1", "--steps", "2", "--memory-cap", "16MiB", "--no-skip",
                      "--out", str(out)], log)
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    # offload at batch 16 runs within the cap: its activations wait on the host (it ran out before a2c32f2 only
    # in the FLOPs pass, which ran the step without the policy)
    assert [(r["batch_size"], r["policy"], r["status"]) for r in records] == [
        (1, "none", "ok"), (1, "offload", "ok"), (16, "none", "oom"), (16, "offload", "ok")]
    assert records[3]["peak_reserved_bytes"] <= 16 * MiB and records[3]["offloaded_bytes"] > 0
    for r in records:
        assert r["device"] == "cuda:0" and r["memory_cap_kind"] == "reserved"
        assert r["env"]["gpu_name"] == FAKE_GPU
    for r in (records[0], records[1], records[3]):
        assert_cuda_record(r)
    calls = read_log(log)
    assert_every_device_explicit([c for c in calls if c.caller.startswith("gcbench")])
    measuring = Counter(c.pid for c in calls if c.name == "set_device")
    # one child per config and one timing batch 1's two policies paired; each sets its device once
    assert len(measuring) == 5 and set(measuring.values()) == {1}
    assert all("time_ratio" in r for r in records[:2]) and records[1]["time_ratio_vs"] == "none"
    # the paired child (it reads no peaks) runs each round's two steps back to back: one wait per round
    timing = {c.pid for c in calls if c.name == "Event.elapsed_time"}
    paired = [pid for pid in timing if not any(c.pid == pid and c.name == "reset_peak_memory_stats" for c in calls)]
    assert len(paired) == 1
    names = [c.name for c in calls if c.pid == paired[0] and c.caller.startswith("gcbench")]
    rounds = records[1]["paired_rounds"]
    assert names.count("Event.synchronize") == rounds and names.count("Event.elapsed_time") == 2 * rounds
    parent = {c.pid for c in calls if c.caller == "gcbench.resolved"} - set(measuring)
    assert len(parent) == 1 and not parent & set(measuring)
    assert any(c.name == "pin_memory" and c.pid in measuring for c in calls)
    lifts = [c for c in calls if c.name == "set_per_process_memory_fraction" and c.args[0] == 1.0]
    assert {c.pid for c in lifts} == set(measuring)  # lifted in every child, after an OOM too


@pytest.mark.slow  # the script starts python twice
def test_the_validation_script_prints_the_plan_without_a_gpu_and_refuses_to_run_there():
    result = subprocess.run(["bash", str(REPO_ROOT / "benchmarks/gpu/validate.sh"), "--dry-run"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"total: \d+ s of device time in \d+ commands", result.stdout.splitlines()[-1])
    refused = subprocess.run(["bash", str(REPO_ROOT / "benchmarks/gpu/validate.sh")], capture_output=True, text=True,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)  # on a GPU machine too
    assert refused.returncode == 2 and "no CUDA GPU here" in refused.stderr