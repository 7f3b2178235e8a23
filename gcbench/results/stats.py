"""The statistics of raw samples (per-step milliseconds, per-round ratios): the one place medians, IQRs and the
median's 95% interval are computed. timing.py measures with them; compare.py judges two results with them, from
the raw samples every record keeps, so that older records are judged by the same rule as new ones.

Consecutive steps are not independent: a step that shares the machine with a busy neighbour is followed by another
one (lag-1 autocorrelation 0.2-0.8 on a shared CPU), so n correlated steps know the median as well as fewer
independent ones would; and a machine's speed drifts in spells of seconds (a virtual machine's neighbours, a GPU's
power cap), so that a rerun, another process minutes later, meets another spell. The interval here is made for both
(docs/methodology.md, "How many steps"): it covers what a rerun would see as far as the steps span the spells.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gcbench.results.schema import fastest, half_width

CONFIDENCE = 0.95
# The fewest samples with an interval: min..max of 6 independent samples brackets the median with probability
# 1 - 2 * 0.5**6 = 96.9% (5: 93.8%); correlated samples need more.
MIN_SAMPLES = 6
# The small-sample estimate of an autocorrelation is biased low and noisy (its standard error is about 1/sqrt(n)):
# half a standard error is added, so that a series that is correlated but happens to look less so still gets an
# interval wide enough (calibrated on simulated AR(1) series: tests/test_timing.py).
RHO_MARGIN = 0.5
RHO_MAX = 0.99


@dataclass(frozen=True)
class Stats:
    """Summary of raw samples (e.g. per-step milliseconds): the one place medians, IQRs and intervals are computed."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int
    ci: tuple[float, float] | None  # 95% interval of the median (median_interval); None when it cannot be bounded

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        xs = list(samples)
        if not xs:
            raise ValueError("no samples")
        s = sorted(xs)
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0],) * 3
        return cls(statistics.median(s), q1, q3, s[0], s[-1], len(s), median_interval(xs))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        return self.iqr / self.median if self.median else math.inf

    @property
    def bounds(self) -> tuple[float, float]:
        """The median's interval, or where there is none the samples' range (the least the interval could be)."""
        return self.ci if self.ci is not None else (self.min, self.max)

    @property
    def ci_half_width(self) -> float | None:
        """The interval's larger distance from the median, relative to it (0.02 = +-2%); None without an interval."""
        return half_width(self.median, self.ci)


# Slow drift: the samples in BATCHES consecutive batches of at least BATCH_SIZE each, their medians' mean and its
# Student-t interval (the method of batch means; Schmeiser 1982 finds 10-30 batches enough). A batch holds a spell
# the sign test's lag-1 model cannot see: on this project's 2-core VM, a tiny model's 15 ms steps run in spells of
# 1-3 s at 13-21 ms (benchmarks/rerun_interval.py).
BATCHES = 10
BATCH_SIZE = 3
# Student's t, two-sided 95%, by degrees of freedom (any t table; statistics has no t distribution)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The median's 95% interval for samples in the order they were measured: the sign test's (sign_test_interval:
    correlated neighbours, skewed samples), widened to the batch medians' (batch_interval: drift in spells longer
    than a few samples) where that is wider. None where the sign test can bound nothing."""
    ci = sign_test_interval(samples, confidence)
    batches = batch_interval(samples) if confidence == CONFIDENCE else None
    if ci is None or batches is None:
        return ci
    return min(ci[0], batches[0]), max(ci[1], batches[1])


def batch_interval(samples: Sequence[float]) -> tuple[float, float] | None:
    """The 95% interval of the samples' level from the medians of BATCHES consecutive batches: their mean +- t *
    sd / sqrt(batches), the variance widened for the batch medians' own lag-1 autocorrelation (a spell longer than
    a batch; estimated, bias-corrected and margined as the sign test's is, and applied as an AR(1) mean's variance
    inflation 1 + 2 sum_j (1 - j/b) rho^j). None below BATCHES * BATCH_SIZE samples."""
    n, b = len(samples), BATCHES
    if n < b * BATCH_SIZE:
        return None
    medians = [statistics.median(samples[i * n // b:(i + 1) * n // b]) for i in range(b)]
    mean, sd = statistics.fmean(medians), statistics.stdev(medians)
    if sd == 0:
        return mean, mean
    d = [m - mean for m in medians]
    lag1 = sum(x * y for x, y in zip(d, d[1:])) / sum(x * x for x in d)
    rho = min(RHO_MAX, (b * lag1 + 1) / (b - 4) + RHO_MARGIN / math.sqrt(b))
    inflation = 1 + 2 * sum((1 - j / b) * rho ** j for j in range(1, b)) if rho > 0 else 1.0
    half = T_975[b - 1] * sd * math.sqrt(inflation / b)
    return mean - half, mean + half


def sign_test_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The median's interval for samples in the order they were measured (correlated, skewed): the order statistics
    x(k) and x(n+1-k) of the sign test, its variance widened for the samples' autocorrelation.

    The count of samples below the true median has variance n/4 for independent samples; for a series whose ranks
    behave like a Gaussian AR(1) with lag-1 autocorrelation rho it is n*f/4, f = 1 + 2 sum_j (1 - j/n) (2/pi)
    asin(rho**j) (n/f is the effective sample size). rho is estimated from the ranks (robust to a descheduled step
    10x slower), corrected for its small-sample bias, plus RHO_MARGIN standard errors. k is the largest rank with
    P(count < k) <= (1 - confidence)/2 (normal approximation with continuity correction; never narrower than the
    exact binomial by more than a rank). Ranks only: the interval does not depend on the samples' distribution.

    None (nothing can be said at this confidence: even min..max is too narrow) below MIN_SAMPLES samples, or when
    the samples are too correlated for their number; samples all equal have the interval (x, x).
    """
    n = len(samples)
    if n < MIN_SAMPLES:
        return None
    xs = sorted(samples)
    if xs[0] == xs[-1]:
        return xs[0], xs[-1]
    rho = min(RHO_MAX, (n * lag1_rank_autocorrelation(samples) + 1) / (n - 4) + RHO_MARGIN / math.sqrt(n))
    z = statistics.NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    k = math.floor(n / 2 + 0.5 - z * math.sqrt(n * variance_inflation(rho, n)) / 2)
    return (xs[k - 1], xs[n - k]) if k >= 1 else None


def lag1_rank_autocorrelation(samples: Sequence[float]) -> float:
    """The lag-1 autocorrelation of the samples' ranks (ties share their mean rank); 0 when all are equal. Its
    expectation is about rho - (1 + 4 rho)/n (Marriott and Pope 1954): median_interval corrects for that."""
    n = len(samples)
    order = sorted(range(n), key=samples.__getitem__)
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and samples[order[j + 1]] == samples[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2
        i = j + 1
    d = [r - (n - 1) / 2 for r in ranks]
    spread = sum(v * v for v in d)
    return sum(a * b for a, b in zip(d, d[1:])) / spread if spread else 0.0


def variance_inflation(rho: float, n: int) -> float:
    """How much the variance of the count of n samples below the median grows over independent samples, for a
    series that is a monotone transform of a Gaussian AR(1) with lag-1 autocorrelation rho (the indicators' lag-j
    correlation is (2/pi) asin(rho**j)); 1 for rho <= 0 (a negative correlation would narrow it: not relied on)."""
    if rho <= 0:
        return 1.0
    total, power = 0.0, rho
    for j in range(1, n):
        total += (1 - j / n) * math.asin(power)
        power *= rho
        if power < 1e-6:
            break
    return 1 + 4 / math.pi * total


def clearly_different(old: float, old_interval: Sequence[float], new: float, new_interval: Sequence[float]) -> bool:
    """Whether two medians differ past their combined noise: by more than the square root of the sum of the squares
    of their intervals' facing half-widths (old's upper side and new's lower side when new is larger): two
    independent 95% intervals make one of their difference."""
    up = new >= old
    a = old_interval[1] - old if up else old - old_interval[0]
    b = new - new_interval[0] if up else new_interval[1] - new
    return abs(new - old) > math.hypot(a, b)


def tokens_per_step(record: Mapping[str, Any]) -> int:
    return record["batch_size"] * record["seq_len"] * (record.get("grad_accum") or 1)


def told_apart(a: Mapping[str, Any], b: Mapping[str, Any], paired: bool) -> bool | None:
    """Whether record a's speed (tokens/s; a fit's winners differ in size) is clearly above b's, past their noise:
    True, False, or None where there is nothing to tell by (no 95% interval: too few or too correlated steps,
    paired rounds of different lengths, an older record without one), so that a table says "unsure", not "tied".
    `paired` (both timed in the same interleaved rounds, as results.schema.fastest ranks them, and their
    fit_paired_id agrees): the 95% interval of their per-round tokens/s ratio lies above 1 (the median of per-round
    ratios can disagree with the ratio of the medians, which ranks them: then a is not clearly faster); else their
    own intervals of the time per token are clearly_different, a's the lower."""
    if paired and a.get("fit_paired_id") == b.get("fit_paired_id"):  # rounds of one interleaving
        xs, ys = a.get("paired_step_ms") or [], b.get("paired_step_ms") or []
        if not xs or len(xs) != len(ys):
            return None
        ci = Stats.of([(tokens_per_step(a) / x) / (tokens_per_step(b) / y) for x, y in zip(xs, ys)]).ci
        return None if ci is None else bool(ci[0] > 1)
    if not a.get("step_ms_ci") or not b.get("step_ms_ci"):
        return None
    per_token = [(r["step_ms_median"] / tokens_per_step(r), [v / tokens_per_step(r) for v in r["step_ms_ci"]])
                 for r in (a, b)]
    return bool(per_token[0][0] < per_token[1][0] and clearly_different(*per_token[0], *per_token[1]))


@dataclass(frozen=True)
class Standing:
    """The fastest of a fit's winners (results.schema.fastest) and the others a rerun may order the other way."""

    top: Mapping[str, Any]
    tokens_per_s: float
    paired: bool  # ranked by paired timing (all winners timed interleaved) rather than separate runs
    tied: list[Mapping[str, Any]]  # not told apart from the top (told_apart is not True)
    unsure: list[Mapping[str, Any]]  # of the tied, those with nothing to tell them by (told_apart is None)


def standing(best: Sequence[Mapping[str, Any]]) -> Standing | None:
    """The fastest of `best` (a fit's winners), and which of the others are tied with it or unsure against it:
    `gcbench fit`'s recommendation and the report's fit table read the same answer."""
    if (found := fastest(best)) is None:
        return None
    top, tokens_per_s, paired = found
    others = [(r, told_apart(top, r, paired)) for r in best if r is not top]
    return Standing(top, tokens_per_s, paired, [r for r, apart in others if apart is not True],
                    [r for r, apart in others if apart is None])
