"""The paired-timing experiment of docs/methodology.md: `full` vs `none` on tiny-llama (seq 128, batch 4, CPU),
five times unpaired (two separate `gcbench run`s, the ratio of their medians) and five times paired (a two-policy
`gcbench sweep`, whose time_ratio comes from rounds interleaved in one process), under a deliberate background load.

    python benchmarks/paired_timing.py                 # the load: 2 processes, each busy 1-6 s then idle 0-3 s
    python benchmarks/paired_timing.py --load 0        # a quiet machine, for comparison

The load stands for other jobs coming and going on a shared machine (a constant load would slow both policies
alike). Records go to --out (default results/timing-experiment/loaded/: unpaired.jsonl, paired.jsonl,
summary.json); a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIG = ["--model", "tiny-llama", "--seq", "128", "--batch", "4", "--device", "cpu", "--max-time", "5"]


def background(seed: int) -> None:
    """One process of the load: busy for 1-6 s, then idle for 0-3 s, forever (seeded: the same pattern each time)."""
    rng = random.Random(seed)
    while True:
        end = time.monotonic() + rng.uniform(1, 6)
        while time.monotonic() < end:
            pass
        time.sleep(rng.uniform(0, 3))


def gcbench(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gcbench", *args], check=False, stdout=subprocess.DEVNULL)


def last_records(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[-n:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, help="background load processes (default 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/timing-experiment/loaded"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    unpaired_out, paired_out = args.out / "unpaired.jsonl", args.out / "paired.jsonl"
    for f in (unpaired_out, paired_out):
        f.unlink(missing_ok=True)

    load = [multiprocessing.Process(target=background, args=(i,), daemon=True) for i in range(args.load)]
    for p in load:
        p.start()
    rows = []
    try:
        for i in range(args.repeats):
            t0 = time.monotonic()
            for policy in ("none", "full"):
                gcbench("run", *CONFIG, "--policy", policy, "--out", str(unpaired_out))
            none, full = last_records(unpaired_out, 2)
            gcbench("sweep", *CONFIG, "--policy", "none,full", "--out", str(paired_out), "--rerun")
            pnone, pfull = last_records(paired_out, 2)
            rows.append({
                "unpaired": full["step_ms_median"] / none["step_ms_median"],
                "unpaired_flagged": [not none["timing_stable"], not full["timing_stable"]],
                "rel_iqr": [none["step_ms_rel_iqr"], full["step_ms_rel_iqr"]],
                "paired": pfull["time_ratio"], "paired_ci": pfull["time_ratio_ci"],
                "paired_rounds": pfull["paired_rounds"],
                "paired_flagged": [not pnone["timing_stable"], not pfull["timing_stable"]],
                "seconds": time.monotonic() - t0,
            })
            print(f"repeat {i + 1}: unpaired {rows[-1]['unpaired']:.2f}x, paired {rows[-1]['paired']:.2f}x "
                  f"({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for p in load:
            p.terminate()

    print("| repeat | unpaired full/none | relative IQR none, full | flagged | paired full/none | 95% interval "
          "| rounds |\n|---:|---:|---|---|---:|---|---:|")
    for i, r in enumerate(rows, 1):
        ci = r["paired_ci"]
        print(f"| {i} | {r['unpaired']:.2f}x | {r['rel_iqr'][0]:.0%}, {r['rel_iqr'][1]:.0%} "
              f"| {sum(r['unpaired_flagged'])} of 2 | {r['paired']:.3f}x | {ci[0]:.3f}-{ci[1]:.3f} "
              f"| {r['paired_rounds']} |")
    for key in ("unpaired", "paired"):
        xs = [r[key] for r in rows]
        med = statistics.median(xs)
        print(f"\n{key}: median {med:.3f}x, range {min(xs):.3f}-{max(xs):.3f}x "
              f"({min(xs) / med - 1:+.1%} .. {max(xs) / med - 1:+.1%} of the median)")
    print(json.dumps(rows), file=(args.out / "summary.json").open("w"))


if __name__ == "__main__":
    main()
