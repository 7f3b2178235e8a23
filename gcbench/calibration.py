"""The step-time model's calibration on the card: how much of its datasheet each kind of kernel reaches, and what
the host costs per op, measured by micro-benchmarks (never by a training step of a config the model is tested on).
`gcbench validate` runs it first in tier 1, into results/gpu/<gpu>/calibration.ndjson (JSON Lines, named apart from the
*.jsonl run records that readers of results take in); `python -m gcbench.calibration --out FILE` runs it alone.

Each measurement is one JSON line (`kind: "calibration"`): what ran, its shape, the time it took on the device (CUDA
events around back-to-back repetitions, the median of rounds) and, for the host costs, on the host; and the work the
time model itself counts for it (step_clock.StepClock on the same op: its FLOPs and bytes), so that what the model
reads off a measurement (benchmarks/calibration.py: the fraction of the datasheet reached) is defined exactly as
the model then uses it:

- a config's start, as a sweep's forked child pays it: its CUDA context, cuBLAS's first matmul, the model built on
  the card, fixed and per block (what validate's plan charges per config: validate/cost.py);
- matmuls: bf16 (and fp32) shapes with K from 256 to 8192 and M, N of transformer layers, after a soak of large
  matmuls that brings the clocks down to where a training run holds them (a power-limited card runs slower than
  its boost clock: mamf-finder's "sustainable" figure, Bekman, ml-engineering);
- streaming kernels: a copy, an add, a cast, on 256 MiB;
- the device time of a tiny kernel queued behind a long one (the floor per launch);
- SDPA's flash, memory-efficient and cuDNN kernels, forward and backward, causal, at a llama and a gpt2 shape;
- pinned host copies both ways (the host link);
- bitsandbytes' 4-bit dequantisation and 8-bit AdamW update, where bitsandbytes is installed;
- host time per op: a tiny model's forward, backward and optimizer step, timed on the host while the device keeps
  up (tiny kernels), over the ops the time model counts for each; and the same forward under `sac`, for the cost of
  a Python dispatch mode per op.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gcbench.errors import GcbenchError

SCHEMA = 1
GEMMS = [  # (m, n, k): a llama-7b layer at 2048 tokens, gpt2's at 8192, short and long K, small and large
    (2048, 4096, 4096), (2048, 11008, 4096), (2048, 4096, 11008), (2048, 32000, 4096), (8192, 2304, 768),
    (8192, 3072, 768), (8192, 768, 3072), (8192, 50257, 768), (4096, 4096, 256), (4096, 4096, 1024),
    (8192, 8192, 8192), (512, 4096, 4096), (1024, 1024, 1024)]
QUICK_GEMMS = [(64, 64, 64), (128, 64, 32)]
ATTENTION = [(1, 32, 2048, 128), (8, 12, 1024, 64)]  # (batch, heads, seq, head dim)
QUICK_ATTENTION = [(1, 2, 16, 8)]
# How long a config's start may take in its child: transformers imported, a CUDA context, 5 llama-7b blocks built
# (seconds on an H100); past this it is said unmeasured, and the plan keeps its assumed start
START_WAIT_S = 120.0


def calibrate(device: str = "cuda", quick: bool = False, soak_s: float = 10.0,
              progress: Callable[[str], None] = lambda text: None) -> list[dict[str, Any]]:
    """Every measurement, as JSON-ready dicts. `quick`: tiny shapes and few repetitions (a check that it runs,
    e.g. on the fake GPU of the tests): its numbers say nothing of a card."""
    # first, before this process asks CUDA anything (even how many devices it has: PyTorch then refuses CUDA in a
    # forked child) and so before it holds a context that a fork could not take along
    progress("config start")
    start = _start(device, quick)
    if not torch.cuda.is_available():
        raise GcbenchError("the calibration measures a CUDA GPU, and none is available")
    dev = torch.device(device)
    head = _head(dev, quick)
    out: list[dict[str, Any]] = [{**head, **start}]
    size = 2**20 if quick else 256 * 2**20
    reps = 2 if quick else 20
    progress("soak")
    _soak(dev, 0.0 if quick else soak_s)
    for m, n, k in QUICK_GEMMS if quick else GEMMS:
        progress(f"matmul {m}x{n}x{k}")
        for dtype in (torch.bfloat16,) if (m, n, k) != (1024, 1024, 1024) else (torch.bfloat16, torch.float32):
            a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
            out.append(_measured(head, "gemm", {"m": m, "n": n, "k": k, "dtype": str(dtype)[6:]},
                                 lambda: torch.mm(a, b), reps))
    progress("streaming kernels")
    x = torch.randn(size // 2, device=dev, dtype=torch.bfloat16)
    y, z = torch.empty_like(x), torch.randn_like(x)
    out.append(_measured(head, "copy", {"bytes": size}, lambda: y.copy_(x), reps))
    out.append(_measured(head, "add", {"bytes": size}, lambda: torch.add(x, z, out=y), reps))
    out.append(_measured(head, "cast", {"bytes": size}, lambda: x.float(), reps))
    progress("kernel floor")
    out.append(_kernel_floor(head, dev, quick))
    progress("attention")
    out += _attention(head, dev, QUICK_ATTENTION if quick else ATTENTION, reps)
    progress("host link")
    out += _host_link(head, dev, size, reps)
    progress("bitsandbytes")
    out += _bitsandbytes(head, dev, quick, reps)
    progress("host time per op")
    out += _host_costs(head, device, 3 if quick else 20)
    return out


def _head(dev: torch.device, quick: bool) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(dev)
    return {"kind": "calibration", "schema": SCHEMA, "gpu_name": props.name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "quick": quick,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _start(device: str, quick: bool) -> dict[str, Any]:
    """What a sweep's config pays before its first step, measured as a sweep's child pays it: a process forked with
    torch, transformers and gcbench imported and no CUDA context, which then makes its context, runs cuBLAS's first
    matmul and builds the model on the card (gcbench.models.build_model): 1 block of llama-7b (a tiny llama with
    --quick) cold, then 1 and 3 blocks again: the part per block from the last two, the fixed part (what a cold
    build pays once: kernels loaded, caches filled) from the first."""
    import multiprocessing

    model = "tiny-llama" if quick else "llama-7b"
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_start_child, args=(send, device, model), daemon=True)
    child.start()
    send.close()
    try:
        found = receive.recv() if receive.poll(START_WAIT_S) else \
            {"unavailable": f"the child said nothing in {START_WAIT_S:g} s"}
    except EOFError:
        found = None
    child.join(5)
    if child.is_alive():  # hung: what it would have said is lost, and the calibration goes on without it
        child.kill()
        child.join()
    receive.close()
    return {"what": "start", "model": model,
            **(found or {"unavailable": f"the child ended without a result (exit {child.exitcode})"})}


def _start_child(send: Any, device: str, model: str) -> None:
    from gcbench.models import build_model
    from gcbench.resolved import resolve
    from gcbench.spec import RunSpec

    # One CPU thread: GNU OpenMP is not fork-safe, and a child forked from a process that ran a parallel region (a
    # test before, or a caller's own CPU work) hangs in its first one. What it times runs on the card.
    torch.set_num_threads(1)
    try:
        configs = [resolve(RunSpec(model=model, seq_len=128, batch_size=1, policy="none", device="cpu",
                                   layers=n)).model_config()[0] for n in (1, 1, 3)]
        begin = time.perf_counter()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
        context = time.perf_counter()
        a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.cuda.synchronize(device)
        cublas = time.perf_counter()
        builds = []
        for config in configs:
            at = time.perf_counter()
            built = build_model(config, device, torch.bfloat16)
            torch.cuda.synchronize(device)
            builds.append(time.perf_counter() - at)
            del built
        per_block = (builds[2] - builds[1]) / 2
        send.send({"context_s": context - begin, "cublas_s": cublas - context, "build_fixed_s": builds[0] - per_block,
                   "build_per_block_s": per_block})
    except Exception as e:  # noqa: BLE001 - said in the line instead of a number
        send.send({"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})


def _soak(dev: torch.device, seconds: float) -> None:
    """Large matmuls for `seconds`: the card's clocks settle where a sustained load holds them."""
    if seconds <= 0:
        return
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            torch.mm(a, a)
        torch.cuda.synchronize(dev)


def _device_ms(fn: Callable[[], Any], reps: int, rounds: int = 3) -> tuple[float, list[float]]:
    """Device milliseconds of one call of `fn`: CUDA events around `reps` back-to-back calls, the median of
    `rounds`, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples), samples


def _work(fn: Callable[[], Any]) -> dict[str, Any]:
    """What the time model counts for one call of `fn` (step_clock.StepClock on the real tensors)."""
    from gcbench.estimators.step_clock import StepClock
    from gcbench.estimators.step_time import HOST

    clock = StepClock()
    with clock:
        fn()
    items = clock.work().items
    return {"flops": float(items["flops"].sum()), "model_bytes": float(items["bytes"].sum()),
            "launches": int(items["launches"].sum()), "host_ops": int(sum(items[h].sum() for h in HOST)),
            "model_kinds": sorted({int(k) for k in items["kind"]})}


def _measured(head: dict, what: str, shape: dict, fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    ms, samples = _device_ms(fn, reps)
    return {**head, "what": what, **shape, **_work(fn), "ms": ms, "samples_ms": samples, **_clocks()}


def _clocks() -> dict[str, Any]:
    """The SM clock and power now (NVML), where readable."""
    from gcbench.instruments import gpu_state

    with contextlib.suppress(Exception):
        state = gpu_state(torch.cuda.current_device())
        if state:
            return {"sm_clock_mhz": state.get("sm_clock_mhz"), "power_w": state.get("power_w")}
    return {}


def _kernel_floor(head: dict, dev: torch.device, quick: bool) -> dict[str, Any]:
    """Device time per tiny kernel: 1000 queued behind matmuls long enough that the host has issued them all
    before the first runs."""
    tiny = torch.zeros(1, device=dev)
    a = torch.randn(256 if quick else 8192, 256 if quick else 8192, device=dev, dtype=torch.bfloat16)
    count = 50 if quick else 1000
    samples = []
    for _ in range(3):
        torch.cuda.synchronize(dev)
        for _ in range(2 if quick else 20):
            torch.mm(a, a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            tiny.add_(1)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / count)
    return {**head, "what": "kernel-floor", "kernels": count, "ms": statistics.median(samples),
            "samples_ms": samples}


def _attention(head: dict, dev: torch.device, shapes: list[tuple[int, ...]], reps: int) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        kernels["cudnn"] = SDPBackend.CUDNN_ATTENTION
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        for name, backend in kernels.items():
            def forward():
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=True)

            def both():
                forward().backward(grad)

            try:
                fwd = _measured(head, "attention", {"kernel": name, "direction": "forward", "batch": b, "heads": h,
                                                    "seq": s, "head_dim": d}, forward, reps)
                total = _measured(head, "attention", {"kernel": name, "direction": "forward+backward", "batch": b,
                                                      "heads": h, "seq": s, "head_dim": d}, both, reps)
            except RuntimeError as e:  # a kernel this card or build does not have
                out.append({**head, "what": "attention", "kernel": name, "unavailable": str(e).splitlines()[0][:200]})
                continue
            out += [fwd, total]
    return out


def _host_link(head: dict, dev: torch.device, size: int, reps: int) -> list[dict[str, Any]]:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device=dev)
    return [{**head, "what": "host-link", "direction": "to-device", "bytes": size,
             "ms": _device_ms(lambda: device.copy_(host, non_blocking=True), reps)[0]},
            {**head, "what": "host-link", "direction": "to-host", "bytes": size,
             "ms": _device_ms(lambda: host.copy_(device, non_blocking=True), reps)[0]}]


def _bitsandbytes(head: dict, dev: torch.device, quick: bool, reps: int) -> list[dict[str, Any]]:
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
    except ImportError:
        return [{**head, "what": "bitsandbytes", "unavailable": "bitsandbytes is not installed"}]
    shape = (64, 64) if quick else (11008, 4096)
    weight = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    out = [_measured(head, "dequant-4bit", {"m": shape[0], "k": shape[1]},
                     lambda: F.dequantize_4bit(packed, state), reps)]
    param = torch.nn.Parameter(torch.randn(*shape, device=dev, dtype=torch.bfloat16))
    param.grad = torch.randn_like(param)
    optimizer = bnb.optim.AdamW8bit([param], min_8bit_size=0)
    out.append(_measured(head, "adamw-8bit", {"m": shape[0], "k": shape[1]}, optimizer.step, reps))
    # the host's time per bitsandbytes call: a tiny weight, whose kernel is done long before the next call
    small, small_state = F.quantize_4bit(torch.randn(64, 64, device=dev, dtype=torch.bfloat16), quant_type="nf4",
                                         compress_statistics=True)
    out.append({**head, "what": "host-library", "calls": 200,
                "host_ms": _host_ms(lambda: F.dequantize_4bit(small, small_state), 200) / 200,
                **_work(lambda: F.dequantize_4bit(small, small_state))})
    return out


def _host_ms(fn: Callable[[], Any], calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e3


def _host_costs(head: dict, device: str, rounds: int) -> list[dict[str, Any]]:
    """Host milliseconds of a tiny model's forward, backward and optimizer step (each timed on the host, the
    device idle at its start and never behind: tiny kernels), beside the ops the time model counts for each; under
    `none` and under `sac`."""
    from gcbench.estimators.step_clock import StepClock
    from gcbench.estimators.step_time import HOST, PHASES
    from gcbench.models import build_model, find_blocks
    from gcbench.spec import RunSpec
    from gcbench.step import TrainingStep, make_batch, make_optimizer
    from gcbench.resolved import resolve

    out = []
    for policy in ("none", "sac"):
        spec = resolve(RunSpec(model="tiny-llama", seq_len=32, batch_size=1, policy=policy, device=device,
                               precision="bf16"))
        config, _ = spec.model_config()
        model = build_model(config, device, spec.param_dtype)
        spec.policy.apply(find_blocks(model))
        step = TrainingStep(model, make_optimizer(spec, model), make_batch(spec, config, device), spec)
        spec.policy.prepare(step)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        clock = StepClock()
        with clock:
            step(clock.marking(lambda phase: None))
        items = clock.work().items
        # each phase's own issuer (no recompute in either policy: sac recomputes inside the backward, as Python)
        counted = {name: {"host_ops": int(items[HOST[i]][items["phase"] == i].sum()),
                          "modes": int(items["modes"][items["phase"] == i].sum())} for i, name in enumerate(PHASES)}
        walls: dict[str, list[float]] = {name: [] for name in PHASES}
        for _ in range(rounds):
            torch.cuda.synchronize()
            stamps: list[tuple[str, float]] = []
            step(lambda phase: stamps.append((phase, time.perf_counter())))
            for (phase, at), (_, then) in zip(stamps, stamps[1:]):
                if phase in walls:
                    walls[phase].append((then - at) * 1e3)
        for name in PHASES:
            out.append({**head, "what": "host-ops", "policy": policy, "phase": name, **counted[name],
                        "host_ms": statistics.median(walls[name]) if walls[name] else None})
        del step, model
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gcbench.calibration", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON Lines file to write (replaced whole)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a check that it runs, no numbers")
    parser.add_argument("--soak", type=float, default=10.0, help="seconds of large matmuls first")
    args = parser.parse_args(argv)
    try:
        lines = calibrate(args.device, args.quick, args.soak, lambda text: print(f"calibration: {text}",
                                                                                 file=sys.stderr))
    except GcbenchError as e:
        print(f"gcbench: error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".part")
    partial.write_text("".join(json.dumps(line) + "\n" for line in lines))
    partial.replace(args.out)
    print(f"{len(lines)} measurements in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
