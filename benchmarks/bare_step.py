"""The floor any harness has: import torch and transformers, build tiny-llama from its config, run the steps a
`gcbench run --model tiny-llama --seq 32 --warmup 1 --steps 3` runs (one warm-up, three timed), exit. No gcbench
code runs but the preset's config values (a dict), so that it is the same model. benchmarks/startup.py times it
against gcbench, as whole processes.

    python benchmarks/bare_step.py [--seq 32] [--steps 4]

With GCBENCH_MARKS set it prints when each part ended (seconds since the epoch) to stderr, as startup.py reads
them: imports, build, steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def mark(name: str) -> None:
    if os.environ.get("GCBENCH_MARKS"):
        print(f"mark {name} {time.time():.6f}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="all steps, the warm-up included")
    args = ap.parse_args()

    import torch
    import transformers

    from gcbench.presets import MODELS  # a dict of config values; imports nothing else of gcbench's

    mark("imports")
    torch.set_num_threads(1)  # gcbench's CPU default on 2 cores: the available cores but one
    fields = dict(MODELS["tiny-llama"].config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, config.vocab_size, (1, args.seq))
    mark("build")
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=False)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    mark("steps")


if __name__ == "__main__":
    main()
