"""Step-time stability of a GPU validation run: per results file, how many measured configs are trusted
(timing_stable) and the coefficient of variation (stdev / mean) of their step times; the issue's target on the
canonical configs is CV <= 2%. Prints a markdown table; exits 0 (a number to read, not a gate).

    python benchmarks/gpu/timing_cv.py results/gpu/<gpu>/
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from gcbench.results.schema import config_label
from gcbench.results.store import read_records, result_files


def main(paths: list[str]) -> None:
    print("| file | config | steps | CV | rel. IQR | trusted | clocks start -> end (MHz) |")
    print("|---|---|---:|---:|---:|---|---|")
    for path in result_files(paths):
        for r in read_records(path):
            if r["status"] != "ok" or len(r.get("step_ms") or []) < 2:
                continue
            cv = statistics.stdev(r["step_ms"]) / statistics.fmean(r["step_ms"])
            start, end = r.get("gpu_state_start") or {}, r.get("gpu_state_end") or {}
            clocks = f"{start.get('sm_clock_mhz')} -> {end.get('sm_clock_mhz')}" if start else "-"
            print(f"| {Path(path).name} | {config_label(r)} | {len(r['step_ms'])} | {cv:.1%} "
                  f"| {r.get('step_ms_rel_iqr', float('nan')):.1%} | {r.get('timing_stable')} | {clocks} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["results/gpu"])
