"""The drift measures of the categorical, vector, datetime and image inputs (each kind's record names its measure:
``Codec.drift_measure``), from prepare's train-split statistics (``Manifest.extra["drift_stats"]["inputs"][name]``);
each ``(name, reference, current) -> [FeatureDrift]``:

- ``frequencies`` (a categorical input): PSI over its category frequencies (the reference's most
  frequent values, the rest as one "other" bucket, and one "unseen" bucket for
  values the reference never had); mean shift 0;
- ``dimension_means`` (a vector input): the mean shift of each dimension, the largest in size
  reported (``feature`` is ``name[d]``); PSI 0 (no histogram per dimension); nothing when the two
  datasets' vectors differ in length;
- ``histograms`` (an image or datetime input): PSI over each histogram its statistics hold, an image's width,
  height and mean brightness (``feature`` is ``name:width``, ``name:height``, ``name:brightness``), a time's hour
  of day, weekday and month (``name:hour``, ``name:day_of_week``, ``name:month``); mean shift 0.

A text input's drift (``words``) is text.py's. report.py picks the function by the measure.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpflow.drift.psi import FeatureDrift, category_psi, histogram_psi


def categorical_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> list[FeatureDrift]:
    return [FeatureDrift(name, category_psi(reference, current), 0.0, 0.0, 0.0)]


def vector_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> list[FeatureDrift]:
    if len(reference["mean"]) != len(current["mean"]):
        return []
    before, after = np.asarray(reference["mean"]), np.asarray(current["mean"])
    shifts = (after - before) / np.asarray(reference["std"])
    worst = int(np.argmax(np.abs(shifts)))
    return [FeatureDrift(f"{name}[{worst}]", 0.0, float(shifts[worst]), float(before[worst]), float(after[worst]))]


def _measure_drift(name: str, measure: str, reference: dict[str, Any], current: dict[str, Any]) -> FeatureDrift:
    """PSI of one measure of an image input (``feature`` is ``name:width``...); mean shift 0."""
    return FeatureDrift(f"{name}:{measure}", histogram_psi(reference[measure], current[measure]), 0.0, 0.0, 0.0)


def histograms_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> list[FeatureDrift]:
    """One entry per histogram the statistics hold (every entry but "kind", in the reference's order)."""
    measures = [measure for measure in reference if measure != "kind" and measure in current]
    return [_measure_drift(name, measure, reference, current) for measure in measures]
