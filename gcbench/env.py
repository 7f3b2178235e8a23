"""Environment capture: what every Record says about the machine and software that produced it."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from pathlib import Path

import torch
import transformers

import gcbench
from gcbench.fields import DeviceKind
from gcbench.instruments import CudaInstrument



def _run(*cmd: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


@cache
def git_sha() -> str | None:
    """The gcbench source checkout's commit, with '-dirty' when it has uncommitted changes; None outside git."""
    src = str(Path(gcbench.__file__).resolve().parent.parent)
    sha = _run("git", "-C", src, "rev-parse", "HEAD")
    if sha and _run("git", "-C", src, "status", "--porcelain", "--untracked-files=no"):
        sha += "-dirty"
    return sha


CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo's keys for the CPU's name: x86 ("model name"), some ARM boards ("Model", "Hardware"), POWER ("cpu")
_CPUINFO_NAMES = ("model name", "Model", "Hardware", "cpu")


@cache
def cpu_model(cpuinfo: Path = CPUINFO) -> str | None:
    """The CPU's model name ("AMD EPYC 7R13 Processor"), which `platform` does not give on Linux (only "x86_64"):
    /proc/cpuinfo on Linux, sysctl on macOS, platform.processor() elsewhere (Windows names the model there). None
    where none of them says (many ARM servers' cpuinfo has part numbers only)."""
    try:
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text(errors="replace").splitlines() if ":" in line)
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    for key in _CPUINFO_NAMES:
        if fields.get(key):
            return fields[key]
    if platform.system() == "Darwin":
        return _run("sysctl", "-n", "machdep.cpu.brand_string")
    processor = platform.processor()
    return processor if processor and processor != platform.machine() else None


def capture_env(device: str, threads: int | None = None) -> dict:
    """Versions, device, and the numeric settings that change results (TF32, matmul precision). `device`: a
    resolved device ("cpu", "cuda:N"); `threads`: the run's torch threads (None: this process's now)."""
    env = {
        "gcbench": gcbench.__version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "gpu_name": None,
        "gpu_memory_bytes": None,
        "driver": None,
    }
    if DeviceKind.of(device) is DeviceKind.CUDA:
        env.update(CudaInstrument(device).describe())
        env["driver"] = driver_version()
    return env


def driver_version() -> str | None:
    """The NVIDIA driver's version through NVML (nvidia-ml-py), which never creates a CUDA context; None where
    NVML cannot be loaded (no driver)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:  # a driver whose NVML cannot say: the record says "unknown" rather than fail
        return None
    finally:
        pynvml.nvmlShutdown()

