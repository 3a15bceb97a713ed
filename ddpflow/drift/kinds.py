"""Drift of the categorical, vector and image inputs, from prepare's train-split statistics
(``Manifest.extra["drift_stats"]["inputs"][name]``); each ``(name, reference, current) -> [FeatureDrift]``:

- a categorical input: PSI over its category frequencies (the reference's most
  frequent values, the rest as one "other" bucket, and one "unseen" bucket for
  values the reference never had); mean shift 0;
- a vector input: the mean shift of each dimension, the largest in size
  reported (``feature`` is ``name[d]``); PSI 0 (no histogram per dimension); nothing when the two
  datasets' vectors differ in length;
- an image input: PSI over the histograms of its images' width, height and mean brightness
  (``feature`` is ``name:width``, ``name:height``, ``name:brightness``); mean shift 0.

A text input's drift is text.py's. report.py picks the function by the input's kind.
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


IMAGE_MEASURES = ("width", "height", "brightness")  # an image input's train histograms (training/kinds/image.py)


def _image_measure_drift(name: str, measure: str, reference: dict[str, Any], current: dict[str, Any]) -> FeatureDrift:
    """PSI of one measure of an image input (``feature`` is ``name:width``...); mean shift 0."""
    return FeatureDrift(f"{name}:{measure}", histogram_psi(reference[measure], current[measure]), 0.0, 0.0, 0.0)


def image_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> list[FeatureDrift]:
    return [_image_measure_drift(name, measure, reference, current) for measure in IMAGE_MEASURES]
