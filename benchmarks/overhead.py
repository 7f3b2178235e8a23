"""Harness overhead: gcbench's measured step vs a bare hand-written training loop (not a test).

Both run on the same model, optimizer, batch, policy and device, interleaved in one process in rounds (A B, B A,
A B, ...) so that drift (thermal, background load) and the position in a pair hit both alike. A round of gcbench is
the median step time its instrument records over 10 steps (as a run measures them); a round of the bare loop is 10
steps back to back timed from outside (perf_counter, one synchronize at the end on CUDA), per step. Prints the
ratio of the medians over rounds: what a record says against what a training loop gets; the target is <= 1.01.

    python benchmarks/overhead.py --model gpt2 --seq 256 --batch 1 --policy full --rounds 30
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from gcbench.instruments import instrument_for
from gcbench.models import build_model, find_blocks
from gcbench.resolved import ResolvedRun, resolve
from gcbench.spec import RunSpec
from gcbench.step import TrainingStep, make_batch, make_optimizer
from gcbench.timing import StepBudget, Stats


STEPS_PER_ROUND = 10  # steps per round on each side: the harness's window, the bare loop's back-to-back run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()

    spec = resolve(RunSpec(model=args.model, seq_len=args.seq, batch_size=args.batch, policy=args.policy,
                           layers=args.layers, device=args.device, measure_steps=1))
    instrument = instrument_for(spec.device)
    with instrument.session():
        measure(spec, instrument, args.rounds)


def measure(spec: ResolvedRun, instrument, rounds: int) -> None:
    config, _ = spec.model_config()
    torch.manual_seed(spec.seed)
    model = build_model(config, spec.device, spec.param_dtype)
    spec.policy.apply(find_blocks(model))
    optimizer = make_optimizer(spec, model)
    batch = make_batch(spec, config, spec.device)
    step = TrainingStep(model, optimizer, batch, spec)
    cuda = instrument.kind == "cuda"
    sync = (lambda: torch.cuda.synchronize(spec.device)) if cuda else (lambda: None)
    if spec.autocast_dtype:
        autocast = lambda: torch.autocast(torch.device(spec.device).type, dtype=spec.autocast_dtype)  # noqa: E731
    else:
        autocast = contextlib.nullcontext

    def bare_step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with autocast():
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()

    def gcbench_round() -> float:
        # The median step time a record would hold: the instrument's timed steps as a run takes them (CUDA: back to
        # back, an event at each boundary). What it reads once per config around all its steps (host load, the
        # GPU's state at both ends) is left out: not a cost of a step.
        with _once_per_config_reads_off():
            out = instrument.time_steps(step, StepBudget(fixed=STEPS_PER_ROUND), lambda _: None)
        return statistics.median(out["step_ms"])

    def bare_round() -> float:
        # A bare training loop's time per step: STEPS_PER_ROUND steps back to back, one synchronize at the end.
        sync()
        t0 = time.perf_counter()
        for _ in range(STEPS_PER_ROUND):
            bare_step()
        sync()
        return (time.perf_counter() - t0) * 1e3 / STEPS_PER_ROUND

    for _ in range(3):  # warm-up: optimizer state, allocator, kernels
        bare_step()
    harness, bare = [], []
    for i in range(rounds):
        # ABBA order: whichever side runs second in a pair (warmer caches, or a freshly freed allocator) swaps.
        for fn, out in ((gcbench_round, harness), (bare_round, bare))[:: 1 if i % 2 == 0 else -1]:
            out.append(fn())
    h, b = Stats.of(harness), Stats.of(bare)
    where = instrument.describe()["gpu_name"] if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{spec.model} seq {spec.seq_len} batch {spec.batch_size} {spec.policy} {spec.precision} on {where}")
    print(f"gcbench measured step: median {h.median:.2f} ms (IQR {h.iqr:.2f})")
    print(f"bare training loop:    median {b.median:.2f} ms (IQR {b.iqr:.2f})")
    print(f"ratio gcbench / bare:  {h.median / b.median:.4f}  ({rounds} interleaved rounds of {STEPS_PER_ROUND} steps)")


@contextlib.contextmanager
def _once_per_config_reads_off():
    import gcbench.instruments as instruments

    class NoLoad:
        def __init__(self, clock):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def fields(self, threads):
            return {}

    saved = instruments.HostLoad, instruments.gpu_state
    instruments.HostLoad, instruments.gpu_state = NoLoad, lambda index: None
    try:
        yield
    finally:
        instruments.HostLoad, instruments.gpu_state = saved


if __name__ == "__main__":
    main()
