"""Statistics for telling a real timing change from noise (used by `pqattn compare`).

Two samples of per-call times, A (baseline) and B (candidate):
  * ratio of medians B / A with a percentile-bootstrap 95% confidence interval;
  * Mann-Whitney U two-sided p-value (normal approximation with tie and continuity corrections);
  * Cliff's delta, P(B > A) - P(B < A), in [-1, 1] (positive: B slower).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

ALPHA = 0.01  # significance level of a verdict
REGRESSION = 0.03  # a slowdown beyond this, when significant, fails the gate


@dataclass(frozen=True)
class Comparison:
    median_a: float
    median_b: float
    ratio: float  # median_b / median_a; > 1 means B is slower
    ci_low: float
    ci_high: float
    p_value: float
    cliffs_delta: float
    verdict: str  # "faster", "slower" or "same"
    regression: bool  # slower by more than REGRESSION with p < ALPHA

    def as_dict(self) -> dict:
        return asdict(self)


def _ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average ranks (1-based) and the sizes of the tie groups."""
    order = np.argsort(values, kind="mergesort")
    sorted_vals = values[order]
    _, first, counts = np.unique(sorted_vals, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0  # mean of ranks first+1 .. first+count
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(avg, counts)
    return ranks, counts


def mann_whitney_u(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(U of sample b, two-sided p-value). U_b counts pairs with b > a, ties as one half."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n1, n2 = len(a), len(b)
    ranks, ties = _ranks(np.concatenate([a, b]))
    u_b = ranks[n1:].sum() - n2 * (n2 + 1) / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - (ties**3 - ties).sum() / (n * (n - 1)))
    if var <= 0:
        return u_b, 1.0
    mean = n1 * n2 / 2.0
    z = (abs(u_b - mean) - 0.5) / math.sqrt(var)
    return u_b, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))


def cliffs_delta(a: np.ndarray, b: np.ndarray) -> float:
    """P(b > a) - P(b < a) over all pairs."""
    u_b, _ = mann_whitney_u(a, b)
    return 2.0 * u_b / (len(a) * len(b)) - 1.0


def bootstrap_ratio_ci(
    a: np.ndarray, b: np.ndarray, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of median(b) / median(a)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ma = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1)
    ratios = mb / ma
    tail = (1.0 - level) / 2.0 * 100.0
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100.0 - tail))


def compare_samples(a: list[float] | np.ndarray, b: list[float] | np.ndarray) -> Comparison:
    """Compare baseline times `a` with candidate times `b` (same unit, each with >= 2 samples)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"samples: expected at least 2 timings on each side, got {len(a)} and {len(b)}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and a.min() > 0 and b.min() > 0):
        raise ValueError("samples: expected finite positive timings")
    ma, mb = float(np.median(a)), float(np.median(b))
    ratio = mb / ma
    lo, hi = bootstrap_ratio_ci(a, b)
    _, p = mann_whitney_u(a, b)
    significant = p < ALPHA
    verdict = "same" if not significant or ratio == 1.0 else ("slower" if ratio > 1.0 else "faster")
    return Comparison(
        median_a=ma,
        median_b=mb,
        ratio=ratio,
        ci_low=lo,
        ci_high=hi,
        p_value=p,
        cliffs_delta=cliffs_delta(a, b),
        verdict=verdict,
        regression=verdict == "slower" and ratio > 1.0 + REGRESSION,
    )
