"""Pearson chi-square goodness of fit for the sampled-speculation tests (no scipy here)."""

from __future__ import annotations

import numpy as np

# Critical values at significance 1e-6, by degrees of freedom. test_speculate_sampled draws
# fresh seeds every run and makes ~20 checks a suite run: at 1e-3 a correct rule failed about
# one run in 50 (a local run hit it); at 1e-6, about one in 50000. The rules these checks guard
# against (a redraw from p instead of (p - q)+ after a rejection, a reused uniform, the bonus
# token from the wrong row) move the statistic into the hundreds at their counts.
CHI2_CRITICAL = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}


def assert_distribution(tokens: list[int], p: np.ndarray) -> None:
    """The tokens' counts against len(tokens) * p: nothing outside p's support, the chi-square
    statistic under the critical value. Cells expecting fewer than 5 draws are pooled into one
    (the usual validity condition of the chi-square approximation)."""
    n, p = len(tokens), np.asarray(p, np.float64)
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, (counts, p)
    small = (p > 0) & (n * p < 5)
    observed = [*counts[(p > 0) & ~small]] + ([counts[small].sum()] if small.any() else [])
    expected = n * np.array([*p[(p > 0) & ~small]] + ([p[small].sum()] if small.any() else []))
    assert len(expected) >= 2, "too few cells for a test"
    chi2 = float(((np.array(observed) - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL[len(expected) - 1], (chi2, observed, expected)
