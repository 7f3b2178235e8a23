"""`offload`: activations to host memory (save_on_cpu, pinned on CUDA), either a checkpointed block's input or all
a block saves, for every k-th block. Semantics and sources: docs/policies.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gcbench.measure import checkpoint, moved_to_host
from gcbench.policies.base import Policy, StandsFor, option, register
from gcbench.policies.classic import EveryK

if TYPE_CHECKING:
    from gcbench.step import TrainingStep


class HostOffload(torch.autograd.graph.save_on_cpu):
    """save_on_cpu that counts the bytes it moves to host memory and leaves parameters on the device.

    Parameters (e.g. a Linear's weight, saved for the input gradient) are model state that stays on the device anyway;
    plain save_on_cpu would copy every block's weights to the host on every step.
    """

    def __init__(self, pin_memory: bool, keep_storages: set[int]):  # ids of the storages that stay
        super().__init__(pin_memory=pin_memory)
        to_host, from_host = self.pack_hook, self.unpack_hook
        self.offloaded_bytes = 0

        def pack(t: torch.Tensor):
            if id(t.untyped_storage()) in keep_storages:
                return False, t
            # The saved-bytes recording cannot see what leaves the device: only this hook knows these bytes.
            self.offloaded_bytes += t.numel() * t.element_size()  # each save is its own host copy
            moved_to_host(t)
            return True, to_host(t)

        def unpack(packed):
            on_host, payload = packed
            if not on_host:
                return payload
            t = from_host(payload)
            moved_to_host(t, back=True)
            return t

        self.pack_hook, self.unpack_hook = pack, unpack


class OffloadedBlock(StandsFor):
    """One block whose saved tensors go to host memory: its input only (checkpointed) or all it saves."""

    def __init__(self, block: nn.Module, checkpointed: bool):
        super().__init__(block)
        self.block, self.checkpointed = block, checkpointed
        self.offloaded_bytes = 0  # host bytes of the last forward
        # By storage identity (kept while the storage lives), not data pointer: fake tensors all point at 0.
        self._param_storages = {id(p.untyped_storage()) for p in block.parameters()}
        # Pinned host memory makes the device-to-host copy a DMA; it only exists next to a CUDA device.
        # Set by Offload.prepare from the run's device.
        self.pin_memory = False

    def forward(self, hidden_states, *args, **kwargs):
        offload = HostOffload(self.pin_memory, self._param_storages)
        with offload:
            if self.checkpointed:  # the checkpoint saves its inputs under our hooks, its internals under its own
                out = checkpoint(self.block, hidden_states, *args, use_reentrant=False, **kwargs)
            else:
                out = self.block(hidden_states, *args, **kwargs)
        self.offloaded_bytes = offload.offloaded_bytes
        return out


@register("offload")
class Offload(Policy):
    summary = ("activations to host memory (save_on_cpu, pinned on CUDA): what=inputs checkpoints the block and "
               "offloads its input, what=all offloads everything it saves; k>1 does this for every k-th block only")
    what: str = option("inputs", "inputs: checkpoint + offload the block input | all: offload all the block saves",
                       choices=("inputs", "all"))
    k: int = option(1, "offload every k-th block (1..N); with what=inputs this is every-k with offloaded inputs",
                    blocks=True)


    def groups(self, n_blocks: int) -> list[range]:
        return EveryK(k=self.k).groups(n_blocks)

    def wrap_group(self, group: list[nn.Module]) -> nn.Module:
        return OffloadedBlock(group[0], checkpointed=self.what == "inputs")

    def prepare(self, step: TrainingStep) -> None:
        """Pin host memory on a CUDA run."""
        for block in _offloaded_blocks(step.model):
            block.pin_memory = step.device.type == "cuda"

    def offloaded_bytes(self, model: nn.Module) -> int:
        return sum(block.offloaded_bytes for block in _offloaded_blocks(model))


def _offloaded_blocks(model: nn.Module) -> list[OffloadedBlock]:
    return [m for m in model.modules() if isinstance(m, OffloadedBlock)]
