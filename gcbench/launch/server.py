"""The fork server a sweep's children are forked from (process.py), and starting it early.

The server imports torch, transformers and gcbench once and warms up what every child would repeat (child.py);
that takes seconds. A sweep starts it as soon as its options say it will need one (`start`), before the sweep
itself imports torch and resolves its configs, so that the two start-ups overlap instead of adding up. Imports
nothing heavy: the command line calls it before torch is imported.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gcbench

# The models a sweep runs, one per line, for its fork server to warm up (launch/child.py).
WARM_MODELS_ENV = "GCBENCH_WARM_MODELS"
# What the server imports before it forks anyone: a child's own side, and the entry the parent names
PRELOAD = ["gcbench.launch.child", "gcbench.launch.process"]


def context(models: Iterable[str] = ()) -> Any:
    """The multiprocessing context children start from: the fork server where the platform has one (else spawn),
    its environment set for the sweep's `models`. Taking effect at the server's start: models named after it are
    not warmed up, only started slower."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")  # no fork server (Windows): slower starts, same isolation
    os.environ[WARM_MODELS_ENV] = "\n".join(models)
    # torch.cuda.is_available() in the fork server (transformers calls it) would initialise the CUDA driver there,
    # and a process forked after that cannot use CUDA. NVML answers the same question without touching CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # The fork server starts as `python -c ...`, which puts the working directory first on sys.path: a folder named
    # gcbench there (the parent directory of a clone) would be imported instead of this package. Keep the working
    # directory off the path, and put this package's tree on it where it is a source tree, not site-packages.
    os.environ["PYTHONSAFEPATH"] = "1"
    root = str(Path(gcbench.__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if Path(root).name not in ("site-packages", "dist-packages") and root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(models: Iterable[str]) -> None:
    """Start the fork server now, warming up `models`, and return at once: it imports while the caller goes on.
    The first child forked from it waits for the end of its start-up. A sweep that then fails its checks leaves it
    to end with this process."""
    if context(models).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
