"""The validation plan's device seconds (gcbench/validate/cost.py) against what the windows on record took: every
config of results/gpu/<gpu>/ that carries `config_wall_ms` (the whole config as its sweep saw it: child start,
build, every step), priced as it ran (its own warm-up, step count and time limit) by the plan's own pricing for that
card (the time model's step predicted beforehand, else the FLOPs rule), then summed per results file (a plan step).
A sweep's first config (by `sweep_id`) is also charged the sweep's start (cost.SWEEP_START_S): its child waits for
the fork server, and its wall time holds that wait, as the deadline prices it (validate/execute.py). The plan
exists to overestimate: a ratio planned / measured under 1 is a command the plan would let overrun.

    python benchmarks/plan_cost.py [results/gpu/nvidia-h200]    # ~10 s on 2 cores

Nothing here is fitted: the records are the test of the plan's assumptions, which cost.py states.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from gcbench.gpus import matching
from gcbench.resolved import resolve
from gcbench.results.schema import config_label, policy_label
from gcbench.spec import RunSpec
from gcbench.validate import cost
from gcbench.validate.execute import Validation
from gcbench.validate.plan import PREDICTED, tiers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reserved_accuracy import FIELDS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AS_RUN = ("warmup_steps", "measure_steps", "max_steps", "max_time_s")  # how many steps the config took
# Changes to the harness that moved what a config's wall time holds: (commit, which records, why). A record made by
# code before one (its env.git_sha not descended from the commit) is listed but left out of the figures: it priced
# a start that no longer happens.
MOVED_STARTS = (
    ("892974060ad5fbc93c528870aa55d09db9ded4cc", lambda r: str(r.get("adapter", "none")).startswith("qlora"),
     "a QLoRA base was then built on the host and quantised there (74-86 s a config); since 8929740 it is made on "
     "the meta device and each 4-bit layer on the card"),
)


def records(folder: Path) -> list[dict]:
    """Every record with `config_wall_ms` (ok, oom, skipped alike: each took device time), with its file."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if isinstance(r.get("config_wall_ms"), (int, float)):
                out.append({**r, "_file": path.name})
    return out


def moved_start(record: dict, undecided: list[str] | None = None) -> str | None:
    """Why the record's wall time is not today's harness's (MOVED_STARTS), or None. Where git cannot say (no git, a
    shallow clone, a commit this clone lacks) the record is kept, and `undecided` told why. A "-dirty" commit is
    taken as its commit: a change not yet committed when the record was made is not seen."""
    sha = str(record.get("env", {}).get("git_sha") or "").removesuffix("-dirty")
    for commit, applies, why in MOVED_STARTS:
        if applies(record) and sha:
            try:
                done = subprocess.run(["git", "merge-base", "--is-ancestor", commit, sha], cwd=ROOT,
                                      capture_output=True)
            except OSError as e:
                done = None
                reason = f"git did not run ({e.strerror})"
            if done is not None and done.returncode == 1:  # 0: made after the change
                return f"measured before {commit[:7]}: {why}"
            if done is None or done.returncode != 0:  # 128: a commit this clone lacks
                if undecided is not None:
                    undecided.append(reason if done is None else f"git does not know {sha[:12]} or {commit[:7]}")
    return None


def priced(record: dict, plan: Validation) -> float:
    """The plan's seconds for the record's config as it ran: nothing for one skipped, its start alone for one that
    did not run its steps (out of memory: the plan's rule for a config predicted past the card; an error)."""
    if record["status"] == "skipped":
        return 0.0
    fields = {k: record[k] for k in FIELDS if k in record}
    spec = resolve(RunSpec(**{**fields, "policy": policy_label(record), "device": "cpu", "memory_cap_bytes": None}))
    spec = spec.replace(**{k: record[k] for k in AS_RUN if record.get(k) is not None})
    if record["status"] != "ok":
        return cost.start_seconds(spec, plan.pricing.starts)
    return cost.config_seconds(spec, plan.pricing)


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else ROOT / "results" / "gpu" / "nvidia-h200"
    rows = records(folder)
    if not rows:
        print(f"no record with config_wall_ms in {folder}")
        return 1
    card = matching(rows[0]["env"]["gpu_name"])
    plan = Validation(tiers(), folder, predicted=ROOT / PREDICTED, card=card.name if card else None, planning=True)
    print(f"card: {plan.card}; step times: {cost.assumptions(plan.card, 0, 0)[0].split(': ', 1)[1]}, "
          f"else {cost.PLAN_EFFICIENCY:g} x its dense peak\n")
    print("| file | config | status | measured s | planned s | planned / measured |")
    print("|---|---|---|---:|---:|---:|")
    steps: dict[str, list[float]] = {}
    ratios = []
    moved: dict[str, int] = {}
    undecided: list[str] = []
    sweeps: set[str] = set()
    for r in rows:
        # a sweep's first config waits for its fork server (its wall time holds that wait): the plan's start of the
        # sweep is priced with it, as the deadline prices it (validate/execute.py)
        sweep = str(r.get("sweep_id") or r["_file"])
        first = sweep not in sweeps
        sweeps.add(sweep)
        measured, planned = r["config_wall_ms"] / 1e3, priced(r, plan) + (cost.SWEEP_START_S if first else 0.0)
        why = moved_start(r, undecided)
        if why is None:
            ratios.append(planned / measured)
            steps.setdefault(r["_file"], [0.0, 0.0])
            steps[r["_file"]][0] += measured
            steps[r["_file"]][1] += planned
        else:
            moved[why] = moved.get(why, 0) + 1
        print(f"| {r['_file']} | {config_label(r)} · {policy_label(r)} | {r['status']}"
              f"{' (left out: see below)' if why else ''} | {measured:.1f} | {planned:.1f} | "
              f"{planned / measured:.2f} |")
    print("\n| step (file) | measured s | planned s | planned / measured |")
    print("|---|---:|---:|---:|")
    for name, (measured, planned) in steps.items():
        print(f"| {name} | {measured:.0f} | {planned:.0f} | {planned / measured:.2f} |")
    step_ratios = [p / m for m, p in steps.values()]
    for why, n in moved.items():
        print(f"\nleft out of the figures, {n} config{'s' if n != 1 else ''} {why}")
    for reason in dict.fromkeys(undecided):
        print(f"\nkept, though a change may have moved their start: {undecided.count(reason)} config(s): {reason}")
    for what, xs in (("configs", ratios), ("steps", step_ratios)):
        print(f"\n{what}: {len(xs)}, planned under measured: {sum(x < 1 for x in xs)}, over 1.5x: "
              f"{sum(x > 1.5 for x in xs)}; planned / measured median {statistics.median(xs):.2f}, "
              f"min {min(xs):.2f}, max {max(xs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
