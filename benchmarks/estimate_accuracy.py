"""Prediction error on CPU: `gcbench estimate` (analytic, simulate) against measured peak_tracked_bytes.

Runs each tiny preset under each classic policy for real (CPU), predicts it both ways, and prints a Markdown table
(the one in docs/methodology.md, "Predicting memory"). Usage: python benchmarks/estimate_accuracy.py

With --agreement: no measurement, the two methods against each other for CUDA targets of the full presets
(agreement of two models, not accuracy: without a GPU nothing here is a CUDA measurement).
"""

from __future__ import annotations

import sys

import pandas as pd

from gcbench.estimators.analytic import analytic
from gcbench.estimators.simulate import simulate
from gcbench.resolved import resolve
from gcbench.spec import RunSpec
from gcbench.runner import run

TINY = ("tiny-llama", "tiny-gpt2", "tiny-bert")
CLASSIC = ("none", "full", "every-k:k=2", "segments:k=2", "sqrtn")
SETUPS = ({"seq_len": 256, "batch_size": 2, "precision": "fp32"},
          {"seq_len": 512, "batch_size": 1, "precision": "bf16"})


def accuracy_rows() -> list[dict]:
    rows = []
    for setup in SETUPS:
        for model in TINY:
            for policy in CLASSIC:
                spec = resolve(RunSpec(model=model, policy=policy, device="cpu", warmup_steps=1, measure_steps=1,
                                       **setup))
                measured = run(spec)["peak_tracked_bytes"]
                sim, ana = simulate(spec, "cpu"), analytic(spec, "cpu")
                rows.append({"setup": f"seq {setup['seq_len']} x batch {setup['batch_size']}, {setup['precision']}",
                             "model": model, "policy": policy, "measured_MiB": measured / 2**20,
                             "simulate_err_%": 100 * (sim.peak_bytes / measured - 1),
                             "analytic_err_%": 100 * (ana.peak_bytes / measured - 1),
                             "simulate_s": sim.seconds, "analytic_ms": 1e3 * ana.seconds})
                print(rows[-1], flush=True)
    return rows


def agreement_rows() -> list[dict]:
    rows = []
    for model, seq, batch in (("llama-7b", 4096, 4), ("mistral-7b", 8192, 2), ("gpt2", 1024, 16),
                              ("bert-base", 512, 32)):
        for policy in CLASSIC:
            spec = resolve(RunSpec(model=model, seq_len=seq, batch_size=batch, policy=policy, device="cpu",
                                   precision="bf16"))
            sim, ana = simulate(spec, "cuda"), analytic(spec, "cuda")
            rows.append({"model": model, "seq x batch": f"{seq} x {batch}", "policy": policy,
                         "simulate_GiB": sim.peak_bytes / 2**30, "analytic_vs_simulate_%":
                         100 * (ana.peak_bytes / sim.peak_bytes - 1), "peak_in": sim.peak_phase,
                         "kernel": sim.attention_kernel, "simulate_s": sim.seconds, "analytic_ms": 1e3 * ana.seconds})
            print(rows[-1], flush=True)
    return rows


def markdown(df: pd.DataFrame) -> str:
    """A Markdown table of `df` (numbers with 2 decimals); pandas' to_markdown needs tabulate, not installed."""
    cells = [[f"{v:+.2f}" if "%" in c else f"{v:.2f}" if isinstance(v, float) else str(v) for c, v in row.items()]
             for row in df.to_dict("records")]
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])


if __name__ == "__main__":
    if "--agreement" in sys.argv:
        print(markdown(pd.DataFrame(agreement_rows())))
        sys.exit(0)
    df = pd.DataFrame(accuracy_rows())
    print(markdown(df))
    worst = df.groupby(["setup", "policy"], sort=False)[["simulate_err_%", "analytic_err_%"]].agg(
        lambda s: s.abs().max()).reset_index().rename(columns=lambda c: f"max |{c}|" if "err" in c else c)
    print(markdown(worst))
