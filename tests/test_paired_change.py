"""The before/after change's 95% interval over paired questions, worked by hand."""

from __future__ import annotations

import math
import random

import pytest

from grpokit.eval.paired import Z_95, paired_change


def test_four_questions_worked_by_hand():
    # d = [1, 1, 0, -1]: mean 1/4; deviations 3/4, 3/4, -1/4, -5/4, squares sum 9/16+9/16+1/16+25/16 = 44/16,
    # s^2 = (44/16) / 3 = 11/12, s / sqrt(4) = sqrt(11/12) / 2
    c = paired_change([False, False, True, True], [True, True, True, False])
    half = Z_95 * math.sqrt(11 / 12) / 2
    assert (c.change, c.gained, c.lost, c.n) == (0.25, 2, 1, 4)
    assert c.low == pytest.approx(0.25 - half, abs=1e-12) and c.high == pytest.approx(0.25 + half, abs=1e-12)
    assert c.describe() == f"+25.0 pt, 95% interval [{100 * (0.25 - half):+.1f}, {100 * (0.25 + half):+.1f}] pt " \
                           "(4 questions: 2 gained, 1 lost)"


def test_no_change_anywhere_has_a_zero_width_interval():
    c = paired_change([True, False, True], [True, False, True])
    assert (c.change, c.low, c.high) == (0.0, 0.0, 0.0)


def test_the_interval_covers_the_true_change_about_95_percent_of_the_time():
    rng = random.Random(0)
    covered = 0
    for _ in range(400):  # each question: gained with p 0.3, lost with p 0.1; the true change is 0.2
        pairs = [(False, True) if (u := rng.random()) < 0.3 else (True, False) if u < 0.4 else (True, True)
                 for _ in range(300)]
        c = paired_change([b for b, _ in pairs], [a for _, a in pairs])
        covered += c.low <= 0.2 <= c.high
    assert 0.92 <= covered / 400 <= 0.98


def test_unpaired_lists_are_refused():
    with pytest.raises(ValueError, match="same questions"):
        paired_change([True], [True, False])
