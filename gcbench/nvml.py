"""What NVML (nvidia-ml-py) says about a CUDA device, read without a CUDA context: its free memory, its state now
(clocks, power, temperature), and over a measured window whether it was throttled.

A GPU under sustained load lowers its clocks to stay within its power limit (or its temperature): the same step runs
slower, and a comparison between two configs measured minutes apart compares two clocks. NVML counts the time the
card spent held back since the driver loaded (nvmlDeviceGetViolationStatus: power, thermal), which `GpuWindow` reads
before and after the measured steps, beside the SM clock sampled as the steps run.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# nvml.h's clock-event reasons that lower the clocks under load (nvmlClocksEventReason*): SW power cap 0x4, HW
# slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80. Idle (0x1), application clocks (0x2), sync
# boost (0x10) and display clocks (0x100) are not a slowdown of the measured work.
SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
# A window is throttled when the card was held back (power or thermal) for at least this share of it: a twentieth,
# enough to move a median step by a few percent, the size of the differences gcbench ranks (a choice, not a fit).
THROTTLED_SHARE = 0.05
SAMPLE_EVERY_S = 0.5  # how often the SM clock is read as the steps run (an NVML read costs tens of microseconds)


@contextmanager
def nvml_device(cuda_index: int) -> Iterator[tuple[Any, Any] | None]:
    """(pynvml, handle) of CUDA device `cuda_index` for the block, NVML initialised; None where NVML cannot tell
    which GPU that is. CUDA and NVML number GPUs differently: follow CUDA_VISIBLE_DEVICES (indices or GPU- UUIDs),
    and without it trust NVML's order only where CUDA's order equals it (CUDA_DEVICE_ORDER=PCI_BUS_ID, or all GPUs
    of one model)."""
    import pynvml

    try:
        pynvml.nvmlInit()
        ready = True
    except pynvml.NVMLError:
        ready = False
    if not ready:
        yield None
        return
    try:
        yield _handle(pynvml, cuda_index)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # never in place of the block's own error (a step's out-of-memory is a result)


def _handle(pynvml, cuda_index: int) -> tuple[Any, Any] | None:
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        # CUDA numbers GPUs fastest first, NVML by PCI bus: the same order only for GPUs of one model or with
        # CUDA_DEVICE_ORDER=PCI_BUS_ID. Indices in CUDA_VISIBLE_DEVICES are CUDA's too; UUIDs are unambiguous.
        same_order = (len({pynvml.nvmlDeviceGetName(h) for h in handles}) <= 1
                      or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = [e.strip() for e in visible.split(",")] if visible is not None else \
            [str(i) for i in range(len(handles))]
        entry = entries[cuda_index] if cuda_index < len(entries) else ""
        if entry.startswith("GPU-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
        elif entry.isdigit() and same_order and int(entry) < len(handles):
            handle = handles[int(entry)]
        else:
            return None  # a MIG slice (NVML's numbers would be the whole GPU's), an order NVML cannot tell
        try:
            if pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                return None
        except pynvml.NVMLError:
            pass  # no MIG on this GPU
        return pynvml, handle
    except pynvml.NVMLError:
        return None


def with_nvml_device(cuda_index: int, read: Callable[[Any, Any], Any]) -> Any:
    """`read(pynvml, handle)` for CUDA device `cuda_index`, or None where NVML cannot tell which GPU that is."""
    with nvml_device(cuda_index) as device:
        if device is None:
            return None
        pynvml, handle = device
        try:
            return read(pynvml, handle)
        except pynvml.NVMLError:
            return None


def nvml_free_bytes(cuda_index: int) -> int | None:
    """Free memory of CUDA device `cuda_index` through NVML, which creates no CUDA context."""
    return with_nvml_device(cuda_index, lambda pynvml, h: int(pynvml.nvmlDeviceGetMemoryInfo(h).free))


def _get(pynvml, fn: Callable[[], Any], scale: float = 1.0) -> Any:
    try:
        value = fn()
    except (pynvml.NVMLError, AttributeError):
        return None
    return value / scale if scale != 1.0 else value


def _reasons(pynvml, handle) -> int | None:
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    return _get(pynvml, lambda: reasons(handle)) if reasons else None


def _read_state(pynvml, handle) -> dict[str, Any]:
    get = lambda fn, scale=1.0: _get(pynvml, fn, scale)  # noqa: E731
    return {
        "sm_clock_mhz": get(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        "mem_clock_mhz": get(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
        "power_w": get(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 1000.0),
        "temperature_c": get(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        "clock_event_reasons": _reasons(pynvml, handle),
    }


def gpu_state(cuda_index: int) -> dict[str, Any] | None:
    """Clocks (MHz), power (W), temperature (C) and NVML's clock-event reasons (a bitmask: power cap, thermal, ...)
    of CUDA device `cuda_index` now, so that an outlier step time can be explained; a value NVML cannot read is
    None, and the whole is None without NVML."""
    return with_nvml_device(cuda_index, _read_state)


class GpuWindow:
    """NVML around a measured window: the time the card was held back by its power limit and by temperature
    (violation counters, ns, read at both ends), the energy it used, and the SM clock and clock-event reasons
    sampled every SAMPLE_EVERY_S as the steps run (`sample`, called between steps; cheap in between). `fields()`:
    the record's gpu_window (raw: ms, MHz, mJ) and gpu_throttled (None where NVML cannot tell)."""

    def __init__(self, cuda_index: int, clock: Callable[[], float]):
        self._index, self._clock = cuda_index, clock
        self._samples: list[tuple[int | None, int | None]] = []
        self._start: dict[str, Any] | None = None
        self._end: dict[str, Any] | None = None
        self._last = float("-inf")

    def __enter__(self) -> GpuWindow:
        self._open = nvml_device(self._index)
        self._device = self._open.__enter__()
        self._start = self._counters()
        self.sample(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.sample(force=True)
        self._end = self._counters()
        self._open.__exit__(*exc)
        self._device = None

    def _counters(self) -> dict[str, Any] | None:
        if self._device is None:
            return None
        pynvml, handle = self._device

        def violation(policy: str) -> int | None:
            kind = getattr(pynvml, f"NVML_PERF_POLICY_{policy}", None)
            status = _get(pynvml, lambda: pynvml.nvmlDeviceGetViolationStatus(handle, kind)) if kind is not None \
                else None
            return int(status.violationTime) if status is not None else None

        return {"t": self._clock(), "power_ns": violation("POWER"), "thermal_ns": violation("THERMAL"),
                "energy_mj": _get(pynvml, lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))}

    def sample(self, force: bool = False) -> None:
        now = self._clock()
        if self._device is None or (not force and now - self._last < SAMPLE_EVERY_S):
            return
        self._last = now
        pynvml, handle = self._device
        self._samples.append((_get(pynvml, lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                              _reasons(pynvml, handle)))

    def fields(self) -> dict[str, Any]:
        if self._start is None or self._end is None:
            return {"gpu_window": None, "gpu_throttled": None}
        a, b = self._start, self._end
        window_ms = (b["t"] - a["t"]) * 1e3
        # a counter that went back (a GPU reset, a driver reload in between) says nothing about the window
        held = {k: (b[k] - a[k]) / 1e6 if a[k] is not None and b[k] is not None and b[k] >= a[k] else None
                for k in ("power_ns", "thermal_ns")}
        clocks = [c for c, _ in self._samples if c is not None]
        reasons = [r for _, r in self._samples if r is not None]
        seen = 0
        for r in reasons:
            seen |= r
        energy = b["energy_mj"] - a["energy_mj"] if None not in (a["energy_mj"], b["energy_mj"]) else None
        known = [v for v in held.values() if v is not None]
        if known:
            throttled = window_ms > 0 and sum(known) >= THROTTLED_SHARE * window_ms
        else:  # no counters: whether any sample saw a slowdown reason
            throttled = bool(seen & SLOWDOWN_REASONS) if reasons else None
        return {"gpu_window": {
            "window_ms": window_ms, "power_capped_ms": held["power_ns"], "thermal_capped_ms": held["thermal_ns"],
            "energy_mj": energy, "sm_clock_mhz_min": min(clocks, default=None),
            "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
            "sm_clock_mhz_max": max(clocks, default=None), "clock_samples": len(self._samples),
            "clock_event_reasons_seen": seen if reasons else None},
            "gpu_throttled": throttled}
