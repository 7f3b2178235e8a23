import pytest
import torch

from gcbench.spec import RunSpec
from gcbench.runner import run

TINY = ("tiny-llama", "tiny-gpt2", "tiny-bert")
CLASSIC = ("none", "full", "every-k:k=2", "segments:k=2", "sqrtn")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_spec(model="tiny-llama", policy="none", **overrides) -> RunSpec:
    fields = dict(model=model, seq_len=128, batch_size=2, policy=policy, device="cpu", warmup_steps=1,
                  measure_steps=1)
    return RunSpec(**(fields | overrides))


@pytest.fixture(scope="session")
def classic_records():
    """One CPU record per (tiny family, classic policy): measured once, asserted on by many tests."""
    return {(m, p): run(tiny_spec(m, p, seq_len=256)) for m in TINY for p in CLASSIC}


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
