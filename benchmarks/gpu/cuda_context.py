"""The memory a PyTorch process takes on a GPU beside a step's own tensors: the CUDA context (outside the caching
allocator), then what the first bf16 matmuls add: cuBLAS's code outside the allocator, and its workspaces inside it
(one per thread that runs matmuls: the forward's, then autograd's device thread in the backward), which
max_memory_allocated counts. `gcbench estimate --fit --gpu NAME` takes the context from gcbench.gpus (a card's
measured `context_bytes` where this has run on it, else CUDA_CONTEXT_BYTES assumed) and Gpu.workspace_bytes; this
measures both on the card at hand, and CUDA's total (`cuda_bytes`). Prints a line per reading and one JSON line.

    python benchmarks/gpu/cuda_context.py        # on a GPU nothing else uses
"""

from __future__ import annotations

import json

import torch

from gcbench.gpus import CUDA_CONTEXT_BYTES, CUBLAS_THREADS, cublas_workspace_bytes
from gcbench.units import fmt_bytes


def outside_allocator() -> int:
    """Device memory in use (by anyone) less what this process's caching allocator holds."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def main() -> None:
    torch.cuda.init()
    context = outside_allocator()  # mem_get_info creates the context (lazy module loading: no kernels yet)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tensors = torch.cuda.memory_allocated()
    b = a @ a  # the forward's thread: cuBLAS loads, its handle gets a workspace from the caching allocator
    torch.cuda.synchronize()
    forward_workspace = torch.cuda.memory_allocated() - tensors - b.untyped_storage().nbytes()
    after_matmul = outside_allocator()
    tensors = torch.cuda.memory_allocated()
    b.sum().backward()  # autograd's device thread runs the backward matmuls: a second handle, a second workspace
    torch.cuda.synchronize()
    backward_workspace = torch.cuda.memory_allocated() - tensors - a.grad.untyped_storage().nbytes()
    after_backward = outside_allocator()  # autograd's thread loaded cuBLAS for itself too
    total = torch.cuda.mem_get_info()[1]
    capability = torch.cuda.get_device_capability()
    assumed_workspace = CUBLAS_THREADS * cublas_workspace_bytes(capability)
    print(f"device: {torch.cuda.get_device_name()} (sm{capability[0]}{capability[1]}), total {fmt_bytes(total)}")
    print(f"outside the allocator after the context: {fmt_bytes(context)}")
    print(f"outside the allocator after a bf16 matmul: {fmt_bytes(after_matmul)}")
    print(f"outside the allocator after its backward: {fmt_bytes(after_backward)}")
    print(f"cuBLAS workspace allocated by the forward's matmul: {fmt_bytes(forward_workspace)}")
    print(f"cuBLAS workspace allocated by the backward's matmuls: {fmt_bytes(backward_workspace)}")
    print(f"gcbench.gpus assumes: context {fmt_bytes(CUDA_CONTEXT_BYTES)}, workspaces {fmt_bytes(assumed_workspace)}")
    print(json.dumps({"device": torch.cuda.get_device_name(), "total_bytes": total, "context_bytes": context,
                      "after_matmul_bytes": after_matmul, "after_backward_bytes": after_backward,
                      "assumed_bytes": CUDA_CONTEXT_BYTES,
                      "forward_workspace_bytes": forward_workspace, "backward_workspace_bytes": backward_workspace,
                      "assumed_workspace_bytes": assumed_workspace}))


if __name__ == "__main__":
    main()
