"""Predicted against measured GPU memory, from the records a GPU window brought home (results/gpu/<gpu>/): for
each single-process config that ran, the simulation's max_memory_allocated and the caching allocator replayed on
it (gcbench/estimators/caching_allocator.py) for max_memory_reserved, each with and without the cuBLAS workspaces
of that card (gcbench.gpus: one per thread that runs matmuls, allocated through the caching allocator). FSDP2 on
one rank is a single process too: it is simulated as FSDP2 itself over a fake world (estimators/fake_ranks.py).
Nothing here was fitted to these records: they are the test. Prints a Markdown table and the median and worst
|error| of each column.

    python benchmarks/reserved_accuracy.py [results/gpu/nvidia-h200]    # needs gcbench[peft]; ~3 min on 2 cores
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from gcbench.estimators.simulate import replay_allocator
from gcbench.gpus import CUBLAS_THREADS, cublas_workspace_bytes, for_device
from gcbench.results.schema import config_label, policy_label
from gcbench.spec import RunSpec

FIELDS = {f.name for f in dataclasses.fields(RunSpec)}


def gpu_folders(root: Path) -> list[Path]:
    """<root>/results/gpu/<gpu>/, less superseded/ (records a later fix showed to measure something else)."""
    return sorted(p for p in (root / "results" / "gpu").iterdir() if p.is_dir() and p.name != "superseded")


def records(folder: Path) -> list[dict]:
    """The ok single-process records of `folder` (FSDP2 on one rank included), one per config (the last)."""
    found: dict[str, dict] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            one_process = r.get("shard", "none") == "none" or r.get("nproc", 1) == 1
            if r["status"] == "ok" and one_process and r.get("compile", "none") == "none":
                found[f"{config_label(r)} · {r.get('layers')} layers · attn {r.get('attn')}"] = r
    return list(found.values())


def spec_of(record: dict) -> RunSpec:
    fields = {k: record[k] for k in FIELDS if k in record}
    return RunSpec(**{**fields, "policy": policy_label(record), "device": "cpu", "memory_cap_bytes": None})


def rows(folder: Path) -> list[dict]:
    out = []
    for r in records(folder):
        card = for_device(r["env"]["gpu_name"], r["env"].get("gpu_memory_bytes"))
        workspaces = CUBLAS_THREADS * cublas_workspace_bytes(card.capability if card else None)
        predicted, allocator = replay_allocator(spec_of(r))
        replayed = allocator.peak_reserved
        allocated, reserved = r["peak_allocated_bytes"], r["peak_reserved_bytes"]
        out.append({
            "config": config_label(r), "allocated GiB": allocated / 2**30,
            "alloc err %": 100 * (predicted.peak_bytes / allocated - 1),
            "alloc+ws err %": 100 * ((predicted.peak_bytes + workspaces) / allocated - 1),
            "reserved GiB": reserved / 2**30,
            "reserved err %": 100 * (replayed / reserved - 1),
            "reserved+ws err %": 100 * ((replayed + workspaces) / reserved - 1),
        })
        print(f"{len(out)}: {out[-1]['config']}", file=sys.stderr, flush=True)  # progress
    return out


def main(folder: Path) -> None:
    table = rows(folder)
    columns = list(table[0])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in table:
        print("| " + " | ".join(f"{v:+.2f}" if "%" in k else f"{v:.2f}" if isinstance(v, float) else str(v)
                                for k, v in row.items()) + " |")
    for column in (c for c in columns if "%" in c):
        errors = [abs(row[column]) for row in table]
        print(f"{column}: median |error| {statistics.median(errors):.2f}% max {max(errors):.2f}% over "
              f"{len(errors)} configs")


if __name__ == "__main__":
    if importlib.util.find_spec("peft") is None:  # the H200 records include LoRA runs
        sys.exit("reserved_accuracy.py: the LoRA records need peft: pip install -e '.[peft]'")
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/gpu/nvidia-h200"))
