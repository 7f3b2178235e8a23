"""A sharded run (--shard fsdp2): torchrun starts --nproc ranks (rank.py), each measures its share with
the same protocol as any run (runner.run, in the rank), and their records become one: the world size, each rank's
peak and model-state bytes with the largest as the record's, the step time of the slowest rank per step, and the
tokens of all ranks per second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gcbench.fields import DeviceKind
from gcbench.launch.base import OnPhase, died, failure_record, read_tail, stop
from gcbench.resolved import ResolvedRun
from gcbench.results.schema import NoteKind, Status, TimingNote, timing_note_fields, timing_notes_of
from gcbench.timing import step_time_fields

# Per-rank measurements: the record keeps the largest (the rank that runs out first), and each rank's in rank_<name>.
RANK_FIELDS = ("peak_allocated_bytes", "peak_tracked_bytes", "peak_reserved_bytes", "param_bytes", "grad_bytes",
               "optimizer_bytes", "static_bytes", "activation_peak_bytes", "fwd_bwd_peak_bytes", "forward_peak_bytes",
               "backward_peak_bytes", "optimizer_peak_bytes", "num_alloc_retries")
# What only a run whose every rank finished has (the step's time, its throughput and FLOPs).
MEASURED_TOGETHER = ("step_ms", "step_ms_median", "step_ms_iqr", "step_ms_rel_iqr", "step_ms_ci", "steps_stop",
                     "timing_stable", "timing_notes", "timing_note_kinds", "tokens_per_s", "mfu", "flops", "model_flops",
                     "recompute_flops_ratio", "saved_activation_bytes")
LISTED = ("peak_allocated_bytes", "peak_tracked_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")
CPU_NOTE = ("CPU ranks share this machine's cores and talk through gloo: the step time checks the tool, it says "
            "nothing about FSDP's cost on GPUs")


def run_sharded(spec: ResolvedRun, progress: OnPhase) -> dict[str, Any]:
    """Run `spec` (shard != none) on spec.nproc ranks under torchrun; its one record."""
    with tempfile.TemporaryDirectory(prefix="gcbench-ranks-") as tmp:
        folder = Path(tmp)
        (folder / "spec.json").write_text(json.dumps(spec.as_record()))
        log = folder / "torchrun.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.nproc}",
                   "-m", "gcbench.launch.rank", str(folder)]
        # Each rank's intra-op threads: --threads (torchrun would set 1 per rank).
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads)}
        progress(f"{spec.nproc} rank(s) running (torchrun)")
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_stop_with_parent if sys.platform == "linux" else None)
            try:
                code = proc.wait()
            except BaseException:  # Ctrl-C, a sweep's timeout: torchrun stops its ranks on SIGTERM
                stop(proc, grace_s=0.0, term_s=30.0)
                raise
        ranks = [json.loads(p.read_text()) for p in folder.glob("rank-*.json")]
        output = read_tail(log)
    if not ranks:
        return failure_record(spec, Status.ERROR, died("torchrun", code, output, "and no rank reported"),
                              world_size=spec.nproc, stderr_tail=output)
    return merge_ranks(spec, sorted(ranks, key=lambda r: r["rank"]), output)


def merge_ranks(spec, ranks: list[dict[str, Any]], tail: str = "") -> dict[str, Any]:
    """The record of a sharded run from its ranks' records (sorted by rank)."""
    merged = {k: v for k, v in ranks[0].items() if k != "rank"}
    merged["world_size"] = spec.nproc
    for name in RANK_FIELDS:
        values = [r.get(name) for r in ranks]
        if any(v is not None for v in values):
            merged[name] = max(v for v in values if v is not None)
            if name in LISTED:
                merged[f"rank_{name}"] = values
    failed = [r for r in ranks if r["status"] != Status.OK]
    if failed or len(ranks) < spec.nproc:
        # One rank's failure stops all (torchrun ends the others): the run is what the first failure says.
        first = next((r for r in failed if r["status"] == Status.OOM), failed[0] if failed else None)
        status, why = (first["status"], f"rank {first['rank']}: {first['error']}") if first else \
            (Status.ERROR, f"only {len(ranks)} of {spec.nproc} ranks reported")
        merged.update(status=status, error=why, stderr_tail=(first or {}).get("stderr_tail") or tail)
        for name in MEASURED_TOGETHER:  # rank 0's own, not the run's: the run did not finish
            merged.pop(name, None)
        return merged
    # A step ends when its slowest rank's does (they meet in every collective).
    step_ms = [max(times) for times in zip(*(r["step_ms"] for r in ranks))]
    merged.update(step_time_fields(step_ms, ranks[0]["steps_stop"]))
    tokens = spec.nproc * spec.batch_size * spec.grad_accum * spec.seq_len
    merged["tokens_per_s"] = tokens / (merged["step_ms_median"] / 1e3)
    # each rank's notes under its rank (the table's IQR is the run's: each step's slowest rank), each text once
    notes = list(dict.fromkeys(TimingNote(n.kind, f"rank {r['rank']}: {n.text}") for r in ranks
                               for n in timing_notes_of(r)))
    if spec.device_kind is not DeviceKind.CUDA:
        notes.append(TimingNote(NoteKind.CPU_RANKS, CPU_NOTE))
    merged.update(timing_note_fields(notes))
    merged["timing_stable"] = all(r.get("timing_stable") for r in ranks) and spec.device_kind is DeviceKind.CUDA
    return merged


def _stop_with_parent() -> None:
    """In torchrun, before it starts: SIGTERM when the process that started it dies (a sweep's child killed at its
    timeout), so that no rank outlives the run and holds a GPU."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
