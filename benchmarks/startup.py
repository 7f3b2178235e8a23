"""What a user waits for: whole gcbench processes, started as a user starts them. A measurement, not a test.

Every figure is the wall time of whole processes started from here (nothing is warmed up inside a timed process;
the operating system's file cache is warm after the first run, as it is for a user's second command;
gcbench's modules are compiled to bytecode first, as an install has them: `compiled`). Where two
commands are compared they run interleaved in pairs, A B then B A, so that drift and a pair's position hit both
alike, and the figure is the median of the pairs' ratios:
  run       `gcbench run` of tiny-llama (seq 32, 1 warm-up + 3 timed steps) against bare_step.py, which imports
            torch and transformers, builds the same model and runs the same four steps: the floor any harness has.
            Then where the time of one more run of each goes (imports, spec, prediction, build, steps, record, exit).
  sweep     `gcbench sweep` of 8 tiny-llama configs: its fixed cost per config, (wall - timed steps) / 8, and when
            its first record is written (one tiny config's own work, about 0.3 s, included); each sweep paired with
            the floor: bare_step.py's imports and build, to its model built (not its exit).
  estimate  `gcbench estimate --model llama-7b --seq 4096 --policy none,full,sqrtn --method simulate`, paired with
            the same floor, and with --fit also `gcbench estimate --model llama-7b --seq 4096 --fit --gpu h100-80gb`.
            `--method analytic` of the same, paired with the libraries' import floor (`import torch,
            transformers`), and with the floor of what it reads: the libraries, the llama config class and its
            modeling code (the analytic model builds the model on the meta device), which no change to gcbench lowers.
  suites    (only with --only suites: 15-20 minutes on 2 cores) the README's test command and the slow set, each
            once, as CI runs them: wall, tests passed, and the slowest tests pytest reports.
  optimum   with --optimum-python PY (an interpreter that has optimum-benchmark installed, in its own environment:
            `pip install optimum-benchmark`): its training scenario on the same tiny llama (benchmarks/
            optimum_training.py), paired against the same `gcbench run`.

    python benchmarks/startup.py [--pairs 7] [--fit] [--optimum-python /path/to/python]

It prints the machine's load before and after: on a busy machine the ratios hold better than the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
GCBENCH = [PYTHON, "-m", "gcbench"]
RUN_ARGS = ["run", "--model", "tiny-llama", "--seq", "32", "--policy", "none", "--warmup", "1", "--steps", "3",
            "--device", "cpu"]
SWEEP_CONFIGS = 8
ESTIMATE = ["estimate", "--model", "llama-7b", "--seq", "4096", "--policy", "none,full,sqrtn", "--method", "simulate"]
ESTIMATE_ANALYTIC = [*ESTIMATE[:-1], "analytic"]
LIBRARIES = [PYTHON, "-c", "import torch, transformers"]
# what any command that reads and builds a llama imports: transformers' config class pulls in its activations, hub
# kernels and torch.distributed.tensor; its modeling code masking_utils and torch._dynamo
MODEL_CODE = [PYTHON, "-c", "import torch, transformers; from transformers import LlamaConfig; "
              "from transformers.models.llama import modeling_llama"]
SUITES = (("the default suite", []), ("the slow set", ["-m", "slow"]))
ESTIMATE_FIT = ["estimate", "--model", "llama-7b", "--seq", "4096", "--fit", "--gpu", "h100-80gb"]
# The parts of a run, in order, as the marks name them (see marked_run)
RUN_PARTS = ("imports", "spec", "prediction", "build", "steps", "record")
BARE_PARTS = ("imports", "build", "steps")


def wall(cmd: list[str], cwd: Path | None = None) -> float:
    """Seconds from start to exit of one whole process; a failure stops the benchmark (a failing command's time
    says nothing)."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return time.perf_counter() - start


def paired(a: Callable[[], float], b: Callable[[], float], pairs: int) -> tuple[list[float], list[float]]:
    """(A's times, B's times), A B then B A in turn, after one pair not counted (the file cache)."""
    a(), b()
    times_a, times_b = [], []
    for i in range(pairs):
        if i % 2 == 0:
            times_a.append(a())
            times_b.append(b())
        else:
            times_b.append(b())
            times_a.append(a())
    return times_a, times_b


def ratio_line(name: str, times_a: list[float], times_b: list[float], a: str, b: str) -> str:
    ratios = [x / y for x, y in zip(times_a, times_b)]
    return (f"{name}: {a} {statistics.median(times_a):.2f} s, {b} {statistics.median(times_b):.2f} s (medians of "
            f"{len(ratios)}); ratio {a}/{b} median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


def marks(cmd: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """Seconds each part of one process took: from the marks it prints on stderr (`mark NAME EPOCH`), the last
    part ending at its exit ("exit")."""
    start = time.time()
    proc = subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "GCBENCH_MARKS": "1"})
    end = time.time()
    at = {line.split()[1]: float(line.split()[2]) for line in proc.stderr.splitlines() if line.startswith("mark ")}
    parts, before = {}, start
    for name in names:
        parts[name] = at[name] - before
        before = at[name]
    parts["exit"] = end - before
    return parts


def split_line(name: str, parts: dict[str, float]) -> str:
    total = sum(parts.values())
    return f"{name} {total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())


def marked_run(argv: list[str]) -> None:
    """`gcbench ARGV` in this process, printing a mark as each part of a run ends (what --split-child runs): the
    imports (torch, transformers, gcbench, all up front here), the spec (options parsed, config resolved), the
    prediction and fit check, the model's build, the steps (warm-up, timed and the untimed passes), the record
    (written, table printed); gcbench's own entry point, so that its exit is the user's."""
    def mark(name: str) -> None:
        print(f"mark {name} {time.time():.6f}", file=sys.stderr, flush=True)

    import gcbench.launch
    import gcbench.runner
    import gcbench.step
    from gcbench.__main__ import main

    mark("imports")

    def wrapped(owner, attr: str, before: str | None = None, after: str | None = None) -> None:
        original = getattr(owner, attr)

        def call(*args, **kwargs):
            if before:
                mark(before)
            result = original(*args, **kwargs)
            if after:
                mark(after)
            return result
        setattr(owner, attr, call)

    wrapped(gcbench.launch, "run", before="spec", after="steps")
    wrapped(gcbench.runner, "_measure", before="prediction")
    wrapped(gcbench.step.TrainingStep, "__init__", after="build")
    sys.argv = ["gcbench", *argv]
    try:
        main()
    finally:
        mark("record")


def run_figures(pairs: int, out: Path) -> list[str]:
    run = [*GCBENCH, *RUN_ARGS, "--out", str(out / "run.jsonl")]
    bare = [PYTHON, str(HERE / "bare_step.py")]
    times_run, times_bare = paired(lambda: wall(run), lambda: wall(bare), pairs)
    lines = [ratio_line("run", times_run, times_bare, "gcbench run", "bare script")]
    lines.append("  " + split_line("gcbench run", marks([PYTHON, __file__, "--split-child", *RUN_ARGS, "--out",
                                                          str(out / "run.jsonl")], RUN_PARTS)))
    lines.append("  " + split_line("bare script", marks(bare, BARE_PARTS)))
    return lines


def floor() -> float:
    """Seconds from the bare script's start to its model built (its marks): the imports and build that any process
    training or simulating a transformers model waits for before its first op; not its steps, nor its exit (the
    interpreter's last garbage collection, which gcbench skips)."""
    parts = marks([PYTHON, str(HERE / "bare_step.py"), "--steps", "0"], BARE_PARTS)
    return parts["imports"] + parts["build"]


def sweep_figures(out: Path, repeat: int) -> list[str]:
    """Each figure the median of `repeat` sweeps (a fresh output file each: nothing resumes), each paired with the
    floor, interleaved, after one pair not counted."""
    runs, floors = paired(lambda: sweep_once(out), floor, repeat)
    total, steps, first, n = (statistics.median(r[i] for r in runs) for i in range(4))
    above = statistics.median(r[2] - f for r, f in zip(runs, floors))
    per_config = statistics.median((r[0] - r[1] - f) / r[3] for r, f in zip(runs, floors))
    return [f"sweep of {n:.0f} configs (median of {repeat} sweeps): {total:.2f} s wall, timed steps {steps:.2f} s; "
            f"fixed cost per config {(total - steps) / n:.2f} s; first record written after {first:.2f} s; each "
            f"later config's own wall (child start to record), median {statistics.median(runs[0][4][1:]):.2f} s",
            f"  the floor, paired (the bare script's imports and build, to its model built): "
            f"{statistics.median(floors):.2f} s; the first record {above:+.2f} s after it (the first config's own "
            f"work included); (wall - timed steps - floor) / {n:.0f} = {per_config:.2f} s per config above it"]


def sweep_once(out: Path) -> tuple[float, float, float, int, list[float]]:
    """(wall, timed steps, when the first record was written, configs, each config's own wall) of one sweep,
    seconds. A config's own wall starts when its child is asked for: the first one's includes waiting for the fork
    server, so the first record's time says what a user waits for."""
    seqs = ",".join(str(32 + 8 * i) for i in range(SWEEP_CONFIGS))  # distinct configs, as in a real sweep
    results = out / "sweep.jsonl"
    results.unlink(missing_ok=True)
    cmd = [*GCBENCH, "sweep", "--model", "tiny-llama", "--seq", seqs, "--batch", "1", "--policy", "none",
           "--warmup", "1", "--steps", "3", "--device", "cpu", "--out", str(results)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        if first is None and results.exists() and results.stat().st_size:
            first = time.perf_counter() - start
        time.sleep(0.005)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the sweep failed (exit {proc.returncode}): {' '.join(cmd)}")
    records = [json.loads(line) for line in results.read_text().splitlines()]
    steps = sum(sum(r["step_ms"]) for r in records) / 1e3
    return total, steps, first or total, len(records), [r["config_wall_ms"] / 1e3 for r in records]


def estimate_figures(fit: bool, repeat: int) -> list[str]:
    """The 3-policy estimate, paired and interleaved with the floor (its imports and build)."""
    times, floors = paired(lambda: wall([*GCBENCH, *ESTIMATE]), floor, repeat)
    lines = [f"estimate (llama-7b, seq 4096, simulate, 3 policies): median {statistics.median(times):.2f} s of "
             f"{repeat} ({', '.join(f'{t:.2f}' for t in times)}); the floor, paired (the bare script's imports and "
             f"build): "
             f"{statistics.median(floors):.2f} s, the estimate "
             f"{statistics.median(t - f for t, f in zip(times, floors)):+.2f} s above it"]
    times, floors = paired(lambda: wall([*GCBENCH, *ESTIMATE_ANALYTIC]), lambda: wall(LIBRARIES), repeat)
    lines.append(f"estimate --method analytic: median {statistics.median(times):.2f} s of {repeat}; `import torch, "
                 f"transformers` paired: {statistics.median(floors):.2f} s, the estimate "
                 f"{statistics.median(t - f for t, f in zip(times, floors)):+.2f} s above it")
    times, floors = paired(lambda: wall([*GCBENCH, *ESTIMATE_ANALYTIC]), lambda: wall(MODEL_CODE), repeat)
    lines.append(f"estimate --method analytic: median {statistics.median(times):.2f} s of {repeat}; the libraries, "
                 f"the llama config and modeling code paired: {statistics.median(floors):.2f} s, the estimate "
                 f"{statistics.median(t - f for t, f in zip(times, floors)):+.2f} s above it")
    if fit:
        lines.append(f"estimate --fit (llama-7b, seq 4096, h100-80gb): {wall([*GCBENCH, *ESTIMATE_FIT]):.2f} s")
    return lines


def suite_figures() -> list[str]:
    """Each pytest set once, a whole process from this checkout's root (its pyproject.toml's options: one worker
    per core), with pytest's own summary line and its five slowest tests."""
    lines = []
    for name, args in SUITES:
        start = time.perf_counter()
        done = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *args],
                              capture_output=True, text=True, cwd=HERE.parent)
        seconds = time.perf_counter() - start
        out = done.stdout.splitlines()
        summary = out[-1].strip("= ") if out else "no output"
        at = next((i for i, line in enumerate(out) if "slowest" in line), None)
        slowest = out[at + 1:at + 6] if at is not None else []
        lines.append(f"{name}: {seconds:.0f} s wall, exit {done.returncode}; {summary}")
        lines += [f"  {line.strip()}" for line in slowest]
    return lines


def optimum_figures(python: str, pairs: int, out: Path) -> list[str]:
    run = [*GCBENCH, *RUN_ARGS, "--out", str(out / "run.jsonl")]
    peer = [python, str(HERE / "optimum_training.py"), "--out", str(out / "optimum")]
    subprocess.run([*peer, "--prepare"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    version = subprocess.run([python, "-c", "from importlib.metadata import version as v; "
                              "print(v('optimum-benchmark'), v('transformers'))"],
                             capture_output=True, text=True).stdout.split()
    times_run, times_peer = paired(lambda: wall(run), lambda: wall(peer, cwd=out), pairs)  # its benchmark.log
    return [ratio_line(f"optimum-benchmark {version[0]} (transformers {version[1]}; its process launcher)",
                       times_run, times_peer, "gcbench run", "optimum-benchmark training")]


def compiled(root: Path) -> str:
    """gcbench's modules compiled to bytecode, as a user's are: pip compiles what it installs, and Python caches
    each module it imports from a source tree (an editable install) at its first import. Where this environment
    writes none (PYTHONDONTWRITEBYTECODE, as some CI and sandboxes set), every process would compile each gcbench
    module it imports again (0.02-0.03 s of `import gcbench.cli` alone on 2 cores), which no user pays; torch's
    and transformers' were compiled by pip."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([PYTHON, "-m", "compileall", "-q", str(root / "gcbench")], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return f"gcbench's modules compiled to bytecode ({root / 'gcbench'}), as a user's install has them"


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    if sys.argv[1:2] == ["--split-child"]:
        return marked_run(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=3, help="sweeps and estimates timed (their median)")
    ap.add_argument("--fit", action="store_true", help="also time estimate --fit, once (about 25 s)")
    ap.add_argument("--optimum-python", help="an interpreter with optimum-benchmark installed")
    ap.add_argument("--only", choices=("run", "sweep", "estimate", "optimum", "suites"), action="append")
    ap.add_argument("--root", type=Path, help="time the gcbench of this checkout (e.g. a `git worktree` of an "
                                              "earlier commit) instead of this one")
    args = ap.parse_args()
    if args.root:  # the children import gcbench from there (PYTHONPATH comes before an editable install)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(args.root.resolve()), os.environ.get("PYTHONPATH", "")])
    only = args.only or ["run", "sweep", "estimate", "optimum"]
    print(f"{os.cpu_count()} cores, {load()}", flush=True)
    print(compiled(args.root or HERE.parent), flush=True)
    with tempfile.TemporaryDirectory(prefix="gcbench-startup-") as tmp:
        out = Path(tmp)
        if "run" in only:
            print("\n".join(run_figures(args.pairs, out)), flush=True)
        if "sweep" in only:
            print("\n".join(sweep_figures(out, args.repeat)), flush=True)
        if "estimate" in only:
            print("\n".join(estimate_figures(args.fit, args.repeat)), flush=True)
        if "suites" in only:
            print("\n".join(suite_figures()), flush=True)
        if "optimum" in only:
            if args.optimum_python:
                print("\n".join(optimum_figures(args.optimum_python, args.pairs, out)), flush=True)
            else:
                print("optimum-benchmark: not measured (no --optimum-python: install it in an environment of its "
                      "own and name that interpreter)")
    print(load())


if __name__ == "__main__":
    main()
