"""One rank of an FSDP2 run (--shard fsdp2 --nproc N), simulated in this process: FSDP2's own code on fake
tensors, over a fake process group of N ranks (torch.testing._internal.distributed.fake_pg: collectives that move
nothing, as torchtitan's memory estimation and torch's FSDP2 memory tracker tests use it).

The rank builds its model as a real rank does (runner._measure): the meta model, the adapter, the policy, then
`fsdp.shard_model` (each unit, then the root, with the precision's MixedPrecisionPolicy). Its parameters become
fake DTensor shards (`to_empty` under the fake mode) and the step runs for real: FSDP2's hooks gather each unit
into unsharded parameters, free them with `untyped_storage().resize_(0)` (which the simulation's tracker follows,
as it follows a CPU rank), keep the flat all-gather buffers and reduce-scatter inputs it keeps, and the optimizer
steps the shards. What it allocates is this rank's: the fakes of rank 0, whose shards are the largest when a
dimension does not divide by N (FSDP2 pads the others to its size).

What it cannot see: the CUDA streams FSDP2 gathers and reduces on. On a GPU, a gather issued ahead on its own
stream allocates when it is issued, and the caching allocator keeps a block freed on one stream for it until the
streams meet; on fakes each free is immediate. FSDP2 itself holds on to each buffer it hands between streams
until the consumer is done ("defer free" in _fsdp_param_group.py), so what stays is the allocator's stream
bookkeeping, not measured yet. NCCL's own buffers are not tensors and are not counted.

A process that already holds a process group (a rank of a real run, recording its prediction) cannot start a
fake one: there the per-rank model (per_rank.py) stands in, and `available` says so. For the same reason a plan
chooses its mix on the unsharded step (plan._choosing), in every process alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from gcbench.errors import GcbenchError


_ONE_AT_A_TIME = threading.Lock()  # one process group per process: simulations in threads take turns
_OURS = False  # the process group now held is a fake world of this module's


def available() -> bool:
    """Whether this process can run a fake world: it holds no process group, or only a fake world another thread
    of it is running (fake_world then waits its turn), never a real run's."""
    import torch.distributed as dist

    return dist.is_available() and (_OURS or not dist.is_initialized())


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """A fake process group of `world` ranks, this process rank 0, for the block inside; destroyed after it."""
    global _OURS
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with _ONE_AT_A_TIME:
        if dist.is_initialized():
            raise GcbenchError("a fake process group cannot start in a process that holds one (a rank of a run)")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        _OURS = True
        try:
            yield
        finally:
            _OURS = False
            dist.destroy_process_group()


def shard_as_fakes(model, blocks, precision: str, fake) -> None:
    """`fsdp.shard_model` on the meta model (the meshes are made outside the fake mode, which cannot run their
    set-up), then every parameter and buffer made a fake of its shard's shape (`to_empty` reads the meta tensors,
    so the fake mode takes them as inputs)."""
    from gcbench.fsdp import shard_model

    shard_model(model, blocks, precision)
    with fake:
        model.to_empty(device="cpu")
