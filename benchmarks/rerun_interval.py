"""Does a record's interval cover a rerun? N identical `gcbench run` processes, one after another (as a user reruns
a command), then for every ordered pair of runs (i, j), whether run j's median falls inside run i's 95% interval
(not a test: it depends on the machine).

An interval that covered a rerun would hold another run's median about 83% of the time (two independent draws of
one spread: P(|Z| < 1.96 / sqrt 2)); issue 47 asks for at least 65%.

    python benchmarks/rerun_interval.py [--runs 8] [--out DIR] [-- run options ...]

The run options default to `--model tiny-llama --seq 64 --batch 2 --device cpu`. The records stay in --out
(default: a temporary folder) for a second look.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_RUN = ["--model", "tiny-llama", "--seq", "64", "--batch", "2", "--device", "cpu"]


def containment(records: list[dict]) -> tuple[int, int]:
    """(pairs where run j's median lies inside run i's interval, ordered pairs i != j with an interval for i)."""
    inside = pairs = 0
    for i, a in enumerate(records):
        if not a.get("step_ms_ci"):
            continue
        lo, hi = a["step_ms_ci"]
        for j, b in enumerate(records):
            if i != j:
                pairs += 1
                inside += lo <= b["step_ms_median"] <= hi
    return inside, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="folder for the records (default: a temporary one)")
    ap.add_argument("run_options", nargs="*", help="options of `gcbench run` (after --)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="rerun-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    options = args.run_options or DEFAULT_RUN
    for k in range(args.runs):
        subprocess.run([sys.executable, "-m", "gcbench", "run", *options, "--out", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"run {k + 1}/{args.runs} done", file=sys.stderr)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in records:
        lo, hi = r["step_ms_ci"] or (float("nan"),) * 2
        print(f"median {r['step_ms_median']:8.2f} ms  interval {lo:8.2f} .. {hi:8.2f} ms  "
              f"({len(r['step_ms'])} steps, {r['steps_stop']}, stable {r['timing_stable']})")
    medians = [r["step_ms_median"] for r in records]
    inside, pairs = containment(records)
    spread = (max(medians) - min(medians)) / statistics.median(medians)
    print(f"medians {min(medians):.2f}-{max(medians):.2f} ms ({spread:.0%} apart); another run's median inside a "
          f"run's interval: {inside}/{pairs} = {inside / pairs:.0%} (about 83% if the interval covered a rerun)")
    print(f"records: {path}")


if __name__ == "__main__":
    main()
