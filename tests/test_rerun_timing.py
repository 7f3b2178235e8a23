"""Time that a rerun would confirm: the interval widened for drift in spells (batch medians), and a GPU window
that says when the card held its clocks back. Fakes only: simulated step series, a fake NVML, a fake clock."""

from __future__ import annotations

import random
import statistics
import sys
from types import SimpleNamespace

import pytest

from gcbench import nvml
from gcbench.results.schema import NoteKind
from gcbench.results.stats import BATCH_SIZE, BATCHES, batch_interval, median_interval, sign_test_interval
from gcbench.timing import timing_verdict
from tests.helpers import FakeClock


def _spells(rng: random.Random, n: int, mean_spell: int) -> list[float]:
    """Steps of a machine that runs in spells: 13 or 19 ms (a neighbour's load comes and goes), each spell
    `mean_spell` steps long on average (geometric), 2% noise per step: what this project's 2-core VM does."""
    out, slow = [], rng.random() < 0.5
    while len(out) < n:
        level = 19.0 if slow else 13.0
        out += [level * rng.gauss(1.0, 0.02) for _ in range(1 + int(rng.expovariate(1 / mean_spell)))]
        slow = not slow
    return out[:n]


def test_a_run_in_spells_gets_an_interval_that_holds_another_runs_median():
    # 400 steps in spells of ~40: the sign test, which models only neighbours, claims far too much; widened by the
    # batch medians the interval holds another run's median near the 83% a right interval gives (issue 47 asks 65%).
    rng = random.Random(7)
    runs = [_spells(rng, 400, 40) for _ in range(120)]
    medians = [statistics.median(r) for r in runs]

    def holds(interval) -> float:
        inside = pairs = 0
        for i, run in enumerate(runs[:40]):
            lo, hi = interval(run)
            for j in range(40, 120):
                pairs += 1
                inside += lo <= medians[j] <= hi
        return inside / pairs

    assert holds(sign_test_interval) < 0.5
    assert holds(median_interval) >= 0.7


def test_steady_steps_pay_little_for_the_batch_medians():
    # No drift: the batch medians agree, and the interval is at most twice the sign test's (the t quantile of
    # 9 degrees of freedom and the correlation's margin), still well inside +-1% of the median.
    rng = random.Random(3)
    steady = [100.0 * rng.gauss(1.0, 0.01) for _ in range(300)]
    lo, hi = median_interval(steady)
    s_lo, s_hi = sign_test_interval(steady)
    assert lo <= s_lo < statistics.median(steady) < s_hi <= hi and hi - lo <= 2 * (s_hi - s_lo)
    assert (hi - lo) / 2 < 0.003 * statistics.median(steady)


def test_batch_medians_need_enough_steps_and_widen_for_their_own_correlation():
    assert batch_interval([1.0] * (BATCHES * BATCH_SIZE - 1)) is None
    assert batch_interval([5.0] * (BATCHES * BATCH_SIZE)) == (5.0, 5.0)
    # one slow spell in the middle: the batches' medians step up and down together (correlated), wider than
    # the same medians in alternation
    spell = [10.0] * 120 + [12.0] * 60 + [10.0] * 120
    alternating = [10.0 if (i // 30) % 2 else 10.4 for i in range(300)]
    assert batch_interval(spell)[1] - batch_interval(spell)[0] > 0.5
    lo, hi = batch_interval(alternating)
    assert lo < 10.2 < hi


# ---------------------------------------------------------------------------------------------- the GPU window

class FakeNvml(SimpleNamespace):
    """NVML of one GPU whose power-violation counter advances by `held_ns` per read and whose SM clock reads
    `clocks` in turn (memory clock 2619 MHz, 412.5 W, 61 C); `counters=False`: a driver without violation counters,
    `reasons=None`: one that cannot tell clock-event reasons."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU, NVML_DEVICE_MIG_ENABLE = 1, 2, 0, 1
    NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL = 0, 1

    def __init__(self, held_ns: int = 0, clocks=(1980,), reasons: int = 0, counters: bool = True):
        super().__init__(held_ns=held_ns, clocks=list(clocks), reasons=reasons, counters=counters, power=0, reads=0)

    def nvmlInit(self): pass

    def nvmlShutdown(self): pass

    def nvmlDeviceGetCount(self): return 1

    def nvmlDeviceGetHandleByIndex(self, i): return i

    def nvmlDeviceGetName(self, h): return "NVIDIA H200"

    def nvmlDeviceGetMigMode(self, h): return (0, 0)

    def nvmlDeviceGetClockInfo(self, h, kind):
        if kind == self.NVML_CLOCK_MEM:
            return 2619
        self.reads += 1
        return self.clocks[min(self.reads - 1, len(self.clocks) - 1)]

    def nvmlDeviceGetPowerUsage(self, h): return 412_500  # mW

    def nvmlDeviceGetTemperature(self, h, kind): return 61

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if self.reasons is None:
            raise self.NVMLError("not supported")
        return self.reasons

    def nvmlDeviceGetTotalEnergyConsumption(self, h): return 1_000_000 + 500 * self.reads

    def nvmlDeviceGetViolationStatus(self, h, policy):
        if not self.counters:
            raise self.NVMLError("not supported")
        if policy == self.NVML_PERF_POLICY_POWER:
            self.power += self.held_ns
            return SimpleNamespace(referenceTime=0, violationTime=self.power)
        return SimpleNamespace(referenceTime=0, violationTime=0)


def _window(monkeypatch, fake: FakeNvml, seconds: float = 2.0) -> dict:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clock = FakeClock()
    with nvml.GpuWindow(0, clock) as window:
        for _ in range(int(seconds / 0.25)):
            clock.spend(250.0)
            window.sample()
    return window.fields()


def test_a_window_held_back_by_the_power_limit_is_throttled(monkeypatch):
    out = _window(monkeypatch, FakeNvml(held_ns=400_000_000, clocks=(1980, 1755, 1515, 1620)))
    window = out["gpu_window"]
    assert out["gpu_throttled"] is True
    assert window["window_ms"] == pytest.approx(2000.0) and window["power_capped_ms"] == pytest.approx(400.0)
    assert (window["sm_clock_mhz_min"], window["sm_clock_mhz_max"]) == (1515, 1980)
    assert window["clock_samples"] == 6  # at the start, every 0.5 s of four, at the end
    record = {"step_ms": [10.0] * 20, "step_ms_rel_iqr": 0.0, "cpus_logical": 2, "torch_threads": 1, **out}
    stable, notes = timing_verdict(record, "cuda")
    assert not stable and [n.kind for n in notes] == [NoteKind.THROTTLED]
    assert "20% of the steps' time" in notes[0].text and "1515-1980 MHz" in notes[0].text


def test_a_window_held_back_less_than_its_twentieth_is_not_throttled(monkeypatch):
    out = _window(monkeypatch, FakeNvml(held_ns=10_000_000))  # 20 ms of 2 s: 1%
    assert out["gpu_throttled"] is False
    stable, _ = timing_verdict({"step_ms": [10.0] * 20, "step_ms_rel_iqr": 0.0, "cpus_logical": 2,
                                "torch_threads": 1, **out}, "cuda")
    assert stable


def test_without_violation_counters_the_sampled_reasons_decide(monkeypatch):
    assert _window(monkeypatch, FakeNvml(counters=False, reasons=0x4))["gpu_throttled"] is True  # SW power cap
    assert _window(monkeypatch, FakeNvml(counters=False, reasons=0x1 | 0x10))["gpu_throttled"] is False  # idle,
    # sync boost: not a slowdown of the work


def test_without_nvml_the_window_says_nothing(monkeypatch):
    class NoNvml(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError("no driver")

    out = _window(monkeypatch, NoNvml())
    assert out == {"gpu_window": None, "gpu_throttled": None}


def test_gpu_state_reads_clocks_power_and_temperature_through_nvml(monkeypatch):
    from gcbench import instruments

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(reasons=None))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert instruments.gpu_state(0) == {"sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_w": 412.5,
                                        "temperature_c": 61, "clock_event_reasons": None}
    assert instruments.gpu_state(1) is None  # no such GPU
