"""The estimate's speed-ups change no number: every case of tests/golden/estimates.py (written by the estimator as
it was before them) gives the same rows today, to the byte."""

from __future__ import annotations

import pytest

from tests.golden import estimates as golden

STORED = golden.stored()


@pytest.mark.parametrize("case", [pytest.param(name, marks=() if name in golden.QUICK else pytest.mark.slow)
                                  for name, _, _ in golden.CASES])
def test_estimate_rows_unchanged(case):
    assert golden.compute(case) == STORED[case]
