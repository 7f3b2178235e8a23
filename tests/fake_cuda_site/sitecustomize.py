"""Tests only: every Python process started with tests.fake_cuda.subprocess_env() sees one fake CUDA GPU.

On PYTHONPATH through subprocess_env, so that the `gcbench` command, a sweep's fork server and each of its children
install the fake before any gcbench code runs.
"""

import os

if os.environ.get("GCBENCH_FAKE_CUDA_LOG"):
    from tests.fake_cuda import FakeGpu

    FakeGpu.from_env().install_for_process()

if os.environ.get("GCBENCH_FAKE_VALIDATE_CLOCK"):
    # gcbench validate's deadline clock, made deterministic: each reading is this many seconds after the last
    import itertools

    import gcbench.validate.execute as _execute

    _ticks = itertools.count()
    _seconds = float(os.environ["GCBENCH_FAKE_VALIDATE_CLOCK"])
    _execute.clock = lambda: next(_ticks) * _seconds
