"""A fake CUDA device, so that CI (which never has a GPU) drives gcbench's CUDA branch end to end.

What is faked is the layer *below* torch.cuda's Python code: the torch._C bindings (device count, current device,
synchronize, the caching allocator's statistics and memory fraction), cudaMemGetInfo, the device properties, CUDA
events and the CUDA generators. torch's own Python above them runs for real, argument checks included:
`torch.cuda.set_device("cuda")` raises the same ValueError here as on a GPU. So does the fork rule: a process
forked after CUDA was initialised cannot use it.

- Tensors meant for CUDA stay on the CPU: a TorchFunctionMode rewrites CUDA devices to the CPU. Pinned host memory
  is granted (and logged) as plain host memory.
- The caching allocator is modelled on live tensor bytes (a TorchDispatchMode): allocated = bytes of live storages
  created on the "device"; reserved = allocated rounded up to 2 MiB segments, kept until `empty_cache`. A memory
  fraction caps reserved bytes; past it the cache is flushed and the allocation retried (`num_alloc_retries`), then
  torch.OutOfMemoryError is raised, as the real allocator does. `retry_above_bytes` forces a retry on allocations
  past a line, so that tests can see retries without a cap.
- Time is a fake clock that advances by `op_ms` per dispatched op: event timings do not depend on the machine.
- Every torch.cuda call made from gcbench code is logged with its arguments, in order (`calls`, and with
  `log_path` one JSON line per call, from every process): tests assert the protocol on that log.

In-process: the `fake_cuda` fixture (tests/conftest.py). In subprocesses (the CLI, a sweep's fork server and its
children): run them with `subprocess_env(log_path)`, which installs the fake through tests/fake_cuda_site.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SEGMENT_BYTES = 2 * 2**20  # the caching allocator reserves device memory in segments of (at least) 2 MiB
ENV_LOG = "GCBENCH_FAKE_CUDA_LOG"
ENV_DEVICES = "GCBENCH_FAKE_CUDA_DEVICES"  # how many fake GPUs the machine has (1 unless set)
ENV_CONTEXT = "GCBENCH_FAKE_CUDA_CONTEXT"  # bytes a process's CUDA context takes outside the allocator (0 unless set)
SITE_DIR = Path(__file__).resolve().parent / "fake_cuda_site"
REPO_ROOT = Path(__file__).resolve().parent.parent

# The public torch.cuda functions whose calls are logged, and whether each takes a `device` argument.
LOGGED = {
    "is_available": False, "device_count": False, "current_device": False, "empty_cache": False,
    "set_device": True, "get_device_properties": True, "get_device_name": True, "get_device_capability": True,
    "synchronize": True, "reset_peak_memory_stats": True, "memory_stats": True, "memory_allocated": True,
    "max_memory_allocated": True, "memory_reserved": True, "max_memory_reserved": True,
    "set_per_process_memory_fraction": True, "mem_get_info": True,
}
# torch.cuda functions that take a device, with the position of that argument when passed positionally
DEVICE_ARG_POSITION = {name: (1 if name == "set_per_process_memory_fraction" else 0)
                       for name, takes in LOGGED.items() if takes}


@dataclass
class Call:
    """One logged call: `name` is a torch.cuda function, "Event.record", "Event.elapsed_time", "pin_memory",
    "alloc_retry" or "oom"; `caller` is the module that made it."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    caller: str = ""
    pid: int = 0

    @property
    def device(self) -> Any:
        """The device argument as passed (None when omitted), for functions that take one."""
        if self.name not in DEVICE_ARG_POSITION:
            return None
        if "device" in self.kwargs:
            return self.kwargs["device"]
        position = DEVICE_ARG_POSITION[self.name]
        return self.args[position] if len(self.args) > position else None

    def as_json(self) -> dict:
        return {"name": self.name, "args": [_jsonable(a) for a in self.args],
                "kwargs": {k: _jsonable(v) for k, v in self.kwargs.items()}, "caller": self.caller, "pid": self.pid}

    @classmethod
    def from_json(cls, d: dict) -> Call:
        return cls(d["name"], tuple(d["args"]), d["kwargs"], d["caller"], d["pid"])


def _jsonable(value: Any) -> Any:
    if isinstance(value, (int, float, bool, type(None))):
        return value
    return str(value)  # torch.device("cuda:0") -> "cuda:0"


def is_explicit_device(device: Any) -> bool:
    """An index that needs no "current device" to be meaningful: 0, "cuda:0", torch.device("cuda", 0)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return device >= 0
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        return d.type == "cuda" and d.index is not None
    return False


def read_log(path: Path) -> list[Call]:
    """The calls every process logged to `path`, in the order they were written."""
    if not path.exists():
        return []
    return [Call.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def fresh_library_caches() -> None:
    """transformers caches "is CUDA available?" for the process: forget it when the fake comes and goes."""
    from transformers.utils import import_utils

    for value in vars(import_utils).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def subprocess_env(log_path: Path, devices: int = 1, context_bytes: int = 0) -> dict[str, str]:
    """Environment for a subprocess (and every process it starts) that sees `devices` fake GPUs and logs to
    `log_path`; NVML (nvidia-ml-py) is faked too (fake_cuda_site/pynvml.py): it sees the whole fake GPU free."""
    path = os.pathsep.join([str(SITE_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, ENV_LOG: str(log_path), ENV_DEVICES: str(devices), ENV_CONTEXT: str(context_bytes),
            "PYTHONPATH": path}


@dataclass
class FakeGpu:
    """Fake CUDA devices (`devices` of them, all alike) and the caching allocator of the one in use.

    Tensors do not know which device they are on (they are all CPU tensors), so the allocator counts every
    allocation on the current device (the one `set_device` chose); the statistics of any other device read zero,
    so that code reading the wrong device's numbers is caught."""

    name: str = "NVIDIA H100 80GB HBM3"
    total_memory: int = 80 * 2**30
    devices: int = 1
    op_ms: float = 0.01  # fake-clock milliseconds per dispatched op
    retry_above_bytes: int | None = None  # count an allocation retry whenever allocated bytes cross this line
    log_path: Path | None = None
    context_bytes: int = 0  # what this process's CUDA context takes outside the allocator, once CUDA is initialised

    def __post_init__(self) -> None:
        self.calls: list[Call] = []
        self.current_device = 0
        self.fractions: dict[int, float] = {}  # per device, set by set_per_process_memory_fraction
        self.allocated = self.peak_allocated = 0
        self.reserved = self.peak_reserved = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.ops = 0  # the fake clock: ops dispatched so far (each takes op_ms)
        # The fork rule: a process forked after its parent asked the CUDA runtime anything (device count,
        # initialisation) cannot use CUDA. NVML-based checks (PYTORCH_NVML_BASED_CUDA_CHECK=1) do not count.
        self.poisoned_in: int | None = None
        self._live: dict[int, int] = {}
        self._host: set[int] = set()  # storages asked for on the host (pinned or .cpu()): not device memory
        self._depth = threading.local()

    @classmethod
    def from_env(cls) -> FakeGpu:
        return cls(log_path=Path(os.environ[ENV_LOG]), devices=int(os.environ.get(ENV_DEVICES, "1")),
                   context_bytes=int(os.environ.get(ENV_CONTEXT, "0")))

    # ------------------------------------------------------------------------------------------------ logging

    def log(self, name: str, args: tuple = (), kwargs: dict | None = None, caller: str = "") -> None:
        call = Call(name, tuple(args), dict(kwargs or {}), caller, os.getpid())
        self.calls.append(call)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(call.as_json()) + "\n")

    def gcbench_calls(self) -> list[Call]:
        return [c for c in self.calls if c.caller.startswith("gcbench")]

    def _logged(self, name: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            # Calls from gcbench, benchmarks and tests; not torch calling itself, nor the libraries below gcbench
            # (fake tensors ask is_available() for every op).
            if depth == 0 and not caller.startswith(("torch", "transformers")):
                self.log(name, args, kwargs, caller)
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        wrapper.__name__ = wrapper.__qualname__ = name
        return wrapper

    # ------------------------------------------------------------------------------------------------ the allocator

    @property
    def fraction(self) -> float:
        """The memory fraction of the device in use."""
        return self.fractions.get(self.current_device, 1.0)

    def _limit(self) -> int:
        return int(self.fraction * self.total_memory)

    def allocate(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._live or storage.device.type == "meta":
            return
        allocated = self.allocated + nbytes
        if self.retry_above_bytes is not None and self.allocated <= self.retry_above_bytes < allocated:
            self._retry()
        needed = max(self.reserved, _round_up(allocated, SEGMENT_BYTES))
        if needed > self._limit():
            self._retry()  # free the cached segments and try again, as the real allocator does
            needed = max(self.reserved, _round_up(allocated, SEGMENT_BYTES))
            if needed > self._limit():
                self.num_ooms += 1
                self.log("oom", (nbytes,))
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes} bytes. GPU 0 has a total capacity of "
                    f"{self.total_memory} bytes of which the process may use {self._limit()} (fake GPU)")
        self._live[key] = nbytes
        self.allocated, self.reserved = allocated, needed
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        # A storage keeps its Python object while it lives, so this fires when the memory is freed.
        weakref.finalize(storage, self.free, key)

    def free(self, key: int) -> None:
        self.allocated -= self._live.pop(key, 0)

    def forget(self, tensor: torch.Tensor) -> None:
        """`tensor` lives in host memory (pinned or explicitly on the CPU): not device memory."""
        storage = tensor.untyped_storage()
        key = id(storage)
        self.free(key)
        self._host.add(key)
        weakref.finalize(storage, self._host.discard, key)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor.untyped_storage()) in self._host

    def _retry(self) -> None:
        self.num_alloc_retries += 1
        self.reserved = _round_up(self.allocated, SEGMENT_BYTES)
        self.log("alloc_retry", (self.allocated,))

    def memory_stats(self, device: int) -> dict[str, Any]:
        self._check_index(device)
        used = device == self.current_device
        return {"allocated_bytes": {"all": {"current": self.allocated * used, "peak": self.peak_allocated * used}},
                "reserved_bytes": {"all": {"current": self.reserved * used, "peak": self.peak_reserved * used}},
                "num_alloc_retries": self.num_alloc_retries * used, "num_ooms": self.num_ooms * used}

    def reset_peak(self, device: int) -> None:
        self._check_index(device)
        if device == self.current_device:
            self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def empty_cache(self) -> None:
        self.reserved = _round_up(self.allocated, SEGMENT_BYTES)

    def set_fraction(self, fraction: float, device: int) -> None:
        self._check_index(device)
        self.fractions[device] = fraction

    def _check_index(self, device: int) -> None:
        if not 0 <= device < self.devices:  # what the C++ side raises for a device that does not exist
            raise RuntimeError(f"Invalid device argument {device}: did you call init? ({self.devices} fake GPUs)")

    # ------------------------------------------------------------------------------------------------ install

    def install(self, setattr_: Callable[[Any, str, Any], None]) -> Callable[[], None]:
        """Patch torch with this device through `setattr_(obj, name, value)` (monkeypatch.setattr, or plain setattr
        for a whole process); returns a function that pops the two modes again."""
        gpu = self
        c = torch._C
        setattr_(c, "_cuda_getDeviceCount", self._device_count)
        setattr_(c, "_cuda_init", self._init)
        setattr_(c, "_cuda_getDevice", lambda: self.current_device)
        setattr_(c, "_cuda_setDevice", self._set_device)
        setattr_(c, "_cuda_synchronize", lambda: None)
        setattr_(c, "_cuda_getCurrentRawStream", lambda device: 0)  # torch._dynamo imports it when CUDA is built
        setattr_(c, "_cuda_memoryStats", self.memory_stats)
        setattr_(c, "_cuda_resetPeakMemoryStats", self.reset_peak)
        setattr_(c, "_cuda_emptyCache", self.empty_cache)
        setattr_(c, "_cuda_setMemoryFraction", self.set_fraction)
        cuda = torch.cuda
        setattr_(cuda, "_initialized", False)
        setattr_(cuda, "_cached_device_count", None)
        setattr_(cuda, "_queued_calls", [])
        setattr_(cuda, "_is_in_bad_fork", self._in_bad_fork)
        setattr_(cuda, "_device_count_nvml", self._visible)  # NVML answers without initialising CUDA
        setattr_(cuda, "_exchange_device", self._exchange_device)
        setattr_(cuda, "_maybe_exchange_device", self._exchange_device)
        setattr_(cuda, "_cudart", SimpleNamespace(cudaMemGetInfo=self._mem_get_info))
        setattr_(cuda, "_get_device_properties", self._properties)
        setattr_(cuda, "default_generators", tuple(torch.Generator() for _ in range(self.devices)))
        setattr_(cuda, "Event", self._event_class())
        for name in LOGGED:
            setattr_(cuda, name, self._logged(name, getattr(cuda, name)))

        placement, allocator = _CudaTensorsOnHost(gpu), _Allocator(gpu)
        placement.__enter__()
        allocator.__enter__()

        def uninstall() -> None:
            allocator.__exit__(None, None, None)
            placement.__exit__(None, None, None)

        return uninstall

    def install_for_process(self) -> None:
        self.install(setattr)

    def _device_count(self) -> int:
        self._poison_fork()
        return self._visible()

    def _visible(self) -> int:
        """The GPUs CUDA_VISIBLE_DEVICES lets this process see, as CUDA counts them when it initialises."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None or getattr(self, "_initialised", False):
            return self.devices
        return sum(1 for v in visible.split(",") if v.strip().isdigit() and int(v) < self.devices)

    def _init(self) -> None:
        if not getattr(self, "_initialised", False):  # the first CUDA initialisation: what it sees is fixed now
            self._initialised = True
            self.devices = self._visible()
            self.log("cuda_init", (os.environ.get("CUDA_VISIBLE_DEVICES"),))
        self._poison_fork()

    def _poison_fork(self) -> None:
        if self.poisoned_in is None:
            self.poisoned_in = os.getpid()

    def _in_bad_fork(self) -> bool:
        return self.poisoned_in is not None and self.poisoned_in != os.getpid()

    def _set_device(self, index: int) -> None:
        torch.cuda._lazy_init()  # the real binding initialises CUDA first
        self._check_index(index)
        self.current_device = index

    def _exchange_device(self, index: int) -> int:
        if index < 0:
            return -1
        previous, self.current_device = self.current_device, index
        return previous

    def _mem_get_info(self, device: int) -> tuple[int, int]:
        self._check_index(device)
        used = (self.reserved + self.context_bytes) * (device == self.current_device)
        return self.total_memory - used, self.total_memory

    def _properties(self, device: int) -> SimpleNamespace:
        self._check_index(device)
        return SimpleNamespace(name=self.name, total_memory=self.total_memory, major=9, minor=0,
                               multi_processor_count=132)

    def _event_class(self) -> type:
        gpu = self

        class FakeEvent:
            """torch.cuda.Event on the fake clock; records on the current device's stream, as the real one does."""

            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
                self.enable_timing = enable_timing
                self.ops: int | None = None

            def record(self, stream=None) -> None:
                gpu.log("Event.record", (gpu.current_device,), caller=sys._getframe(1).f_globals.get("__name__", ""))
                self.ops = gpu.ops

            def synchronize(self) -> None:
                gpu.log("Event.synchronize", caller=sys._getframe(1).f_globals.get("__name__", ""))

            def query(self) -> bool:
                return True

            def elapsed_time(self, end: FakeEvent) -> float:
                gpu.log("Event.elapsed_time", caller=sys._getframe(1).f_globals.get("__name__", ""))
                if not (self.enable_timing and end.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self.ops is None or end.ops is None:
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                return (end.ops - self.ops) * gpu.op_ms

        return FakeEvent


def _round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


def _host_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
        return "cpu"
    return value


class _CudaTensorsOnHost(TorchFunctionMode):
    """Tensors asked for on CUDA are made on the CPU. Host copies are real copies, told apart by how they are made,
    since every tensor reports the CPU: `.cpu()` and pinned memory make host memory (pinned memory is logged), but
    `.cpu()` of a simulation's fake is itself, as it is next to a real GPU;
    `.to(device)` of such a host tensor brings it back to the device (a new device allocation); `.to(device)` of
    any other tensor stays where it is, as `x.to(x.device)` does on a GPU."""

    def __init__(self, gpu: FakeGpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            self.gpu.log("pin_memory", (tuple(args[0].shape),))
            return self._on_host(args[0].clone())
        if func is torch.Tensor.cpu:
            if isinstance(args[0], FakeTensor):  # a simulation's fakes are CPU tensors on a real GPU machine too
                return func(*args, **kwargs)
            return self._on_host(args[0].clone())
        pinned = bool(kwargs.pop("pin_memory", False))
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        if func is torch.Tensor.to:
            if self.gpu.is_host(args[0]) and _names_a_device(args[1:], kwargs):
                return args[0].clone()  # host to device: a new device allocation (counted by the allocator)
            args = (args[0], *(_host_device(a) for a in args[1:]))
        out = func(*args, **kwargs)
        if pinned:
            self.gpu.log("pin_memory", (tuple(out.shape),))
            self._on_host(out)
        return out

    def _on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gpu.forget(tensor)
        return tensor


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, (str, torch.device)) for a in (*args, kwargs.get("device")))


class _Allocator(TorchDispatchMode):
    """Counts every storage an op creates as device memory (fake and meta tensors excepted), ticks the clock."""

    def __init__(self, gpu: FakeGpu):
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        self.gpu.ops += 1
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta":
                if id(t.untyped_storage()) not in self.gpu._host:
                    self.gpu.allocate(t.untyped_storage())
        return out
