"""Tests only: NVML (the nvidia-ml-py module) for the fake GPU of tests/fake_cuda.py, on PYTHONPATH through
subprocess_env before the real module. It answers what a real NVML would for an idle machine with the fake GPUs:
their name and total memory, all of it free (NVML sees the device, not one process's allocator)."""

import os
from types import SimpleNamespace

from tests.fake_cuda import ENV_DEVICES, FakeGpu

NVML_DEVICE_MIG_ENABLE = 1
NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0


class NVMLError(Exception):
    pass


_GPU = FakeGpu()


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "000.00 (fake)"


def nvmlDeviceGetCount():
    return int(os.environ.get(ENV_DEVICES, "1"))


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(f"no device {index}")
    return index


def nvmlDeviceGetHandleByUUID(uuid):
    raise NVMLError("the fake GPUs have no UUIDs")


def nvmlDeviceGetName(handle):
    return _GPU.name


def nvmlDeviceGetMigMode(handle):
    return (0, 0)


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=_GPU.total_memory, free=_GPU.total_memory, used=0)


def _unsupported(*args):
    raise NVMLError("not supported by the fake")


nvmlDeviceGetClockInfo = nvmlDeviceGetPowerUsage = nvmlDeviceGetTemperature = _unsupported


def __getattr__(name):
    """Any other NVML call: not supported, as NVML answers for a query a device cannot serve."""
    if name.startswith("nvml"):
        return _unsupported
    raise AttributeError(name)
