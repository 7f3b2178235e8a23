"""Tests only: every Python process started with tests.fake_cuda.subprocess_env() sees one fake CUDA GPU.

On PYTHONPATH through subprocess_env, so that the `gcbench` command, a sweep's fork server and each of its children
install the fake before any gcbench code runs.
"""

import os

if os.environ.get("GCBENCH_FAKE_CUDA_LOG"):
    from tests.fake_cuda import FakeGpu

    FakeGpu.from_env().install_for_process()
