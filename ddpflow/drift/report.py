"""Data drift between two prepared datasets, per feature: the population stability index and the mean shift.

    report = compare(reference_manifest, current_manifest)   # the champion's training data, a new run's
    report.max_psi, report.worst, report.top(5)

Plain numbers from the two manifests alone (no shard is read, no MLflow, no Prefect):
prepare keeps each feature's train-split histogram on a dyadic grid
(``training/data/stats.py: RunningHistogram``) beside its mean and std.

PSI, per feature: both histograms are re-binned exactly onto their common grid (the
coarser of the two widths: the grids are dyadic, so bins nest), the fine bins are
grouped into ``DRIFT_GROUPS`` groups holding about equal shares of the reference
(the usual decile bins; a value the reference never had falls in a group of its
own), and

    PSI = sum over groups of (actual - expected) * ln(actual / expected)

on the groups' proportions, each floored at ``PSI_EPSILON`` so an empty group
counts as nearly empty instead of dividing by zero. Identical data gives 0;
a rule of thumb reads < 0.1 as no real change, 0.1-0.25 as moderate, > 0.25 as large.

Mean shift, per feature: (current mean - reference mean) / reference std, the
shift in units of the reference's spread.

Other input kinds and the label, from the manifests' ``extra["drift_stats"]``
(prepare's train-split counts, training/data/prepare.py):
- a categorical input: PSI over its category frequencies (the reference's most
  frequent values, the rest as one "other" bucket, and one "unseen" bucket for
  values the reference never had); mean shift 0;
- a vector input: the mean shift of each dimension, the largest in size
  reported (``feature`` is ``name[d]``); PSI 0 (no histogram per dimension);
- an image input: PSI over the histograms of its images' width, height and mean brightness
  (``feature`` is ``name:width``, ``name:height``, ``name:brightness``); mean shift 0;
- a text input: its token-length distribution, word frequencies and out-of-vocabulary
  rate, unknown-token rate (ddpflow/text_drift.py);
- the label (``DriftReport.label``, ``feature`` is ``label:<name>``): PSI over
  the class counts (classification) or its histogram (regression); not an
  input, so not part of ``max_psi`` (what the gate's max_drift_psi reads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from training.data.manifest import Manifest

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


@dataclass(frozen=True)
class DriftReport:
    """Every feature the two datasets share, most drifted first (by PSI, then by the size of the mean shift)."""

    reference_fingerprint: str
    current_fingerprint: str
    features: tuple[FeatureDrift, ...]
    only_in_reference: tuple[str, ...] = ()
    only_in_current: tuple[str, ...] = ()
    label: FeatureDrift | None = None  # the label's distribution; not an input, so not in max_psi

    @property
    def max_psi(self) -> float:
        return self.features[0].psi

    @property
    def worst(self) -> FeatureDrift:
        return self.features[0]

    def top(self, count: int = 5) -> tuple[FeatureDrift, ...]:
        return self.features[:count]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "max_psi": self.max_psi, "worst_feature": self.worst.feature}


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
    reference_counts, current_counts = common_grid(reference, current)
    group = _equal_share_groups(reference_counts, groups)
    expected = np.bincount(group, weights=reference_counts)
    actual = np.bincount(group, weights=current_counts, minlength=len(expected))
    return population_stability_index(expected, actual)


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
    counts = np.asarray(histogram["counts"], dtype=np.float64)
    kept = np.flatnonzero(counts)
    if len(kept) == 0:
        raise DriftUnavailable("a feature histogram holds no values")
    absolute = (int(histogram["offset"]) + kept) >> (exponent - int(histogram["exponent"]))
    return absolute, counts[kept]


def _equal_share_groups(reference: np.ndarray, groups: int) -> np.ndarray:
    """Each fine bin's group: consecutive bins cut where the reference's cumulative share passes k/groups.

    Bins below the reference's range join the first group; bins above its last cut, the last
    one. A value the reference holds alone (a discrete feature) keeps a group of its own.
    """
    cumulative = np.cumsum(reference) / reference.sum()
    cuts = np.unique(np.searchsorted(cumulative, np.arange(1, groups) / groups, side="left"))
    return np.searchsorted(cuts, np.arange(len(reference)), side="left")


def compare(reference: Manifest, current: Manifest) -> DriftReport:
    """Drift of ``current``'s train split from ``reference``'s, for every feature both have."""
    for manifest, which in ((reference, "reference"), (current, "current")):
        if manifest.feature_histograms is None:
            raise DriftUnavailable(
                f"the {which} dataset {manifest.fingerprint} was prepared without feature histograms "
                "(by an older ddpflow); drift needs both datasets prepared by this version"
            )
    reference_index = {name: i for i, name in enumerate(reference.features)}
    current_index = {name: i for i, name in enumerate(current.features)}
    shared = [name for name in current.features if name in reference_index]
    drifts = [_feature_drift(name, reference, reference_index[name], current, current_index[name]) for name in shared]
    drifts += other_kinds_drift(reference, current)
    if not drifts:
        raise DriftUnavailable(
            f"datasets {reference.fingerprint} and {current.fingerprint} have no feature column in common"
        )
    drifts.sort(key=lambda drift: (-drift.psi, -abs(drift.mean_shift), drift.feature))
    return DriftReport(
        reference_fingerprint=reference.fingerprint,
        current_fingerprint=current.fingerprint,
        features=tuple(drifts),
        only_in_reference=tuple(name for name in reference.features if name not in current_index),
        only_in_current=tuple(name for name in current.features if name not in reference_index),
        label=label_drift(reference, current),
    )


def _feature_drift(name: str, reference: Manifest, i: int, current: Manifest, j: int) -> FeatureDrift:
    reference_mean, current_mean = float(reference.feature_mean[i]), float(current.feature_mean[j])
    spread = float(reference.feature_std[i]) or 1.0  # prepare stores 1 for a constant feature already
    return FeatureDrift(
        feature=name,
        psi=histogram_psi(reference.feature_histograms[i], current.feature_histograms[j]),
        mean_shift=(current_mean - reference_mean) / spread,
        reference_mean=reference_mean,
        current_mean=current_mean,
    )


# ---------------------------------------------------------------- other input kinds and the label

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


def other_kinds_drift(reference: Manifest, current: Manifest) -> list[FeatureDrift]:
    """Drift of the categorical and vector inputs both datasets have (module docstring)."""
    ref, cur = reference.extra.get("drift_stats"), current.extra.get("drift_stats")
    if not ref or not cur:
        return []
    drifts = []
    for name, stats in cur["inputs"].items():
        before = ref["inputs"].get(name)
        if before is None or before["kind"] != stats["kind"]:
            continue
        if stats["kind"] == "categorical":
            drifts.append(FeatureDrift(name, category_psi(before, stats), 0.0, 0.0, 0.0))
        elif stats["kind"] == "vector" and len(before["mean"]) == len(stats["mean"]):
            drifts.append(_vector_drift(name, before, stats))
        elif stats["kind"] == "image":
            drifts += [_image_drift(name, measure, before, stats) for measure in IMAGE_MEASURES]
        elif stats["kind"] == "text":
            from ddpflow.text_drift import text_drift  # its own module (it uses this one's PSI)

            drifts += text_drift(name, before, stats)
    return drifts


def _vector_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> FeatureDrift:
    before, after = np.asarray(reference["mean"]), np.asarray(current["mean"])
    shifts = (after - before) / np.asarray(reference["std"])
    worst = int(np.argmax(np.abs(shifts)))
    return FeatureDrift(f"{name}[{worst}]", 0.0, float(shifts[worst]), float(before[worst]), float(after[worst]))


IMAGE_MEASURES = ("width", "height", "brightness")  # an image input's train histograms (training/spec/image.py)


def _image_drift(name: str, measure: str, reference: dict[str, Any], current: dict[str, Any]) -> FeatureDrift:
    """PSI of one measure of an image input (``feature`` is ``name:width``...); mean shift 0."""
    return FeatureDrift(f"{name}:{measure}", histogram_psi(reference[measure], current[measure]), 0.0, 0.0, 0.0)


def label_drift(reference: Manifest, current: Manifest) -> FeatureDrift | None:
    """The label's distribution (``feature`` is ``label:<name>``); None without the statistics or the same label."""
    ref, cur = reference.extra.get("drift_stats"), current.extra.get("drift_stats")
    if not ref or not cur or reference.label != current.label or ref["label"]["kind"] != cur["label"]["kind"]:
        return None
    name, before, after = f"label:{current.label}", ref["label"], cur["label"]
    if before["kind"] == "histogram":
        return FeatureDrift(name, histogram_psi(before["histogram"], after["histogram"]), 0.0, 0.0, 0.0)
    # Classes by their original values: the two datasets may index them differently.
    counts_before = dict(zip(map(str, reference.label_mapping), before["counts"]))
    counts_after = dict(zip(map(str, current.label_mapping), after["counts"]))
    psi = category_psi({"counts": counts_before}, {"counts": counts_after})
    return FeatureDrift(name, psi, 0.0, 0.0, 0.0)
