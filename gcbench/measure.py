"""Device-independent counters: storage bytes, the CPU live-tensor tracker, saved-activation
bytes, FLOPs with recompute, and the devices' peak FLOP/s. The CPU and CUDA instruments (instruments.py) use them."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from gcbench.host_work import python_issuing, recompute_issuing
from gcbench.results.schema import PHASES, peak_phase
from gcbench.units import fmt_bytes, round_up

# FlopCounterMode knows the CUDA SDPA kernels but not the CPU flash kernel that SDPA picks on CPU; without these
# two formulas attention would count zero FLOPs on CPU. Same formulas as the CUDA flash kernel (causal not halved).
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):

    @flop_counter.register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _count_kv_heads_as_query_heads() -> None:
    """Grouped-query attention (Llama 3, Mistral, Qwen: fewer key/value heads than query heads) on CUDA: torch
    before 2.13 asserts in `sdpa_flop_count` and `sdpa_backward_flop_count` when the heads differ, so FlopCounterMode
    aborted the step of every such model on a GPU (measured on an H200 with torch 2.11: tiny-llama's `run` failed).
    The kernels broadcast each key/value head over its query group, so the FLOPs are those with the key/value heads
    repeated; torch 2.13 counts exactly that (torch/utils/flop_counter.py, "Supports GQA"). On a torch that refuses
    the shapes, the two counters get the key/value shapes with the query's heads; a torch that accepts them is left
    as it is."""
    forward, backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count
    try:
        forward((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
        return
    except AssertionError:
        pass

    def as_query_heads(query_shape, *shapes):
        heads = query_shape[1]
        return [(s[0], heads, *s[2:]) if s[1] != heads and s[1] and heads % s[1] == 0 else s for s in shapes]

    def gqa_forward(query_shape, key_shape, value_shape):
        return forward(query_shape, *as_query_heads(query_shape, key_shape, value_shape))

    def gqa_backward(grad_out_shape, query_shape, key_shape, value_shape):
        return backward(grad_out_shape, query_shape, *as_query_heads(query_shape, key_shape, value_shape))

    # The registered formulas (sdpa_flop, sdpa_backward_flop) look these names up in their module at each call.
    flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count = gqa_forward, gqa_backward


_count_kv_heads_as_query_heads()

# Mixture-of-experts layers multiply through torch's grouped matmul (transformers' default experts implementation,
# grouped_mm), which FlopCounterMode has no formula for: a MoE step counted its attention and router matmuls only.
# Each row of a 2-D operand meets one group's matrix: 2 x the product of A's sizes x B's last size, but for a 3-D A
# times a 2-D B, whose columns the groups split (A's group size then counts once).
if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_counter.flop_registry:

    @flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)
    def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        rows = a_shape[1:] if len(a_shape) == 3 and len(b_shape) == 2 else a_shape
        return 2 * int(torch.Size(rows).numel()) * b_shape[-1]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """A tensor's storage. A DTensor (an FSDP2-sharded parameter, its gradient, its optimizer state) is a wrapper
    without storage of its own: its storage is this rank's shard's (`_local_tensor`, which FSDP2 reads too)."""
    local = getattr(t, "_local_tensor", None)
    return (t if local is None else local).untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor], granularity_bytes: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once), each rounded up to
    `granularity_bytes`. Keyed by storage object, not data pointer: fake tensors all point at address 0."""
    storages = {id(s): s for s in map(storage_of, tensors)}
    return sum(round_up(s.nbytes(), granularity_bytes) for s in storages.values())


class FollowingResizes(TorchDispatchMode):
    """A dispatch mode that also hears of every `UntypedStorage.resize_` inside it, through `_resized(storage)`: a
    resize is no dispatched op (FSDP2 frees and gathers parameters that way: LiveTensorTracker._resized)."""

    def _resized(self, storage: torch.UntypedStorage) -> None:
        raise NotImplementedError

    def __enter__(self):
        unpatched = self._unpatched_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int):
            out = unpatched(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._unpatched_resize
        return super().__exit__(*exc)


class Listening(TorchDispatchMode):
    """A dispatch mode that also holds a context while entered (a listener for what no op shows: host moves,
    policies' Python dispatch): `_listener()` gives a fresh one per entry (a context manager from
    @contextmanager is good for one use)."""

    def _listener(self):
        return contextlib.nullcontext()

    def __enter__(self):
        self._listening = self._listener()
        self._listening.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._listening.__exit__(*exc)


class LiveTensorTracker(FollowingResizes):
    """Peak of live tensor bytes on CPU: each new storage adds its bytes, its release subtracts them.

    Storages that existed before (parameters, gradients, optimizer state) are added with `track`. A storage is
    counted once however many views share it. With `cap_bytes`, going past the cap raises a real
    torch.OutOfMemoryError, so OOM handling can be exercised without a GPU. This is not an allocator: no
    fragmentation, no caching, no 512-byte rounding — it is reported as `peak_tracked_bytes`, never as CUDA memory.
    `granularity_bytes` rounds every storage up to a multiple (512 mimics the CUDA caching allocator's blocks; the
    memory estimator uses it, measurements keep 1).
    """

    def __init__(self, cap_bytes: int | None = None, granularity_bytes: int = 1):
        super().__init__()
        self.cap_bytes = cap_bytes
        self.granularity_bytes = granularity_bytes
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._add(storage_of(t))

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = 0
        # Storages keep their Python object while the storage lives, so this fires when the memory is freed.
        weakref.finalize(storage, self._release, key)
        self._resize(key, nbytes)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """After `storage.resize_`: FSDP2 frees a gathered parameter by resizing its storage to 0 and gathers into
        the same storage again by resizing it back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
        free_storage / alloc_storage). Resizing a storage is no dispatched op, so `__enter__` wraps
        UntypedStorage.resize_, as torch/distributed/_tools/mem_tracker.py (MemTracker._track_resize) does."""
        if id(storage) in self._live:
            self._resize(id(storage), storage.nbytes())
        else:
            self._add(storage)

    def _resize(self, key: int, nbytes: int) -> None:
        nbytes = round_up(nbytes, self.granularity_bytes)
        self.current += nbytes - self._live[key]
        self._live[key] = nbytes
        if self.current > self.peak:
            self.peak = self.current
            if self.cap_bytes is not None and self.current > self.cap_bytes:
                raise torch.OutOfMemoryError(
                    f"live tensors need {fmt_bytes(self.current)}, {fmt_bytes(self.current - self.cap_bytes)} past "
                    f"the memory cap of {fmt_bytes(self.cap_bytes)}")

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(storage_of(t))
        return out


class PhasePeaks:
    """The peak of each phase of a training step, as the step's `mark` (step.TrainingStep): at every phase boundary
    the counter's peak since its last reset is read into the phase that ended, and the counter reset. Over several
    steps (or micro-batches) each phase keeps its maximum. `read()` returns the counter's peak; `reset()` sets it to
    the current value (LiveTensorTracker.reset_peak, torch.cuda.reset_peak_memory_stats)."""

    def __init__(self, read: Callable[[], int], reset: Callable[[], None]):
        self.read, self.reset = read, reset
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None

    def __call__(self, phase: str) -> None:
        if self._phase is not None:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), self.read())
        self._phase = None if phase == "end" else phase
        if self._phase is not None:
            self.reset()

    def fields(self) -> dict[str, Any]:
        """`<phase>_peak_bytes` for each phase, and `peak_phase`: the first phase that reached the step's peak."""
        return {**{f"{p}_peak_bytes": self.peaks.get(p) for p in PHASES}, "peak_phase": peak_phase(self.peaks)}


class SavedActivations:
    """Bytes autograd keeps for backward during a forward: distinct storages passed to saved_tensors_hooks.

    Parameters and buffers are excluded (they are model state). Tensors saved inside a non-reentrant checkpoint
    go to the checkpoint's own hooks and are dropped; the checkpoint's inputs are saved through ours, so a
    checkpointed block counts exactly what it stores. Op outputs a selective checkpoint caches arrive via
    `note_saved`. Tensors an inner hook moves off the device (activation offload) are not counted here.
    """

    def __init__(self, exclude: Iterable[torch.Tensor],
                 exclude_now: Callable[[], Iterable[torch.Tensor]] | None = None):
        self._exclude = {storage_of(t).data_ptr() for t in exclude}
        # Parameters as they are while the forward runs: FSDP2 gathers a sharded block's parameters before its
        # forward, so what autograd saves of them is not in `exclude` (the shards).
        self._exclude_now = exclude_now
        self._saved: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())

    def add(self, t: torch.Tensor) -> None:
        s = storage_of(t)
        now = {storage_of(p).data_ptr() for p in self._exclude_now()} if self._exclude_now else set()
        if s.data_ptr() not in self._exclude and s.data_ptr() not in now:
            self._saved[s.data_ptr()] = s.nbytes()

    @contextmanager
    def recording(self):
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t

        token = _RECORDING.set(self)
        try:
            with saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            _RECORDING.reset(token)


# The recording in progress, so that tensors kept for backward by other means than saved_tensors_hooks can be counted.
_RECORDING: ContextVar[SavedActivations | None] = ContextVar("gcbench_saved_activations", default=None)


# A model of a GPU's allocator that runs on CPU tensors (the simulation), listening for activations an offloading
# policy moves to host memory: on CPU the "copy" is the tensor itself, which the model must then stop counting
# until it is brought back. Real runs register nothing (on CUDA the copy is real, on CPU the host is the device).
_HOST_MOVES: ContextVar[Callable[[torch.Tensor, bool], None] | None] = ContextVar("gcbench_host_moves", default=None)


@contextmanager
def listening_to_host_moves(listener: Callable[[torch.Tensor, bool], None]):
    token = _HOST_MOVES.set(listener)
    try:
        yield
    finally:
        _HOST_MOVES.reset(token)


def moved_to_host(t: torch.Tensor, back: bool = False) -> None:
    """An offloading policy moved `t` to host memory (back=True: brought it back to the device)."""
    listener = _HOST_MOVES.get()
    if listener is not None:
        listener(t, back)


def note_saved(tensors: Iterable[torch.Tensor]) -> None:
    """Count `tensors` in the SavedActivations recording in progress, if any.

    For tensors autograd keeps outside saved_tensors_hooks: selective checkpointing caches op outputs in its own
    storage, invisible to the hooks, so the `sac` policy reports them here.
    """
    recording = _RECORDING.get()
    if recording is not None:
        for t in tensors:
            recording.add(t)


@contextmanager
def counting_flops():
    """FLOPs of everything run inside (forward, backward and any recompute); read `.get_total_flops()`.

    FlopCounterMode's own `with` also enters a ModuleTracker, whose hooks on every module's outputs keep tensors
    alive that a checkpoint would have dropped: a checkpointed step counted that way needs about the memory of the
    step without checkpoints (on a GPU, a config that fits only with its checkpoints runs out of memory there). So
    only its dispatch mode is entered: torch/utils/flop_counter.py's _FlopCounterMode (torch 2.6 on: the same
    formulas and decompositions, the totals under "Global"); before 2.6 the counter is that dispatch mode itself,
    entered as one without its __enter__, which adds the tracker."""
    counter = FlopCounterMode(display=False)
    mode = getattr(flop_counter, "_FlopCounterMode", None)
    if mode is not None:
        with mode(counter):
            yield counter
        return
    TorchDispatchMode.__enter__(counter)
    try:
        yield counter
    finally:
        TorchDispatchMode.__exit__(counter, None, None, None)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint, with `function` telling a RecomputeFlops in use when it runs as the
    recompute (every checkpoint gcbench makes goes through here)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def run(*inner: Any, **named: Any) -> Any:
        counter = _RECOMPUTE[-1] if _RECOMPUTE else None
        if counter is None or not counter.in_backward:
            with recompute_issuing():
                return function(*inner, **named)
        counter.depth += 1
        try:
            with python_issuing("forward"):
                return function(*inner, **named)
        finally:
            counter.depth -= 1

    return torch_checkpoint(run, *args, **kwargs)


class RecomputeFlops(TorchDispatchMode):
    """The FLOPs a backward spends recomputing the forward: those of the ops a checkpointed function (`checkpoint`
    above) runs inside `backward()`, whatever the grad mode (a custom autograd.Function's forward, such as
    bitsandbytes' 4-bit matmul, runs with it off even when recomputed). The step's FLOPs less these are the FLOPs
    without the policy (the MFU numerator), with no second pass of the model without its checkpoints, which would
    need the memory the policy saves (on a GPU, a config that fits only with checkpointing ran out of memory there).

    Enter it before `counting_flops()`: FlopCounterMode then sits on top, decomposes what it decomposes, and this
    mode sees the ops the counter counts, with the counter's formulas (flop_registry)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.in_backward = False
        self.depth = 0  # checkpointed functions running as their recompute

    def __enter__(self):
        _RECOMPUTE.append(self)  # a list, not a context variable: CUDA runs the backward on autograd's own thread
        return super().__enter__()

    def __exit__(self, *exc):
        _RECOMPUTE.remove(self)
        return super().__exit__(*exc)

    @contextmanager
    def backward(self) -> Iterator[None]:
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth:
            formula = flop_counter.flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
        return out


_RECOMPUTE: list[RecomputeFlops] = []
