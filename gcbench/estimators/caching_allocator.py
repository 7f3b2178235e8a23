"""PyTorch's CUDA caching allocator, replayed on the allocations and frees of a simulated step: what
`torch.cuda.max_memory_reserved` would read (the segments the allocator took from cudaMalloc), and whether the
step would run out of memory on a card of a given size, allocation retries included.

The rules are those of c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator::malloc and free) with its
default configuration (no PYTORCH_CUDA_ALLOC_CONF: max_split_size unlimited, no roundup_power2_divisions, no
garbage collection threshold, no expandable segments), on one stream:

- a request is rounded up to 512 bytes (round_size, kMinBlockSize);
- up to 1 MiB (kSmallSize) it comes from the small pool, else from the large pool;
- the pool's smallest free block that holds it is taken, the lowest address among equal sizes (get_free_block:
  BlockComparatorSize orders by stream, size, address); the rest is split off into a free block of its own when
  it is at least 512 bytes (small pool) or more than 1 MiB (large pool) (should_split);
- with no such block, a new segment is taken: 2 MiB (kSmallBuffer) for a small request, 20 MiB (kLargeBuffer)
  below 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge) (get_allocation_size);
- where the card has no room for the segment, every free block that is a whole segment is given back to CUDA
  and the segment tried again, counted as an allocation retry (release_cached_blocks, alloc_block with isRetry;
  release_available_cached_blocks does nothing while max_split_size is unlimited); then out of memory;
- a freed block merges with its free neighbours in the same segment (free_block, try_merge_blocks).

Segment addresses are not cudaMalloc's: segments are laid out in the order they are taken, which decides only
between free blocks of equal size."""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gcbench.measure import FollowingResizes, storage_of

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("address", "size", "small", "allocated", "prev", "next")

    def __init__(self, address: int, size: int, small: bool):
        self.address, self.size, self.small = address, size, small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.size, self.address


class OutOfMemory(Exception):
    """The replayed allocator found no room on the card for a segment, after giving its cached ones back."""


class CachingAllocator:
    """The allocator's blocks and segments. `capacity`: the bytes cudaMalloc can hand out on the card (its memory
    less the CUDA context and what else uses it); None for no limit. `allocated` and `reserved` read as
    torch.cuda.memory_allocated and memory_reserved would; their peaks from the last `reset_peaks`."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # sorted (size, address, b)
        self._blocks: dict[int, _Block] = {}  # key -> its allocated block
        self._next_address = 0

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def malloc(self, key: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size) or self._new_segment(small, size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self._blocks[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        return pool.pop(i)[2]

    def _new_segment(self, small: bool, size: int) -> _Block:
        nbytes = segment_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self._release_cached()
            self.retries += 1
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(f"a segment of {nbytes} bytes past {self.capacity} bytes, {self.reserved} reserved")
        block = _Block(self._next_address, nbytes, small)
        self._next_address += nbytes
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _release_cached(self) -> None:
        """Give back every free block that is a whole segment (release_cached_blocks: not split)."""
        for small, pool in self._pools.items():
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            for entry in whole:
                pool.remove(entry)
                self.reserved -= entry[2].size

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.address))
        assert pool[i][2] is block
        del pool[i]


class AllocationReplay(FollowingResizes):
    """Hands every storage an op makes, and its release, to a CachingAllocator: entered around the steps to
    replay (the same way the live-tensor tracker watches them). Storages that exist already (parameters, the
    batch) are handed over with `track`, in the order the run allocates them."""

    def __init__(self, allocator: CachingAllocator, workspace: Callable[[Any, tuple, dict | None], int] | None = None):
        super().__init__()
        self.allocator = allocator
        self.workspace = workspace  # (op, args, kwargs) -> bytes its kernel allocates and frees inside the op
        self._seen: set[int] = set()
        self._away: set[int] = set()  # offloaded to the host: no block on the device until it comes back
        self._empty: set[int] = set()  # resized to 0 bytes (FSDP2's freed unsharded parameters): no block

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._add(storage_of(t))

    def host_move(self, t: torch.Tensor, back: bool) -> None:
        """An offloaded activation leaves the device (its block is freed) or comes back (a block again): the
        offloading policy's copy (measure.moved_to_host); on the CPU fakes the tensor stands for both copies."""
        key = id(storage_of(t))
        if key not in self._seen:
            return
        if back and key in self._away:
            self._away.discard(key)
            self.allocator.malloc(key, storage_of(t).nbytes())
        elif not back and key not in self._away:
            self._away.add(key)
            self.allocator.free(key)

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages the target keeps elsewhere (host memory, CUDA managed memory): out of the allocator."""
        for t in tensors:
            key = id(storage_of(t))
            if key in self._seen:
                self._release(key)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.allocator.malloc(key, nbytes)
        weakref.finalize(storage, self._release, key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """After `storage.resize_` (FSDP2 frees a gathered parameter by resizing its storage to 0 and gathers into
        it again by resizing it back; measure.LiveTensorTracker._resized): its block freed, and a new one for the
        new size."""
        key, nbytes = id(storage), storage.nbytes()
        if key not in self._seen:
            self._add(storage)
            return
        if key not in self._empty and key not in self._away:
            self.allocator.free(key)
        self._empty.discard(key)
        if nbytes:
            self.allocator.malloc(key, nbytes)
        else:
            self._empty.add(key)

    def _release(self, key: int) -> None:
        self._seen.discard(key)
        self._away.discard(key)
        if key in self._empty:
            self._empty.discard(key)
            return
        self.allocator.free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(storage_of(t))
        scratch = self.workspace(func, args, kwargs) if self.workspace is not None else 0
        if scratch:
            self.allocator.malloc(_SCRATCH, scratch)
            self.allocator.free(_SCRATCH)
        return out


_SCRATCH = object()  # the key of a kernel's workspace, freed as soon as it is made
