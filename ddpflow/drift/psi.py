"""The arithmetic every kind's drift shares: the population stability index over counts, over two dyadic
histograms re-binned onto their common grid, over category frequencies; the per-feature result
(``FeatureDrift``) and the error when drift cannot be measured (``DriftUnavailable``).

PSI, per feature: both histograms are re-binned exactly onto their common grid (the
coarser of the two widths: the grids are dyadic, so bins nest), the fine bins are
grouped into ``DRIFT_GROUPS`` groups holding about equal shares of the reference
(the usual decile bins; a value the reference never had falls in a group of its
own), and

    PSI = sum over groups of (actual - expected) * ln(actual / expected)

on the groups' proportions, each floored at ``PSI_EPSILON`` so an empty group
counts as nearly empty instead of dividing by zero. Identical data gives 0;
a rule of thumb reads < 0.1 as no real change, 0.1-0.25 as moderate, > 0.25 as large.

Missing values: a numeric feature's nulls (``nulls`` in its histogram) are one more group,
so a shift of its null rate shows as drift (none on either side adds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from training.kinds.stats import absolute_bins

DRIFT_GROUPS = 10
PSI_EPSILON = 1e-4
# Two histograms far apart on a fine grid would need many common bins: coarsen until this many suffice.
MAX_COMMON_BINS = 1 << 16


class DriftUnavailable(ValueError):
    """Drift cannot be measured (a manifest without histograms, no feature in common); the message says why."""


@dataclass(frozen=True)
class FeatureDrift:
    feature: str
    psi: float
    mean_shift: float  # (current mean - reference mean) / reference std
    reference_mean: float
    current_mean: float
    # A numeric input's train-split share of missing (null/NaN) values; their shift is part of ``psi``.
    reference_null_rate: float = 0.0
    current_null_rate: float = 0.0


def population_stability_index(expected: Any, actual: Any, epsilon: float = PSI_EPSILON) -> float:
    """PSI of ``actual`` against ``expected``: two counts (or proportions) over the same bins."""
    expected, actual = np.asarray(expected, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    if expected.shape != actual.shape or expected.ndim != 1 or len(expected) == 0:
        raise ValueError(f"PSI needs two equally long lists of bins, got shapes {expected.shape} and {actual.shape}")
    if (expected < 0).any() or (actual < 0).any() or expected.sum() <= 0 or actual.sum() <= 0:
        raise ValueError("PSI needs non-negative counts with a positive total on both sides")
    expected = np.maximum(expected / expected.sum(), epsilon)
    actual = np.maximum(actual / actual.sum(), epsilon)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def histogram_psi(reference: dict[str, Any], current: dict[str, Any], groups: int = DRIFT_GROUPS) -> float:
    """PSI between two ``RunningHistogram`` entries of one feature (see the module docstring)."""
    present = (sum(reference["counts"]), sum(current["counts"]))
    if not all(present):  # a column of nothing but missing values on a side: present against missing alone
        expected, actual = [present[0], reference.get("nulls", 0)], [present[1], current.get("nulls", 0)]
        return population_stability_index(expected, actual)
    reference_counts, current_counts = common_grid(reference, current)
    group = equal_share_groups(reference_counts, groups)
    expected = np.bincount(group, weights=reference_counts)
    actual = np.bincount(group, weights=current_counts, minlength=len(expected))
    # The missing values are a group of their own: a shift of the null rate is drift too (none on either side:
    # a group empty on both, which adds nothing).
    expected = np.append(expected, reference.get("nulls", 0))
    actual = np.append(actual, current.get("nulls", 0))
    return population_stability_index(expected, actual)


def null_rate(histogram: dict[str, Any]) -> float:
    """The share of missing values in a ``RunningHistogram`` entry (0 where it holds no null count: before
    PREPARE_VERSION 5)."""
    nulls = int(histogram.get("nulls", 0))
    total = nulls + int(sum(histogram["counts"]))
    return nulls / total if total else 0.0


def common_grid(first: dict[str, Any], second: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Both histograms' counts on one grid: the coarser width, over the span of both. Exact: bins nest."""
    exponent = max(int(first["exponent"]), int(second["exponent"]))
    while True:
        bins = [_absolute_bins(histogram, exponent) for histogram in (first, second)]
        low = min(int(index.min()) for index, _ in bins)
        high = max(int(index.max()) for index, _ in bins)
        if high - low < MAX_COMMON_BINS:
            break
        exponent += 1
    (first_index, first_counts), (second_index, second_counts) = bins
    size = high - low + 1
    return (
        np.bincount(first_index - low, weights=first_counts, minlength=size),
        np.bincount(second_index - low, weights=second_counts, minlength=size),
    )


def _absolute_bins(histogram: dict[str, Any], exponent: int) -> tuple[np.ndarray, np.ndarray]:
    """(absolute bin at width 2**exponent, count) for each non-empty bin of ``histogram``."""
    if not any(histogram["counts"]):
        raise DriftUnavailable("a feature histogram holds no values")
    absolute, counts = absolute_bins(histogram, exponent)
    return absolute, counts.astype(np.float64)


def equal_share_groups(reference: np.ndarray, groups: int) -> np.ndarray:
    """Each fine bin's group: consecutive bins cut where the reference's cumulative share passes k/groups.

    Bins below the reference's range join the first group; bins above its last cut, the last
    one. A value the reference holds alone (a discrete feature) keeps a group of its own.
    """
    cumulative = np.cumsum(reference) / reference.sum()
    cuts = np.unique(np.searchsorted(cumulative, np.arange(1, groups) / groups, side="left"))
    return np.searchsorted(cuts, np.arange(len(reference)), side="left")


UNSEEN, OTHER = "__unseen__", "__other__"


def category_psi(reference: dict[str, Any], current: dict[str, Any]) -> float:
    """PSI over category frequencies: the reference's categories, its "other" bucket, and an "unseen" bucket
    for the current values the reference never had."""
    names = list(reference["counts"])
    expected = [*(reference["counts"][name] for name in names), reference.get("other", 0), 0]
    seen = set(names)
    unseen = sum(count for name, count in current["counts"].items() if name not in seen)
    actual = [*(current["counts"].get(name, 0) for name in names), current.get("other", 0), unseen]
    return population_stability_index(expected, actual)
