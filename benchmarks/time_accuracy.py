"""Predicted against measured step time, on the records a GPU window brought home (results/gpu/<gpu>/): each ok
single-process record's step time as the time model predicts it (gcbench/estimators/step_time.py, on the card's
rates: card_rates.py) beside its measured median, and, for comparison, the FLOPs model gcbench ranked by before
(FLOPs / (dense peak x 0.4)). Nothing in the model was fitted to these records: they are the test.

Prints a Markdown table, then:
- median and worst |error| of each model;
- same-table pairs (two records of one file) whose measured medians differ by more than 5% (and 3%): how many each
  model orders wrong or ties (within 1%, what the model cannot tell apart);
- the ratios the levers are chosen by (sac/none, qlora/lora, adamw8bit/adamw, full/none, ...), measured and
  predicted, in points.

    python benchmarks/time_accuracy.py [results/gpu/nvidia-h200]    # needs gcbench[peft]; ~3 min on 2 cores
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gcbench.estimators import estimate, step_flops
from gcbench.estimators.card_rates import rates_for
from gcbench.gpus import matching
from gcbench.results.schema import config_label, policy_label

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reserved_accuracy import spec_of  # noqa: E402

OLD_EFFICIENCY = 0.4  # fits/predict.py's DEFAULT_EFFICIENCY, the model ranked by before this one
TIED = 0.01  # predicted within 1% of each other: the model does not tell them apart
# (numerator, denominator): the fields that differ, the rest of the config equal
RATIOS = {"sac/none": {"policy": ("sac", "none")}, "full/none": {"policy": ("full", "none")},
          "qlora/lora": {"adapter": ("qlora", "lora")}, "adamw8bit/adamw": {"optimizer": ("adamw8bit", "adamw")},
          "adafactor/adamw": {"optimizer": ("adafactor", "adamw")},
          "adamw-fused/adamw": {"optimizer": ("adamw-fused", "adamw")}}


def records(folder: Path) -> list[dict]:
    """Every ok single-process record of `folder`, with the file it is in: the newest line of each record_id (a
    sweep appends a record again once its paired timing ends), each record once (a config measured twice, in two
    files, counts twice: each is a measurement)."""
    out: dict[object, dict] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            r = json.loads(line)
            one_process = r.get("shard", "none") == "none" or r.get("nproc", 1) == 1
            if r["status"] == "ok" and one_process and r.get("compile", "none") == "none" and r.get("step_ms_median"):
                out[r.get("record_id") or (path.name, i)] = {**r, "_file": path.name}
    return list(out.values())


def predict(record: dict) -> tuple[Any, float | None, str]:
    """(the time model's step (step_time.Step: step_ms, host_bound, basis) or None, the FLOPs model's ms, the
    basis)."""
    card = matching(record["env"]["gpu_name"])
    rates = rates_for(card)
    spec = spec_of(record)
    found = estimate(spec, "simulate", "cuda")
    model = found.work.time(rates) if found.work is not None and not isinstance(rates, str) else None
    flops = step_flops(spec, "cuda")
    old = flops / (card.peak_flops * OLD_EFFICIENCY) * 1e3 if card else None
    return model, old, (model.basis if model else str(rates))


def pairs(rows: list[dict], key: str, gap: float, wrongs: list | None = None) -> tuple[int, int, int]:
    """(pairs, wrong, tied): same-file pairs whose measured medians differ by more than `gap`; `wrongs`, where
    given, gets each pair ordered wrong."""
    n = wrong = tied = 0
    for a, b in itertools.combinations(rows, 2):
        if a["file"] != b["file"] or a[key] is None or b[key] is None:
            continue
        lo, hi = sorted((a["measured"], b["measured"]))
        if hi / lo - 1 <= gap:
            continue
        n += 1
        if abs(a[key] / b[key] - 1) <= TIED:
            tied += 1
        elif (a[key] < b[key]) != (a["measured"] < b["measured"]):
            wrong += 1
            if wrongs is not None:
                wrongs.append((a, b))
    return n, wrong, tied


def ratio_rows(rows: list[dict]) -> list[tuple[str, str, float, float, float]]:
    """(name, config, measured ratio, predicted, old) for each pair of records that differ only by a RATIOS field."""
    out = []
    for name, fields in RATIOS.items():
        (field, (top, bottom)), = fields.items()
        for a in rows:
            if a["record"].get(field) != top:
                continue
            for b in rows:
                if b["file"] == a["file"] and b["record"].get(field) == bottom and _same(a["record"], b["record"],
                                                                                         field):
                    out.append((name, a["config"], a["measured"] / b["measured"], a["model"] / b["model"],
                                a["old"] / b["old"]))
    return out


def _same(a: dict, b: dict, varied: str) -> bool:
    """The same config but the field `varied` (a policy's options go with its policy)."""
    keys = ("model", "layers", "seq_len", "batch_size", "policy", "policy_options", "optimizer", "optim_in_backward",
            "adapter", "loss", "precision", "shard", "grad_accum")
    ignored = {varied, "policy_options"} if varied == "policy" else {varied}
    return all(a.get(k) == b.get(k) for k in keys if k not in ignored)


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "results" / "gpu" / "nvidia-h200"
    rows = []
    for r in records(folder):
        step, old, basis = predict(r)
        model = step.step_ms if step else None
        rows.append({"file": r["_file"], "config": f"{config_label(r)} · {policy_label(r)} · {r.get('layers') or 'all'}"
                     " layers", "measured": r["step_ms_median"], "model": model, "old": old, "basis": basis,
                     "record": r})
    print("| file | config | measured ms | predicted ms | error | FLOPs model ms | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for x in rows:
        err = lambda p: f"{(p / x['measured'] - 1) * 100:+.1f}%" if p else "-"  # noqa: E731
        print(f"| {x['file']} | {x['config']} | {x['measured']:.1f} | {x['model'] or 0:.1f} | {err(x['model'])} | "
              f"{x['old'] or 0:.1f} | {err(x['old'])} |")
    print(f"\nbasis: {rows[0]['basis']}\n")
    for key, name in (("model", "time model"), ("old", "FLOPs model")):
        errs = [abs(x[key] / x["measured"] - 1) * 100 for x in rows if x[key]]
        print(f"{name}: {len(errs)} records, median |error| {statistics.median(errs):.1f}%, max {max(errs):.1f}%")
        for gap in (0.05, 0.03):
            n, wrong, tied = pairs(rows, key, gap)
            print(f"  same-table pairs measured > {gap:.0%} apart: {n}, ordered wrong {wrong}, tied {tied}")
    wrongs: list = []
    pairs(rows, "model", 0.05, wrongs)
    print("\nordered wrong by the time model (measured > 5% apart): measured ms, predicted ms")
    for a, b in wrongs:
        print(f"- {a['config']} ({a['measured']:.1f}, {a['model']:.1f}) vs {b['config']} ({b['measured']:.1f}, "
              f"{b['model']:.1f})")
    print("\n| ratio | config | measured | time model | points | FLOPs model |")
    print("|---|---|---:|---:|---:|---:|")
    for name, config, measured, model, old in ratio_rows(rows):
        print(f"| {name} | {config} | {measured:.3f} | {model:.3f} | {(model - measured) * 100:+.1f} | {old:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
