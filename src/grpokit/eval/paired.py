"""How sure a before/after change is: the same questions graded twice, so the change is the mean of
per-question differences, with a normal-approximation interval over them."""

from __future__ import annotations

import math
from dataclasses import dataclass

Z_95 = 1.959964  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class PairedChange:
    change: float  # after - before, as a share of the questions
    low: float  # the 95% interval of the change
    high: float
    gained: int  # questions wrong before and right after
    lost: int  # right before, wrong after
    n: int

    def describe(self) -> str:
        """"+34.7 pt, 95% interval [+27.7, +41.6] pt (300 questions: 126 gained, 22 lost)"."""
        return (f"{100 * self.change:+.1f} pt, 95% interval [{100 * self.low:+.1f}, {100 * self.high:+.1f}] pt "
                f"({self.n} questions: {self.gained} gained, {self.lost} lost)")


def paired_change(before: list[bool], after: list[bool]) -> PairedChange:
    """d_i = after_i - before_i in {-1, 0, 1}; the change is mean(d), its interval mean(d) +- z * s / sqrt(n),
    with s the sample standard deviation of d (n - 1 in the denominator)."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired_change needs the same questions before and after, got {len(before)} and {len(after)}")
    diffs = [int(a) - int(b) for b, a in zip(before, after)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = Z_95 * sd / math.sqrt(n)
    return PairedChange(mean, mean - half, mean + half, diffs.count(1), diffs.count(-1), n)
