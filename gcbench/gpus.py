"""GPUs gcbench knows by name: their memory and dense bf16 peak, for `gcbench estimate --fit --gpu NAME` (a card
one does not have) and for MFU (the peak of the card a run is on). Importing this module is cheap (no torch).

Where each number comes from:
- `memory_mib`: the total memory `nvidia-smi` reports for the board (MiB), as NVIDIA's board, which is what the
  driver exposes after ECC and its own reservations (a few hundred MiB below the marketing size).
- `cuda_bytes`: where gcbench has measured the card, the total CUDA itself reports (cudaMemGetInfo, as
  torch.cuda.mem_get_info()): the memory a process can have, below nvidia-smi's total by what the driver keeps
  (615 MiB on the H200). benchmarks/gpu/cuda_context.py measures it (results/gpu/<gpu>/cuda-context.txt).
- `CUDA_CONTEXT_BYTES`: what a PyTorch process's CUDA context takes before the first tensor (CUDA 12 with lazy
  module loading, the default). An assumption, not a measurement of gcbench's: `gcbench fit` on a GPU reads the
  device's real free memory instead, and benchmarks/gpu/cuda_context.py measures it on the card it runs on;
  where it has (`context_bytes`), that reading is used: the memory outside the allocator once a bf16 matmul has
  run forward and backward (the context and cuBLAS's code for both threads, which every training step loads).
- `cublas_workspace_bytes`: what cuBLAS takes inside the caching allocator (so max_memory_allocated counts it, the
  step's own tensors do not): PyTorch allocates one workspace per (cuBLAS handle, stream) through the caching
  allocator (aten/src/ATen/cuda/CublasHandlePool.cpp, getNewWorkspace), of CUBLAS_WORKSPACE_CONFIG's size, by
  default 4096 KiB x 8 = 32 MiB on sm90 (Hopper) and 4096 KiB x 2 + 16 KiB x 8 elsewhere; handles are per thread,
  and a training step runs matmuls on two: the forward in the caller's, the backward in autograd's device thread.
- `peak_flops`: dense bf16 tensor-core FLOP/s with FP32 accumulation, no sparsity, from NVIDIA's datasheets
  (the URL beside each). The MFU of an amp-fp16 run uses it too: each of these datasheets gives the same dense
  FP16 rate as BF16 (e.g. H100 SXM 989 TFLOPS both, A100 312 both; GeForce RTX 4090: FP16 with FP32 accumulate
  165.2, as BF16).
- What the step-time model reads (estimators/card_rates.py), from the same datasheets: `fp32_flops` (FP32 on the
  CUDA cores, no tensor cores: what an fp32 matmul runs at under PyTorch's default "highest" float32 matmul
  precision), `bandwidth` (memory, bytes/s), `sms` (streaming multiprocessors, from NVIDIA's architecture
  whitepapers), `host_link` (PCIe per direction: Gen5 x16 64 GB/s, Gen4 32, Gen3 16; a datasheet's
  "128 GB/s" is both directions; GH200's NVLink-C2C 450 GB/s each way) and `interconnect` (NVLink per direction:
  half the datasheet's bidirectional figure; None where the board has none).
- `mamf`: the most bf16 matmul FLOP/s PyTorch reached on the card by a brute-force search of shapes (Stas
  Bekman, "Maximum Achievable Matmul FLOPS comparison table", ml-engineering/compute/accelerator/README.md: A100
  SXM 271.2, GH200 828.6, H100 SXM 794.5 TFLOPS, "H200 is the same", B200 1745.0): a calibration run on the card
  by others, where gcbench has none of its own. None where the table has no row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gcbench.errors import GcbenchError

CUDA_CONTEXT_BYTES = 512 * 2**20
NO_CARD = "name a GPU (--gpu NAME) to predict it on"  # why a CUDA prediction has no step time
CUBLAS_THREADS = 2  # the forward's thread and autograd's device thread each get a cuBLAS handle and its workspace


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """One cuBLAS workspace as PyTorch sizes it by default for a GPU of this compute capability (None: unknown,
    the larger Hopper size)."""
    if capability is None or capability[0] == 9:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class Gpu:
    name: str  # as --gpu takes it
    board: str  # what torch.cuda.get_device_name() says contains `match`
    match: str  # matched against the device name (first match in GPUS wins)
    memory_mib: int | None  # nvidia-smi's total; None: the name is matched for its peak only
    peak_flops: float
    source: str
    capability: tuple[int, int] | None = None  # CUDA compute capability (sm90: (9, 0))
    cuda_bytes: int | None = None  # CUDA's total, where measured; else nvidia-smi's stands in
    context_bytes: int | None = None  # outside the allocator after a matmul forward and backward, where measured
    fp32_flops: float | None = None  # FP32 on the CUDA cores (datasheet)
    bandwidth: float | None = None  # memory bandwidth, bytes/s (datasheet)
    sms: int | None = None
    host_link: float | None = None  # bytes/s per direction
    interconnect: float | None = None  # NVLink, bytes/s per direction
    mamf: float | None = None  # measured maximum bf16 matmul FLOP/s (module docstring)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_mib is None else self.memory_mib * 2**20

    @property
    def context(self) -> int:
        return CUDA_CONTEXT_BYTES if self.context_bytes is None else self.context_bytes

    def budget_words(self) -> str:
        """Where usable_bytes comes from, for a caption."""
        from gcbench.units import fmt_bytes

        total = f"{self.memory_mib:,} MiB (nvidia-smi's total)" if self.cuda_bytes is None else \
            f"{fmt_bytes(self.cuda_bytes)} (CUDA's total, measured)"
        context = "CUDA context (assumed)" if self.context_bytes is None else \
            "CUDA context and cuBLAS code (measured)"
        return (f"{self.name}: {total} less {fmt_bytes(self.context)} of {context} and "
                f"{fmt_bytes(self.workspace_bytes)} of cuBLAS workspaces")

    @property
    def workspace_bytes(self) -> int:
        """The cuBLAS workspaces a training step allocates on this card (counted by max_memory_allocated)."""
        return workspaces_on(self)

    @property
    def usable_bytes(self) -> int | None:
        """Memory a training step's own tensors can take: the total minus the CUDA context and cuBLAS's
        workspaces (predictions count the step's tensors only)."""
        if self.memory_mib is None:
            return None
        return (self.cuda_bytes or self.memory_bytes) - self.context - self.workspace_bytes


# Order matters for matching a device name: the more specific names first ("H100 PCIe" before "H100", "GH200"
# before "H200").
GPUS: list[Gpu] = [
    # the 144 GB HBM3e board's 4.9 TB/s (the 96 GB HBM3 one has 4 TB/s)
    Gpu("gh200", "NVIDIA GH200", "GH200", None, 989e12,
        "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/", (9, 0), fp32_flops=67e12,
        bandwidth=4.9e12, sms=132, host_link=450e9, interconnect=450e9, mamf=828.6e12),
    # Measured on one (driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0). CUDA's total: cuda-context.txt in
    # results/gpu/nvidia-h200/. The context: what a process held outside the allocator once it had run a bf16
    # matmul forward and backward, the fit's probe (instruments.free_after_context): CUDA's total less the
    # fit_budget_bytes of fit.jsonl there. cuda_context.py read 594.81 MiB after the forward alone: autograd's
    # thread, which runs the backward's matmuls, adds the other 154 MiB (its own cuBLAS handle, presumably).
    Gpu("h200-141gb", "NVIDIA H200", "H200", 143_771, 989e12,
        "https://www.nvidia.com/en-us/data-center/h200/", (9, 0), cuda_bytes=150_109_880_320,
        context_bytes=150_109_880_320 - 149_324_693_504, fp32_flops=67e12, bandwidth=4.8e12, sms=132,
        host_link=64e9, interconnect=450e9, mamf=794.5e12),
    Gpu("h100-pcie-80gb", "NVIDIA H100 PCIe", "H100 PCIe", 81_559, 756e12,
        "https://www.nvidia.com/en-us/data-center/h100/", (9, 0), fp32_flops=51e12, bandwidth=2.0e12, sms=114,
        host_link=64e9, interconnect=300e9),
    Gpu("h100-nvl", "NVIDIA H100 NVL", "H100 NVL", None, 835e12,
        "https://www.nvidia.com/en-us/data-center/h100/", (9, 0), fp32_flops=60e12, bandwidth=3.9e12, sms=132,
        host_link=64e9, interconnect=300e9),
    Gpu("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM)", "H100", 81_559, 989e12,
        "https://www.nvidia.com/en-us/data-center/h100/", (9, 0), fp32_flops=67e12, bandwidth=3.35e12, sms=132,
        host_link=64e9, interconnect=450e9, mamf=794.5e12),
    # HGX B200 (8 GPUs): FP32 600 TFLOPS, 64 TB/s, NVLink 1.8 TB/s per GPU: per GPU 75 TFLOPS, 8 TB/s
    Gpu("b200", "NVIDIA B200", "B200", None, 2250e12, "https://www.nvidia.com/en-us/data-center/dgx-b200/", (10, 0),
        fp32_flops=75e12, bandwidth=8e12, sms=148, host_link=64e9, interconnect=900e9, mamf=1745.0e12),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB", 81_920, 312e12,
        "https://www.nvidia.com/en-us/data-center/a100/", (8, 0), fp32_flops=19.5e12, bandwidth=2.039e12, sms=108,
        host_link=32e9, interconnect=300e9, mamf=271.2e12),
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", "A100", 40_960, 312e12,
        "https://www.nvidia.com/en-us/data-center/a100/", (8, 0), fp32_flops=19.5e12, bandwidth=1.555e12, sms=108,
        host_link=32e9, interconnect=300e9, mamf=271.2e12),
    # the 80 GB SXM board (NVLink 400 GB/s both ways)
    Gpu("a800", "NVIDIA A800", "A800", None, 312e12, "https://www.nvidia.com/en-us/data-center/a800/", (8, 0),
        fp32_flops=19.5e12, bandwidth=2.039e12, sms=108, host_link=32e9, interconnect=200e9),
    Gpu("l40s-48gb", "NVIDIA L40S", "L40S", 46_068, 362e12, "https://www.nvidia.com/en-us/data-center/l40s/", (8, 9),
        fp32_flops=91.6e12, bandwidth=864e9, sms=142, host_link=32e9),
    Gpu("l40", "NVIDIA L40", "L40", None, 181e12, "https://www.nvidia.com/en-us/data-center/l40/", (8, 9),
        fp32_flops=90.5e12, bandwidth=864e9, sms=142, host_link=32e9),
    Gpu("l4-24gb", "NVIDIA L4", "L4", 23_034, 121e12, "https://www.nvidia.com/en-us/data-center/l4/", (8, 9),
        fp32_flops=30.3e12, bandwidth=300e9, sms=58, host_link=32e9),
    Gpu("a10", "NVIDIA A10", "A10", None, 125e12, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
        (8, 6), fp32_flops=31.2e12, bandwidth=600e9, sms=72, host_link=32e9),
    # Matched by name only (its cuBLAS workspaces and peak for a run on one, the published V100 rows), not offered
    # to --gpu: gcbench's SDPA kernel choice (estimators/shape.py) assumes flash attention for 16-bit runs, which
    # needs sm80 or newer. No bf16 tensor cores: the peak is the FP16 tensor rate (125 TFLOPS on the SXM2 board),
    # which an amp-fp16 run can reach.
    Gpu("v100", "Tesla V100-SXM2-16GB", "V100-SXM2", None, 125e12,
        "https://www.nvidia.com/en-us/data-center/v100/", (7, 0), fp32_flops=15.7e12, bandwidth=900e9, sms=80,
        host_link=16e9, interconnect=150e9),
    # Matched by name only, for the published speed rows run on one (benchmarks/published/speed.toml). GA102 with all
    # 84 SMs (10,752 CUDA cores) at a 1.86 GHz boost, 21 Gbps GDDR6X on 384 bits (1008 GB/s), PCIe 4.0 x16: NVIDIA's
    # RTX 3090 Ti specifications (nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/, launch
    # announcement of 29 Mar 2022); its 16-bit tensor rate with FP32 accumulate (what PyTorch's matmuls use) is
    # GA102's 512 FLOP per SM and clock (the GA102 whitepaper, source below: the RTX 3090's 71 TFLOPS at 82 SMs and
    # 1.695 GHz): 84 x 1.86e9 x 512 = 80 TFLOPS; FP32 84 x 128 FMA x 2 x 1.86e9 = 40 TFLOPS.
    Gpu("rtx3090ti", "NVIDIA GeForce RTX 3090 Ti", "RTX 3090 Ti", None, 80.0e12,
        "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf", (8, 6),
        fp32_flops=40.0e12, bandwidth=1008e9, sms=84, host_link=32e9),
    Gpu("rtx4090-24gb", "NVIDIA GeForce RTX 4090", "RTX 4090", 24_564, 165.2e12,
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf", (8, 9),
        fp32_flops=82.6e12, bandwidth=1008e9, sms=128, host_link=32e9),
]


def gpu(name: str) -> Gpu:
    """The table's entry for --gpu NAME (one with a memory size): its own name, or the leading words of it where
    they name one card alone, in any case, with or without "nvidia" before them (h200, H200, nvidia-h200 and
    "NVIDIA H200" are h200-141gb, as results/gpu/ and nvidia-smi name it; h100 is two cards and is refused, naming
    both), or its name and more words ("NVIDIA H100 80GB HBM3", but not a PCIe or NVL board's: "NVIDIA A100 80GB
    PCIe" is not the SXM a100-80gb); GcbenchError naming the known ones."""
    known = [g for g in GPUS if g.memory_mib is not None]
    if "," in name:
        raise GcbenchError(f"--gpu takes one card, got {name!r}: give each card a command of its own")
    # nvidia-smi's and torch's names too: "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3" (a name and more),
    # "NVIDIA A100-SXM4-80GB" (the entries without a form factor in their name are the SXM boards)
    words = re.split(r"[\s_-]+", re.sub(r"\brtx[\s_-]+(?=\d)", "rtx", name.strip().lower()))
    words = [w for w in words if w not in ("nvidia", "geforce") and not re.fullmatch(r"sxm\d?", w)] or words
    found = [g for g in known if g.name.split("-")[:len(words)] == words] or \
        [g for g in known if words[:len(g.name.split("-"))] == g.name.split("-")
         and not {"pcie", "nvl"} & set(words[len(g.name.split("-")):])]  # more words, not another board's
    exact = [g for g in found if g.name == "-".join(words)]
    if exact or len(found) == 1:
        return (exact or found)[0]
    if found:
        raise GcbenchError(f"--gpu {name!r} names {len(found)} cards: {', '.join(g.name for g in found)}; give one")
    raise GcbenchError(f"unknown --gpu {name!r}; known: {', '.join(g.name for g in known)} (or give --gpu-memory)")


def workspaces_on(card: Gpu | None) -> int:
    """The cuBLAS workspaces a training step holds in the caching allocator on `card`; None: a card known by its
    memory only (--gpu-memory), taken as Hopper's, the larger size."""
    return CUBLAS_THREADS * cublas_workspace_bytes(card.capability if card is not None else None)


def max_memory_reserved(replayed: int, card: Gpu | None) -> int:
    """What torch.cuda.max_memory_reserved reads for a step whose replayed caching allocator (the step's own
    tensors) peaked at `replayed` bytes: that plus the cuBLAS workspaces, which PyTorch allocates through the same
    allocator (CublasHandlePool.cpp) and keeps to the end. The one place a prediction of reserved memory adds them
    (estimate, estimate --fit, benchmarks/published/check.py); budgets take them off the card's memory instead."""
    return replayed + workspaces_on(card)


def memory_to_fit(gpu_name: str | None, memory: int | None) -> int | None:
    """What `estimate`'s fits column holds a peak against: --gpu-memory as given, or --gpu NAME's usable bytes
    (its total less the CUDA context and cuBLAS workspaces, as --fit budgets it); one of them at most."""
    if gpu_name is None:
        return memory
    if memory is not None:
        raise GcbenchError("--gpu and --gpu-memory both name the memory to fit in: give one of them")
    return gpu(gpu_name).usable_bytes


def matching(device_name: str) -> Gpu | None:
    """The table's entry of the card torch.cuda.get_device_name() names (it may have no memory size), or None."""
    return next((g for g in GPUS if g.match in device_name), None)


def for_device(device_name: str, total_bytes: int) -> Gpu | None:
    """The table's entry for a device at hand: its name matches and its memory is the device's total (within 1%),
    so that `estimate --fit --gpu` predicts for the same memory; None otherwise (an 80 GB PCIe A100 is not the
    40 GB entry "A100" matches)."""
    g = matching(device_name)
    if g is None or g.memory_bytes is None:
        return None
    total = g.cuda_bytes or g.memory_bytes  # torch reports CUDA's total; nvidia-smi's stands in where unmeasured
    return g if abs(total - total_bytes) <= 0.01 * total_bytes else None


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of the card torch.cuda.get_device_name() names, or None when unknown."""
    g = matching(device_name)
    return g.peak_flops if g else None
