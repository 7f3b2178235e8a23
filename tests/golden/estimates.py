"""The numbers `gcbench estimate` printed before its speed-up, for a fixed set of configs: tests/test_estimate_speed.py
holds every faster path to them.

    python tests/golden/estimates.py --write     # only when a prediction is meant to change; say why in the commit

Each case is a whole `estimate_grid` call or an `estimate --fit` (predicted_fits) and its rows without the seconds
they took. QUICK runs in the default suite, the rest in the slow set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gcbench.fields import RUN_FIELDS

HERE = Path(__file__).with_name("estimates.jsonl")
POLICIES = ("none", "full", "every-k:k=2", "segments:k=3", "sqrtn", "sac:mm=all", "sac:mm=alternate", "attn",
            "offload", "offload:what=all", "plan:memory=3MiB")

# (name, kind, arguments): kind "grid" = estimate_grid(axes, methods, target, **fields); "fit" = predicted_fits
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("llama-all-policies-cuda", "grid", dict(axes={"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2],
                                                   "policy": list(POLICIES)},
                                             methods=["simulate", "analytic"], target="cuda")),
    ("llama-all-policies-cpu", "grid", dict(axes={"model": ["tiny-llama"], "seq_len": [48], "batch_size": [1, 3],
                                                  "policy": ["none", "full", "sqrtn", "sac:mm=all", "attn"]},
                                            methods=["simulate", "analytic"], target="cpu")),
    ("gpt2-bert-cuda", "grid", dict(axes={"model": ["tiny-gpt2", "tiny-bert"], "seq_len": [64, 96],
                                          "batch_size": [1, 2], "policy": ["none", "full", "sqrtn"]},
                                    methods=["simulate", "analytic"], target="cuda")),
    ("levers-cuda", "grid", dict(axes={"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2],
                                       "policy": ["none", "full"], "precision": ["bf16", "amp-bf16", "fp32"],
                                       "optimizer": ["adamw", "sgd", "adafactor", "adamw-fused"]},
                                 methods=["simulate", "analytic"], target="cuda")),
    ("optim-in-backward-accum", "grid", dict(axes={"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2],
                                                   "policy": ["none", "full"], "optim_in_backward": [True, False],
                                                   "grad_accum": [1, 2]},
                                             methods=["simulate", "analytic"], target="cuda")),
    ("sharded", "grid", dict(axes={"model": ["tiny-llama"], "seq_len": [64], "batch_size": [2],
                                   "policy": ["none", "full"], "shard": ["fsdp2"], "nproc": [2, 4]},
                             methods=["simulate", "analytic"], target="cuda")),
    ("layers-long", "grid", dict(axes={"model": ["llama-7b"], "seq_len": [4096], "batch_size": [1],
                                       "policy": ["none", "full", "sqrtn"]},
                                 methods=["simulate", "analytic"], target="cuda", layers=3)),
    ("fit-tiny-batch", "fit", dict(grid={"model": ("tiny-llama",), "seq_len": (256,)}, memory=24 * 2**20,
                                   gpu_name=None, vary="batch", headroom="0%", device="cuda")),
    ("fit-tiny-seq", "fit", dict(grid={"model": ("tiny-gpt2",), "batch_size": (2,),
                                       "policy": ("none", "full", "sac:mm=all")}, memory=16 * 2**20,
                                 gpu_name=None, vary="seq", headroom="5%", device="cuda")),
]
WRITTEN_AT = 3  # the schema version of the records these rows were written beside
# the default suite's (a 7B slice, 2 s); the rest run in the slow set (every policy on tiny-llama, 12 s: the
# default suite passed 4 minutes on 2 cores; tests/test_estimate.py holds each policy's simulation there)
QUICK = ("layers-long",)


def compute(name: str) -> list[dict[str, Any]]:
    """The rows of one case, as `gcbench estimate --format json` gives them (less the seconds each took)."""
    from gcbench.estimators import estimate_grid
    from gcbench.fits.command import predicted_fits

    _, kind, args = next(c for c in CASES if c[0] == name)
    if kind == "grid":
        args = dict(args)
        rows = [estimate.as_record(spec) for spec, estimate in
                estimate_grid(args.pop("axes"), args.pop("methods"), args.pop("target"), **args)]
    else:
        args = {**args, "grid": dict(args["grid"])}
        rows = predicted_fits(**args)[0]
    # a field added after these rows were written (schema 3) is left out where it holds what they measured
    later = {f.name: f.added[1] for f in RUN_FIELDS if f.added and f.added[0] > WRITTEN_AT}
    return [{k: v for k, v in row.items() if k != "seconds" and not (k in later and v == later[k])} for row in rows]


def stored() -> dict[str, list[dict[str, Any]]]:
    return {row["case"]: row["rows"] for row in map(json.loads, HERE.read_text().splitlines())}


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/golden/estimates.py --write")
    with HERE.open("w") as f:
        for name, _, _ in CASES:
            f.write(json.dumps({"case": name, "rows": compute(name)}, sort_keys=True) + "\n")
            print(name, flush=True)
