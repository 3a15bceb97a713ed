"""Data drift of a dataset from another, per feature: the population stability index and the mean shift.

    report = compare(reference_manifest, current_manifest)   # the champion's training data, a new run's
    report = compare(reference_manifest, Profile.of_scored_table(profile, source_fingerprint))   # a scored table
    report.max_psi, report.worst, report.top(5)

Plain numbers from the two datasets' statistics alone (no shard is read, no MLflow, no Prefect): prepare keeps
each numeric feature's train-split histogram on a dyadic grid (``training/kinds/stats.py: RunningHistogram``)
beside its mean and std, in the manifest; a batch scoring keeps the same of the rows it scored, and the same
per-kind statistics (``training/inference/scored_drift.py: scored_profile``). ``Profile`` is what is compared,
from either; the PSI is psi.py's.

Mean shift, per feature: (current mean - reference mean) / reference std, the
shift in units of the reference's spread (the mean over the present values). A numeric
feature's null rates are reported beside it (``reference_null_rate``, ``current_null_rate``);
their shift is part of its PSI (psi.py).

Other input kinds and the label, from the manifests' ``extra["drift_stats"]``
(prepare's train-split counts, training/prepare/dataset.py): each input's drift is the measure its kind's
record names (``Codec.drift_measure``), the function ``DRIFT_MEASURES`` holds for it (kinds.py: category
frequencies, vector dimension means, named histograms; text.py: lengths and words); an input whose kind names
none, or is not registered here, is left out. The label (``DriftReport.label``, ``feature`` is
``label:<name>``): PSI over the class counts (classification) or its histogram (regression); not an input, so
not part of ``max_psi`` (what the gate's max_drift_psi reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ddpflow.drift.kinds import categorical_drift, histograms_drift, vector_drift
from ddpflow.drift.psi import DriftUnavailable, FeatureDrift, category_psi, histogram_psi, null_rate
from ddpflow.drift.text import text_drift
from training.core.manifest import Manifest
from training.kinds.registry import kind_record

# A drift measure (``Codec.drift_measure``) -> its drift: (name, reference stats, current stats) -> the entries
# of the report.
DRIFT_MEASURES: dict[str, Callable[[str, dict[str, Any], dict[str, Any]], list[FeatureDrift]]] = {
    "frequencies": categorical_drift,
    "dimension_means": vector_drift,
    "histograms": histograms_drift,
    "words": text_drift,
}


def drift_of(kind: str) -> Callable[[str, dict[str, Any], dict[str, Any]], list[FeatureDrift]] | None:
    """The drift function of input kind ``kind``'s measure; None for a kind that has none or is not known."""
    try:
        measure = kind_record(kind).drift_measure
    except ValueError:  # a plugin kind of another environment: nothing to compare it with
        return None
    return DRIFT_MEASURES.get(measure)


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


@dataclass(frozen=True)
class Profile:
    """What drift compares of a dataset: the numeric features' means, stds and histograms (``features`` order),
    the other inputs' and the label's statistics (``drift_stats``: ``{"inputs": {name: stats}, "label": ...}``)."""

    fingerprint: str
    features: list[str]
    feature_mean: list[float]
    feature_std: list[float]
    feature_histograms: list[dict[str, Any]] | None
    drift_stats: dict[str, Any] | None = None
    label: str | None = None  # a scored table has none
    label_mapping: list[Any] | None = None

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> Profile:
        """A prepared dataset's train split."""
        return cls(manifest.fingerprint, manifest.features, manifest.feature_mean, manifest.feature_std,
                   manifest.feature_histograms, manifest.extra.get("drift_stats"), manifest.label,
                   manifest.label_mapping)  # fmt: skip

    @classmethod
    def of_scored_table(cls, profile: dict[str, Any], fingerprint: str) -> Profile:
        """A batch scoring's table (``scored_profile``'s dict; ``fingerprint``: its source's)."""
        return cls(fingerprint, profile["features"], profile["feature_mean"], profile["feature_std"],
                   profile["feature_histograms"], profile["drift_stats"])  # fmt: skip


def compare(reference: Manifest | Profile, current: Manifest | Profile) -> DriftReport:
    """Drift of ``current`` (a manifest's train split, or a ``Profile``) from ``reference``'s, for every feature
    both have."""
    reference, current = _profile(reference), _profile(current)
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


def _profile(data: Manifest | Profile) -> Profile:
    return data if isinstance(data, Profile) else Profile.of_manifest(data)


def _feature_drift(name: str, reference: Profile, i: int, current: Profile, j: int) -> FeatureDrift:
    reference_mean, current_mean = float(reference.feature_mean[i]), float(current.feature_mean[j])
    spread = float(reference.feature_std[i]) or 1.0  # prepare stores 1 for a constant feature already
    return FeatureDrift(
        feature=name,
        psi=histogram_psi(reference.feature_histograms[i], current.feature_histograms[j]),
        mean_shift=(current_mean - reference_mean) / spread,
        reference_mean=reference_mean,
        current_mean=current_mean,
        reference_null_rate=null_rate(reference.feature_histograms[i]),
        current_null_rate=null_rate(current.feature_histograms[j]),
    )


def other_kinds_drift(reference: Profile, current: Profile) -> list[FeatureDrift]:
    """Drift of the non-numeric inputs both datasets have, with the same kind on both sides (``drift_of``)."""
    ref, cur = reference.drift_stats, current.drift_stats
    if not ref or not cur:
        return []
    drifts = []
    for name, stats in cur["inputs"].items():
        before = ref["inputs"].get(name)
        drift = drift_of(stats["kind"])
        if before is None or before["kind"] != stats["kind"] or drift is None:
            continue
        drifts += drift(name, before, stats)
    return drifts


def label_drift(reference: Profile, current: Profile) -> FeatureDrift | None:
    """The label's distribution (``feature`` is ``label:<name>``); None without the statistics or the same label."""
    ref, cur = reference.drift_stats, current.drift_stats
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
