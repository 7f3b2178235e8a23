import os

import pytest
import torch

from gcbench.runner import run
from tests.helpers import CLASSIC, CLASSIC_SEQ, TINY, tiny_spec


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores as torch threads, and so do the processes its
    tests start (OMP_NUM_THREADS): two workers each spinning two threads on CI's two cores ran the default suite in
    250 s, one thread each in 182 s (the slow set: 19 minutes)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = str(max(1, cores // int(workers)))
        torch.set_num_threads(int(threads))
        os.environ["OMP_NUM_THREADS"] = threads


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def classic_records():
    """One CPU record per (tiny family, classic policy): measured once, asserted on by many tests."""
    return {(m, p): run(tiny_spec(m, p, seq_len=CLASSIC_SEQ)) for m in TINY for p in CLASSIC}


@pytest.fixture
def fake_cuda(monkeypatch, request):
    """A fake CUDA GPU for this test (tests/fake_cuda.py): torch.cuda answers, tensors stay on the CPU. Indirect
    parametrization passes FakeGpu fields (`{"devices": 2}`)."""
    from tests.fake_cuda import FakeGpu, fresh_library_caches

    gpu = FakeGpu(**getattr(request, "param", {}))
    fresh_library_caches()
    uninstall = gpu.install(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))
    yield gpu
    uninstall()
    fresh_library_caches()


@pytest.fixture(autouse=True)
def fresh_estimates():
    """Each test predicts as a fresh process would: no simulation kept from another test (estimators/sharing.py)."""
    from gcbench.estimators import sharing

    sharing.forget()
    yield
