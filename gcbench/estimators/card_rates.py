"""What the step-time model (step_time.py) reads of a card: its datasheet (gpus.py) and how much of it each kind of
kernel reaches, from a calibration run on the card (calibrated.py, written from results/gpu/<gpu>/calibration.ndjson
by benchmarks/calibration.py), else from a stated default. No constant here is fitted to a step record or a
published step time: those are what the model is tested against (benchmarks/time_accuracy.py).

The defaults, and where each comes from:
- `gemm_fraction`: the card's MAMF over its dense peak where Bekman's table has the card (gpus.py: H100/H200 SXM
  0.803, A100 SXM 0.869, GH200 0.838, B200 0.776); else ASSUMED 0.75, a little below the lowest NVIDIA row.
- `pipeline_k`: ASSUMED 256: a matmul tile's mainloop steps through K 64 at a time, in a pipeline of about four
  stages that fills before the first step computes and drains after the last, so a tile costs about K + 256 steps'
  worth (a short-K matmul reaches less of the peak: K = 256 about half), and a K under 256 about 2K (the pipeline
  fills only as deep as K; such a matmul, a LoRA rank's, is bound by its bytes anyway). Held against XLA's published sm_90
  matmul table (xla/service/gpu/model/matmul_interpolator_data.h: 4096 x 4096 at K 256, 2048 and 4096 reached 392,
  763 and 783 TFLOPS; this gives 405, 721 and 762); a check, not a source of the number.
- `fp32_pipeline_k`: 16 for an fp32 matmul, which runs on the FP32 cores (SIMT), not the tensor cores: a SIMT tile
  steps through K 8 at a time in 2 stages (CUTLASS's default SIMT GEMM: threadblock 128 x 128 x 8, kStages 2;
  include/cutlass/gemm/device/default_gemm_configuration.h, DefaultGemmConfiguration<arch::OpClassSimt, ...>), so
  its pipeline fills after 16 steps' worth, not 256. A calibration measures the 16-bit pipeline only.
- `bandwidth_fraction`: ASSUMED 0.9 of the datasheet bandwidth for a streaming kernel (copies, elementwise,
  reductions), the host link and NVLink alike.
- `flash_fraction` (forward, backward), of the dense 16-bit peak, with FLOPs counted as FlashAttention-2 counts them
  (causal halved; the backward 2.5 times the forward): on sm80 and sm89 ASSUMED 0.6 and 0.45, below the 73% forward
  and 63% backward FlashAttention-2 reports on an A100 at its best (Dao 2023, section 4.1), for the shorter
  sequences training steps run; on sm90 ASSUMED 0.33 and 0.28: PyTorch's flash kernel is FlashAttention-2, which
  does not use Hopper's asynchronous tensor cores and reaches about a third of an H100's peak (FlashAttention-3,
  Shah et al. 2024, figure 5, its FlashAttention-2 baseline). The memory-efficient kernel ASSUMED at half flash's;
  cuDNN's on sm90 ASSUMED 0.5 and 0.4.
- `dequant_fraction`, `optimizer_8bit_fraction`: bitsandbytes' 4-bit dequantisation and 8-bit optimizer update
  ASSUMED at the bandwidth_fraction like any streaming kernel (their table lookups may make them slower: the
  calibration measures both).
- `kernel_floor_s`: ASSUMED 3 us of device time per kernel launch (a launch and an empty kernel): a tiny kernel's
  whole time, what a streaming kernel pays before its bytes, the least a matmul or attention kernel takes.
- host time per op issued, by who issues it: ASSUMED 12 us for the model's Python forward (module code, the
  dispatcher, the launch; a checkpoint's recompute inside the backward too), 6 us for autograd's C++ engine (the
  backward's own ops), 12 us for the optimizer's Python step (stepped in backward by a hook too); 30 us for
  bitsandbytes' Python around each of its kernels (quantisation state, checks, the nested absmax); 3 us for each
  further launch of a multi-tensor op; 25 us more for each op a policy's Python dispatch mode handles (SAC).
A calibration replaces every one of these with what the card (and its host) did: calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gcbench.gpus import NO_CARD, Gpu

ASSUMED_GEMM_FRACTION = 0.75
ASSUMED_BANDWIDTH_FRACTION = 0.9
ASSUMED_PIPELINE_K = 256
SIMT_PIPELINE_K = 16.0  # 2 stages x 8 (module docstring)
ASSUMED_FLASH = {9: (0.33, 0.28), 8: (0.6, 0.45)}  # by compute capability's major version
ASSUMED_CUDNN = {9: (0.5, 0.4)}
ASSUMED_KERNEL_FLOOR_S = 3e-6
ASSUMED_HOST_OP_S = (12e-6, 6e-6, 12e-6)  # Python forward, autograd's engine, optimizer (step_time.PHASES' order)
ASSUMED_HOST_LAUNCH_S = 3e-6
ASSUMED_HOST_MODE_S = 25e-6
ASSUMED_HOST_LIBRARY_S = 30e-6


@dataclass(frozen=True)
class Rates:
    """One card's rates for the time model: FLOP/s and bytes/s as the datasheet gives them, the fractions its
    kernels reach, and the host's costs; `basis` says which are measured and which assumed."""

    card: str
    tensor_flops: float  # dense 16-bit tensor-core peak
    fp32_flops: float
    bandwidth: float
    sms: int
    host_link: float
    interconnect: float | None
    gemm_fraction: float
    pipeline_k: float  # a tile costs K + this many steps' worth (module docstring)
    fp32_pipeline_k: float  # the same for an fp32 matmul's SIMT tiles
    bandwidth_fraction: float
    flash_fraction: tuple[float, float]  # (forward, backward): a Rates item picks by direction (step_time)
    efficient_fraction: tuple[float, float]
    cudnn_fraction: tuple[float, float]
    dequant_fraction: float  # of the bandwidth: bitsandbytes' 4-bit dequantisation
    optimizer_8bit_fraction: float  # and its 8-bit optimizer update
    kernel_floor_s: float
    host_op_s: tuple[float, float, float]  # per op issued, by issuer: Python forward, autograd, optimizer
    host_launch_s: float
    host_mode_s: float
    host_library_s: float  # bitsandbytes' Python around each of its kernels
    basis: str


def rates_for(gpu: Gpu | None) -> Rates | str:
    """The card's rates, or why there are none (no card, or a card whose datasheet figures gpus.py lacks)."""
    if gpu is None:
        return NO_CARD
    missing = [name for name in ("fp32_flops", "bandwidth", "sms", "host_link") if getattr(gpu, name) is None]
    if missing:
        return f"{gpu.name}'s datasheet figures are not in gpus.py ({', '.join(missing)})"
    major = gpu.capability[0] if gpu.capability else 9
    flash = ASSUMED_FLASH.get(major, ASSUMED_FLASH[8])
    rates = Rates(
        card=gpu.name, tensor_flops=gpu.peak_flops, fp32_flops=gpu.fp32_flops, bandwidth=gpu.bandwidth,
        sms=gpu.sms, host_link=gpu.host_link * ASSUMED_BANDWIDTH_FRACTION,
        interconnect=gpu.interconnect * ASSUMED_BANDWIDTH_FRACTION if gpu.interconnect else None,
        gemm_fraction=gpu.mamf / gpu.peak_flops if gpu.mamf else ASSUMED_GEMM_FRACTION,
        pipeline_k=ASSUMED_PIPELINE_K, fp32_pipeline_k=SIMT_PIPELINE_K,
        bandwidth_fraction=ASSUMED_BANDWIDTH_FRACTION, flash_fraction=flash,
        efficient_fraction=(flash[0] / 2, flash[1] / 2), cudnn_fraction=ASSUMED_CUDNN.get(major, flash),
        dequant_fraction=ASSUMED_BANDWIDTH_FRACTION, optimizer_8bit_fraction=ASSUMED_BANDWIDTH_FRACTION,
        kernel_floor_s=ASSUMED_KERNEL_FLOOR_S, host_op_s=ASSUMED_HOST_OP_S, host_launch_s=ASSUMED_HOST_LAUNCH_S,
        host_mode_s=ASSUMED_HOST_MODE_S, host_library_s=ASSUMED_HOST_LIBRARY_S,
        basis=f"{gpu.name}: datasheet; " + ("matmuls at its published MAMF; other kernel rates" if gpu.mamf
                                             else "kernel rates") + " and host costs assumed (no calibration on it)")
    from gcbench.estimators.calibrated import CALIBRATED

    measured = CALIBRATED.get(gpu.name)
    if measured is None:
        return rates
    return replace(rates, **{k: tuple(v) if isinstance(v, list) else v for k, v in measured["rates"].items()},
                   basis=f"{gpu.name}: datasheet and a calibration on the card ({measured['source']})")
