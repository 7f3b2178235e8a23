"""Step time, predicted op by op on the simulated step (simulate.py): `StepClock` watches the tracked step on fake
tensors and writes down what each op would make the card do (`StepWork`); `StepWork.time(rates)` then plays that
work on a card (card_rates.Rates) as the CUDA events around a measured step see it. See docs/methodology.md,
"Predicting step time". The clock is step_clock.py; this module is the work it writes down and its time on a
card.

What an op does, as the card does it:
- a matmul (mm, addmm, bmm, baddbmm, _grouped_mm): its FLOPs at the card's tensor-core rate (bf16, fp16) or its
  FP32 rate (fp32: PyTorch's default float32_matmul_precision "highest" uses no TF32), in waves of 128 x 128 output
  tiles over the SMs (a last wave that fills only some SMs costs a whole wave), each tile paying for its K
  pipeline (the tensor cores' deeper than fp32's SIMT one: card_rates.py), and never faster than its bytes;
- an SDPA kernel (flash, memory-efficient, cuDNN; forward and backward): its FLOPs, halved when causal (the
  kernels skip the masked blocks), at the rate that kernel reaches; the backward does 2.5 times the forward's
  matmul work (five matmuls to two, recompute included: FlashAttention-2, Dao 2023, section 3.1.2);
- anything else (elementwise, reductions, copies, the optimizer's foreach and fused kernels, bitsandbytes' 8-bit
  optimizer and 4-bit dequantisation): a kernel's fixed cost (the floor) and then its bytes read and written at
  the memory bandwidth. Inputs are read once
  (a broadcast dimension, stride 0, once), outputs and the arguments its schema marks as written are written;
  a pure write (zero_, fill_, copy_'s destination) is not read. A foreach or fused optimizer op launches one
  kernel per multi_tensor_apply chunk of tensors (MultiTensorApply.cuh);
- bitsandbytes' kernels (4-bit dequantisation, the 8-bit optimizer update) by their bytes too, at the rate each
  reaches (its own fraction of the bandwidth), with the host time of bitsandbytes' Python around each call; its
  4-bit matmul, past the fused kernel's rows, dequantises the whole weight and then runs an ordinary matmul
  (backends/cuda/ops.py, _dequant_linear_fallback): both are charged;
- an activation offloaded to pinned host memory (`offload`): its bytes over the host link, on the compute stream
  (save_on_cpu copies with non_blocking on the current stream);
- FSDP2's all-gather and reduce-scatter (c10d ops on the fake process group): their bytes over the interconnect
  as a ring moves them ((n-1)/n of the gathered size), on a stream of their own that overlaps compute; the copy-out
  of an all-gather waits for it, and the optimizer step waits for every reduce-scatter (FSDP2's post-backward).
Every op the dispatcher runs also costs host time (Python, the dispatcher, the launch): the host issues kernels in
order, a kernel starts when both it is issued and the one before it ended, and a value read back (.item()) waits
for the device. Views, metadata queries and allocations launch no kernel; an op on a host-resident tensor (AdamW's
step counts on CUDA) neither. A Python dispatch mode on the way (SAC's caching modes, which call gcbench's policy
function for every op: measure.note_python_dispatch) adds host time per op.

Parts reused and parts of its own: the FLOPs of ops other than the above come from torch's flop_registry
(torch/utils/flop_counter.py); the bytes rule follows torch/utils/_runtime_estimation.py (get_num_bytes: a stride-0
dimension read once), without its two defects: metadata queries (prim.device, sym_size, ...) cost nothing here
(it charges them as full tensor reads), and FLOPs are FLOPs (it halves them into MACs and then divides by 0.75 of
the peak, which is 150% of the peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gcbench.estimators.card_rates import Rates

# What one item of work is: a kernel (or a run of them) with the host work that issued it.
MEMORY, GEMM, ATTENTION, HOST_COPY, COLLECTIVE, SYNC, DEQUANT, OPTIMIZER_8BIT = range(8)
PHASES = ("forward", "backward", "optimizer")
_PHASE = {"forward": 0, "backward": 1, "optimizer": 2}
LOW, FP32 = 0, 1  # a matmul's input precision: 16-bit (tensor cores) | fp32 (the FP32 rate)
FLASH, EFFICIENT, CUDNN = 0, 1, 2  # an attention item's kernel (its variant: kernel x 2 + 1 for the backward)
# An item: its kind, phase, the issuer of its own op (0 Python forward code, 1 autograd's engine, 2 the optimizer), its
# matmul's input precision, its kernel (attention), FLOPs, bytes, kernel launches, a matmul's m, n, k and batch, the
# host ops issued since the item before (this one's included) by each issuer, Python dispatch-mode calls among them,
# and whether it waits for the collectives' stream.
WORK = np.dtype([("kind", "i1"), ("phase", "i1"), ("issuer", "i1"), ("dtype", "i1"), ("variant", "i1"),
                 ("flops", "f8"), ("bytes", "f8"), ("launches", "i4"), ("m", "i8"), ("n", "i8"), ("k", "i8"),
                 ("batch", "i8"), ("host_forward", "i4"), ("host_engine", "i4"), ("host_optimizer", "i4"),
                 ("modes", "i4"), ("waits", "i1")])
HOST = ("host_forward", "host_engine", "host_optimizer")  # host ops by issuer, as Rates.host_op_s orders them
TILE = 128  # cuBLAS's usual output tile edge for large 16-bit GEMMs (NVIDIA, "Matrix Multiplication Background")
@dataclass
class StepTime:
    """A step's predicted time on one card, in milliseconds, as CUDA events around the step measure it (the harness
    synchronizes before the step: the device starts idle)."""

    step_ms: float
    phase_ms: dict[str, float]  # the device time up to the end of each phase, less the phase before's
    host_ms: float  # the host's issuing time alone
    device_busy_ms: float  # the kernels' time alone
    basis: str  # where the card's rates come from (card_rates.Rates.basis)

    @property
    def host_bound(self) -> bool:
        """Whether the host, issuing kernels, sets the step's time (the device waits on it for most of the step)."""
        return self.device_busy_ms < 0.5 * self.step_ms


@dataclass
class StepWork:
    """What a simulated step makes the card do, card-independent: items (WORK) in issue order; or, for a model
    simulated from two short ones (layer_scaling.py), the two short ones' and the block count."""

    items: np.ndarray = field(default_factory=lambda: np.zeros(0, WORK))
    scaled_from: tuple[StepWork, StepWork] | None = None
    blocks: int = 0
    short: tuple[int, int] = (3, 4)

    def time(self, rates: Rates) -> StepTime:
        """The step played on the card `rates` describes."""
        if self.scaled_from is not None:  # each item of a block repeats per block: a line in the blocks
            a, b = (w.time(rates) for w in self.scaled_from)
            k = self.blocks - self.short[0]
            line = lambda x, y: x + k * (y - x)  # noqa: E731
            return StepTime(line(a.step_ms, b.step_ms), {p: line(a.phase_ms[p], b.phase_ms[p]) for p in a.phase_ms},
                            line(a.host_ms, b.host_ms), line(a.device_busy_ms, b.device_busy_ms), a.basis)
        return _play(self.items, rates)

    @property
    def host_ops(self) -> int:
        """Ops the host issues in the step (kernels or not)."""
        if self.scaled_from is not None:
            a, b = self.scaled_from
            return a.host_ops + (self.blocks - self.short[0]) * (b.host_ops - a.host_ops)
        return int(sum(self.items[name].sum() for name in HOST))

    @property
    def kernels(self) -> int:
        if self.scaled_from is not None:
            a, b = self.scaled_from
            return a.kernels + (self.blocks - self.short[0]) * (b.kernels - a.kernels)
        return int(self.items["launches"].sum())


def _play(items: np.ndarray, rates: Rates) -> StepTime:
    """The host issues each item after its host time; the compute stream runs it once issued and free; collectives
    run on their own stream; a SYNC makes the host wait for the device."""
    device = _device_seconds(items, rates)
    library = (items["kind"] == DEQUANT) | (items["kind"] == OPTIMIZER_8BIT)  # bitsandbytes' Python around its kernel
    host_each = (sum(items[name] * per_op for name, per_op in zip(HOST, rates.host_op_s))
                 + np.maximum(items["launches"] - 1, 0) * rates.host_launch_s + items["modes"] * rates.host_mode_s
                 + library * rates.host_library_s)
    host = compute = comm = 0.0
    ends = [0.0, 0.0, 0.0]
    phase_before = 0
    for kind, phase, waits, h, d in zip(items["kind"].tolist(), items["phase"].tolist(), items["waits"].tolist(),
                                        host_each.tolist(), device.tolist()):
        if phase != phase_before:
            for p in range(phase_before, phase):
                ends[p] = compute
            if phase == _PHASE["optimizer"]:  # FSDP2's post-backward waits for every reduce-scatter
                compute = max(compute, comm)
            phase_before = phase
        host += h
        if kind == SYNC:
            host = max(host, compute)
            continue
        if kind == COLLECTIVE:
            comm = max(comm, host) + d
            continue
        start = max(compute, host)
        if waits:
            start = max(start, comm)
        compute = start + d
    for p in range(phase_before, 3):
        ends[p] = compute
    end = max(compute, comm)
    phase_ms = {name: (ends[i] - (ends[i - 1] if i else 0.0)) * 1e3 for i, name in enumerate(PHASES)}
    return StepTime(end * 1e3, phase_ms, host * 1e3, float(device.sum()) * 1e3, rates.basis)


def _device_seconds(items: np.ndarray, r: Rates) -> np.ndarray:
    """Each item's time on the device, in seconds (at least a kernel floor per launch)."""
    kind = items["kind"]
    memory_s = items["bytes"] / (r.bandwidth * r.bandwidth_fraction)
    peak = np.where(items["dtype"] == LOW, r.tensor_flops, r.fp32_flops) * r.gemm_fraction
    tiles = np.ceil(items["m"] / TILE) * np.ceil(items["n"] / TILE) * np.maximum(items["batch"], 1)
    waves = np.maximum(np.ceil(tiles / r.sms), 1)
    filled = np.where(tiles > 0, tiles / (waves * r.sms), 1.0)
    # a tile's mainloop runs K in 64-deep steps (8-deep on fp32's SIMT cores) through a pipeline it must fill and
    # drain first: a tile costs about K + pipeline_k (card_rates.py), and a K shorter than the pipeline fills only
    # as deep as K
    k = items["k"].astype(float)
    pipeline = np.where(items["dtype"] == LOW, r.pipeline_k, r.fp32_pipeline_k)
    depth = np.divide(k, k + np.minimum(k, pipeline), out=np.ones_like(k), where=k > 0)
    gemm_s = np.maximum(items["flops"] / (peak * filled * depth), memory_s)
    # an attention item's variant: its kernel x 2 + 1 for the backward
    fractions = np.array([*r.flash_fraction, *r.efficient_fraction, *r.cudnn_fraction])
    attention_s = items["flops"] / (r.tensor_flops * fractions[np.clip(items["variant"], 0, 5)])
    copy_s = items["bytes"] / r.host_link
    link = r.interconnect if r.interconnect else r.bandwidth * r.bandwidth_fraction
    collective_s = items["bytes"] / link
    dequant_s = items["bytes"] / (r.bandwidth * r.dequant_fraction)
    optimizer_8bit_s = items["bytes"] / (r.bandwidth * r.optimizer_8bit_fraction)
    seconds = np.select([kind == GEMM, kind == ATTENTION, kind == HOST_COPY, kind == COLLECTIVE, kind == SYNC,
                         kind == DEQUANT, kind == OPTIMIZER_8BIT],
                        [gemm_s, attention_s, copy_s, collective_s, 0.0, dequant_s, optimizer_8bit_s], memory_s)
    # A streaming kernel pays a fixed cost (its launch on the device, the first wave of blocks, the drain) and then
    # its bytes: the latency-bandwidth model, t = floor + bytes / bandwidth, whose two terms the calibration measures
    # apart (an empty kernel back to back; copies of 256 MiB). A matmul's and an attention kernel's fractions are
    # read off whole kernels, their fixed cost inside: those are held to the floor only.
    floor = items["launches"] * r.kernel_floor_s
    streaming = (kind == MEMORY) | (kind == DEQUANT) | (kind == OPTIMIZER_8BIT)
    return np.where(kind == SYNC, 0.0, np.where(streaming, seconds + floor, np.maximum(seconds, floor)))


def time_fields(work: StepWork | None, tokens: int, card, method: str = "simulate") -> dict:
    """What an estimate row or a record carries of the step's time on `card` (a gpus.Gpu, or None): the predicted
    step time and tokens/s and where the card's rates come from; or, where there is none, why
    (`time_not_available`), never a guess. `work`: the simulated step's (whichever method predicted the row's
    memory); `tokens`: the step's (batch x seq x accumulation)."""
    from gcbench.estimators.card_rates import rates_for

    rates = rates_for(card)
    reason = rates if isinstance(rates, str) else None
    if reason is None and work is None:
        reason = "the analytic formulas predict memory only (--method simulate predicts the time too)" \
            if method == "analytic" else "not simulated op by op for a CUDA card"
    if reason is not None:
        return {"predicted_step_ms": None, "predicted_tokens_per_s": None, "time_not_available": reason}
    step = work.time(rates)
    return {"predicted_step_ms": step.step_ms, "predicted_tokens_per_s": tokens / (step.step_ms / 1e3),
            "predicted_host_bound": step.host_bound, "time_basis": step.basis}


def grid_time_fields(cells: list[tuple], gpu_name: str | None, target: str) -> list[dict]:
    """time_fields of each cell of an estimate grid ((spec, Estimate or Unavailable) pairs) on the card --gpu
    names: the step's work, which the time follows, is the simulation's whichever method predicted the cell's
    memory. Nothing for a CPU target (CPU step time is not predicted)."""
    from gcbench.gpus import gpu

    if target != "cuda":
        return [{} for _ in cells]
    card = gpu(gpu_name) if gpu_name else None
    work = {spec: e.work for spec, e in cells if getattr(e, "work", None) is not None}
    return [time_fields(work.get(spec), spec.batch_size * spec.seq_len * spec.grad_accum, card, e.method)
            for spec, e in cells]
