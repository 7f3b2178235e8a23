"""The search for the largest size that fits a memory budget: start where a prediction says, bracket, then bisect.

The sizes tried are the candidates lo, lo + k, lo + 2k, ... <= hi (k: --multiple-of). A trial of a candidate either
fits (it ran) or does not (it ran out of memory), and fitting is monotone in the size. The search keeps the
bracket: the largest candidate known to fit and the smallest known not to; it ends when they are neighbours, so
the answer is exact: the maximum ran and the next candidate ran out of memory (or the maximum is the range's top, or
nothing fits).

Where to try next is a guess from what is known (the prediction before any trial, then the measured peaks), used
only while it cannot break the bound: never more than ceil(log2(number of candidates)) + 2 trials. Past that, the
midpoint. A guess that is exact costs two trials (the maximum and the next one); one off, three.
Pure: no torch, no runs. `Search` is driven by the caller (real runs in fits/fit.py, predictions in
fits/predict.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trial:
    """One tried size: whether it fit, and what is known of its peak (bytes; None for a real out-of-memory)."""

    value: int
    fits: bool
    peak: int | None = None
    state: int | None = None  # model state (params, grads, optimizer) under that peak, bytes: the size-free part


@dataclass
class Search:
    """The candidates, the bracket and the trials so far. `budget`: the bytes a fitting peak stays within (only
    the guesses read it)."""

    lo: int
    hi: int
    budget: int
    multiple: int = 1
    trials: list[Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.multiple < 1 or self.lo < 1 or self.hi < self.lo:
            raise ValueError(f"empty range {self.lo}..{self.hi} (multiple of {self.multiple})")
        self.lo = -(-self.lo // self.multiple) * self.multiple  # the first candidate: a multiple in the range
        if self.lo > self.hi:
            raise ValueError(f"no multiple of {self.multiple} in {self.lo}..{self.hi}")
        self.n = (self.hi - self.lo) // self.multiple + 1
        self.bound = math.ceil(math.log2(self.n)) + 2

    # candidate index <-> size
    def value(self, index: int) -> int:
        return self.lo + index * self.multiple

    def index(self, value: int) -> int:
        return (value - self.lo) // self.multiple

    @property
    def fit_index(self) -> int:
        """Index of the largest candidate known to fit; -1: none yet."""
        return max((self.index(t.value) for t in self.trials if t.fits), default=-1)

    @property
    def oom_index(self) -> int:
        """Index of the smallest candidate known not to fit; n: none yet."""
        return min((self.index(t.value) for t in self.trials if not t.fits), default=self.n)

    @property
    def done(self) -> bool:
        return self.oom_index == self.fit_index + 1

    @property
    def maximum(self) -> int | None:
        """The largest size that fits, once done; None when nothing in the range fits."""
        return self.value(self.fit_index) if self.fit_index >= 0 else None

    @property
    def next_up(self) -> int | None:
        """The candidate after the maximum (it ran out of memory); None when the maximum is the range's top."""
        return self.value(self.oom_index) if self.oom_index < self.n else None

    def next_value(self, guess: int | None, measured: bool = False) -> int:
        """The size to try next, given a guess of the largest that fits (None: no guess; `measured`: made from
        measured peaks, not a prediction alone): the guess moved into the bracket, where that keeps the bound (its
        worse outcome must leave a bracket bisection can close in the trials left), else the bracket's midpoint.
        A measured guess tries the size after it first: if that does not fit, the guess is the answer's last trial."""
        if self.done:
            raise ValueError("the search is done")
        low, high = self.fit_index, self.oom_index
        if guess is not None:
            at = (guess - self.lo) // self.multiple
            at = low + 1 if at <= low else at + 1 if measured and at + 1 < high else min(at, high - 1)
            worst = max(at - low, high - at)
            if len(self.trials) + 1 + _bisections(worst) <= self.bound:
                return self.value(at)
        return self.value((low + high) // 2)

    def add(self, trial: Trial) -> None:
        at = self.index(trial.value)
        if trial.fits and at >= self.oom_index or not trial.fits and at <= self.fit_index:
            raise ValueError(f"size {trial.value} {'fit' if trial.fits else 'did not fit'}, against the sizes tried "
                             "before: memory is not monotone in the size here")
        self.trials.append(trial)

    def run(self, attempt: Callable[[int], Trial],
            guess: Callable[[Search], tuple[int | None, bool]]) -> Search:
        """Try sizes until done: `attempt(size)` runs (or predicts) one, `guess(search)` says where the maximum is
        believed to be and whether from measured peaks (extrapolate)."""
        while not self.done:
            self.add(attempt(self.next_value(*guess(self))))
        return self


def _bisections(gap: int) -> int:
    """Trials a bisection needs to close a bracket whose ends are `gap` candidates apart."""
    return math.ceil(math.log2(gap)) if gap > 1 else 0


def extrapolate(search: Search, prior: int | None = None, exponent: float = 1.0) -> tuple[int | None, bool]:
    """(a guess of the largest size whose peak stays within the budget, whether it comes from measured peaks):
    through the two known peaks nearest the budget (a secant), else from one peak and its model state (the rest
    of the peak grows as size ** exponent), else `prior` (a prediction made before any trial). A prior that ran
    out of memory is stepped down twice: to the size below it, then 5% below that; a third failure means the
    prediction is far off, and the search bisects (None) until a trial runs and gives a measured peak."""
    known = sorted((t for t in search.trials if t.peak is not None), key=lambda t: abs(t.peak - search.budget))
    if len(known) >= 2:
        a, b = sorted(known[:2], key=lambda t: t.value)
        if b.value != a.value and b.peak > a.peak:
            return math.floor(a.value + (search.budget - a.peak) * (b.value - a.value) / (b.peak - a.peak)), True
    if known and known[0].state is not None and known[0].peak > known[0].state:
        t = known[0]
        room = (search.budget - t.state) / (t.peak - t.state)
        return (math.floor(t.value * room ** (1 / exponent)) if room > 0 else search.lo - 1), True
    if prior is None:
        return None, False
    failed = [t.value for t in search.trials if not t.fits and t.value <= prior]
    if not failed:
        return prior, False
    below = min(failed) - search.multiple
    if len(failed) > 2:
        return None, False
    return (below if len(failed) == 1 else math.floor(below * 0.95)), False
