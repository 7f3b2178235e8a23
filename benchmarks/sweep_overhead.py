"""The fixed per-config cost of sweep isolation, for tiny-llama on this machine, split by part. A measurement, not a
test. It starts its clock once the fork server is warm: what a user waits for, whole processes from the start, is
benchmarks/startup.py's figure.

For --rounds configs (tiny-llama, seq 32, batch 1, 1 warm-up + 1 timed step) it times, from the progress
messages each config sends:
  start   launch -> "building model": child start (fork from the server), spec, env, the analytic memory
          prediction that runner.run stores in every record, meta model, fit check
  build   "building model" -> first warm-up step: model, policy, optimizer, batch
  exit    record received -> child exited and reaped (process isolation only)
with process isolation (a fresh child per config, what `gcbench sweep` does) and in-process (`--isolation none`);
the difference is what isolation costs per config. It also times the one-off fork server start (it imports
torch, transformers and gcbench once per sweep) and, with --smoke, the whole sweeps/smoke.toml grid.

    python benchmarks/sweep_overhead.py [--rounds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec
from gcbench.grid import SweepSpec
from gcbench.sweeps import Sweep
from gcbench.launch.inline import InProcessRunner
from gcbench.launch.process import ProcessRunner

PARTS = ("start", "build", "exit", "config")


def tiny_spec(i: int) -> ResolvedRun:
    """A distinct config per round (seq 32, 40, 48, ...), as in a real sweep: no config finds its shapes already
    seen in the process (the memory prediction that runner.run makes is faster on shapes it has seen)."""
    return resolve(RunSpec("tiny-llama", 32 + 8 * i, 1, "none", device="cpu", warmup_steps=1, measure_steps=1))


def time_config(runner, spec: ResolvedRun) -> dict[str, float]:
    """Seconds per part of one config (see the module docstring); `config` is the whole config."""
    marks: dict[str, float] = {}

    def on_phase(text: str) -> None:
        marks.setdefault(text.split(" ")[0], time.perf_counter())

    t0 = time.perf_counter()
    record = runner(spec, on_phase)
    t1 = time.perf_counter()
    assert record["status"] == "ok", record.get("error")
    return {"start": marks["building"] - t0, "build": marks["warm-up"] - marks["building"],
            "exit": t1 - marks.get("child", t1), "config": t1 - t0}


def summarise(runner, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """(median, min) per part. On a shared, loaded machine the minimum is the better estimate of the intrinsic
    cost (other processes only ever add time); the median says what a user there sees."""
    samples = [time_config(runner, tiny_spec(i)) for i in range(rounds)]
    return ({part: statistics.median(s[part] for s in samples) for part in PARTS},
            {part: min(s[part] for s in samples) for part in PARTS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="also time the 16-config sweeps/smoke.toml grid")
    args = parser.parse_args()

    print(f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    process = ProcessRunner(timeout_s=600)
    t0 = time.perf_counter()
    time_config(process, tiny_spec(-1))  # the first config also starts the fork server
    first = time.perf_counter() - t0
    in_process = InProcessRunner()
    time_config(in_process, tiny_spec(-1))  # imports the modeling code, as the fork server did

    isolated, inline = summarise(process, args.rounds), summarise(in_process, args.rounds)
    print(f"first config incl. fork server start (once per sweep): {first:.2f} s")
    for stat, i in (("median", 0), ("min", 1)):
        for name, t in (("process isolation", isolated[i]), ("in-process       ", inline[i])):
            print(f"{name}, {stat:>6} of {args.rounds}: "
                  + ", ".join(f"{part} {t[part] * 1e3:.0f} ms" for part in PARTS))
        fixed = isolated[i]["start"] + isolated[i]["build"] + isolated[i]["exit"]
        print(f"fixed per-config overhead with isolation (start + build + exit), {stat}: {fixed * 1e3:.0f} ms, "
              f"of which isolation itself: {(fixed - inline[i]['start'] - inline[i]['build']) * 1e3:.0f} ms")

    try:
        from gcbench.estimators import predict_for_run
    except ImportError:
        predict_for_run = None
    if predict_for_run is not None:
        samples = []
        for i in range(args.rounds, 2 * args.rounds):  # shapes this process has not seen yet
            t0 = time.perf_counter()
            predict_for_run(tiny_spec(i))
            samples.append(time.perf_counter() - t0)
        print(f"of every config's start, the memory prediction (in-process): median "
              f"{statistics.median(samples) * 1e3:.0f} ms, min {min(samples) * 1e3:.0f} ms")

    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            grid = SweepSpec.load(Path(__file__).parent.parent / "sweeps" / "smoke.toml",
                                  {"out": f"{tmp}/smoke.jsonl"})
            t0 = time.perf_counter()
            records = Sweep(grid).run()
            wall = time.perf_counter() - t0
        print(f"sweeps/smoke.toml: {len(records)} configs in {wall:.1f} s ({wall / len(records):.2f} s per config, "
              f"statuses {sorted({r['status'] for r in records})}); load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
