"""Timing statistics on known distributions and hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from pqattn.lab import stats


def test_mann_whitney_hand_computed() -> None:
    # U_b = 9 (every b above every a); z = (|9 - 4.5| - 0.5) / sqrt(9 / 12 * 7) -> p = 0.0809
    u, p = stats.mann_whitney_u(np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0]))
    assert u == 9.0
    assert p == pytest.approx(0.080856, abs=1e-5)


def test_mann_whitney_with_ties() -> None:
    # pairs (b, a) with b > a: 2 + 7 + 4 counting ties as one half -> U_b = 13 of 16;
    # tie groups {2, 2, 2} and {3, 3, 3}: var = 16/12 * (9 - 48/56), z = 4.5 / sqrt(var) -> p = 0.17203
    u, p = stats.mann_whitney_u(np.array([1.0, 2.0, 2.0, 3.0]), np.array([2.0, 3.0, 3.0, 4.0]))
    assert u == 13.0
    assert p == pytest.approx(0.172034, abs=1e-5)
    assert stats.cliffs_delta(np.array([1.0, 2.0, 2.0, 3.0]), np.array([2.0, 3.0, 3.0, 4.0])) == 10 / 16


def test_identical_samples_are_the_same() -> None:
    a = np.full(30, 12.5)
    c = stats.compare_samples(a, a.copy())
    assert c.verdict == "same" and c.p_value == 1.0 and c.cliffs_delta == 0.0 and c.ratio == 1.0
    assert not c.regression and c.ci_low == c.ci_high == 1.0


def test_clear_slowdown_is_a_regression() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(100.0, 1.0, 60)
    b = rng.normal(110.0, 1.0, 60)
    c = stats.compare_samples(a, b)
    assert c.verdict == "slower" and c.regression
    assert c.p_value < 1e-10 and c.cliffs_delta == 1.0
    assert c.ci_low < c.ratio < c.ci_high and 1.08 < c.ratio < 1.12
    assert stats.compare_samples(b, a).verdict == "faster"


def test_small_significant_slowdown_is_not_a_regression() -> None:
    rng = np.random.default_rng(2)
    a = rng.normal(100.0, 0.2, 80)
    b = rng.normal(101.0, 0.2, 80)  # 1% slower: real, but under the 3% gate
    c = stats.compare_samples(a, b)
    assert c.verdict == "slower" and not c.regression


def test_same_distribution_is_the_same() -> None:
    rng = np.random.default_rng(3)
    c = stats.compare_samples(rng.lognormal(3.0, 0.1, 100), rng.lognormal(3.0, 0.1, 100))
    assert c.verdict == "same" and c.ci_low < 1.0 < c.ci_high


def test_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        stats.compare_samples([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite positive"):
        stats.compare_samples([1.0, float("nan")], [1.0, 2.0])
