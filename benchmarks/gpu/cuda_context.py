"""The memory a PyTorch process takes on a GPU outside its caching allocator: the CUDA context, then what the
first bf16 matmul's libraries (cuBLAS) add. `gcbench estimate --fit --gpu NAME` assumes gcbench.gpus
.CUDA_CONTEXT_BYTES; this measures it on the card at hand. Prints a line per reading and one JSON line.

    python benchmarks/gpu/cuda_context.py        # on a GPU nothing else uses
"""

from __future__ import annotations

import json

import torch

from gcbench.gpus import CUDA_CONTEXT_BYTES
from gcbench.units import fmt_bytes


def outside_allocator() -> int:
    """Device memory in use (by anyone) less what this process's caching allocator holds."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def main() -> None:
    torch.cuda.init()
    context = outside_allocator()  # mem_get_info creates the context (lazy module loading: no kernels yet)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # loads cuBLAS and the kernels a training step starts with
    after_matmul = outside_allocator()
    total = torch.cuda.mem_get_info()[1]
    print(f"device: {torch.cuda.get_device_name()}, total {fmt_bytes(total)}")
    print(f"outside the allocator after the context: {fmt_bytes(context)}")
    print(f"outside the allocator after a bf16 matmul: {fmt_bytes(after_matmul)}")
    print(f"gcbench.gpus assumes: {fmt_bytes(CUDA_CONTEXT_BYTES)}")
    print(json.dumps({"device": torch.cuda.get_device_name(), "total_bytes": total, "context_bytes": context,
                      "after_matmul_bytes": after_matmul, "assumed_bytes": CUDA_CONTEXT_BYTES}))


if __name__ == "__main__":
    main()
