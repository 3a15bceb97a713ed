"""What counts as better for a metric: shared by the champion gate (``ddpflow/tracking/gate.py``,
``registry.metric``) and the trainer's model selection and early stopping (``training/loop/selection.py``,
``train.monitor``).

The direction itself (lower for a loss or an error, higher for accuracy, F1, AUC...) is the one rule in
``training/core/directions.py: higher_is_better``.
"""

from __future__ import annotations

import math


def is_better(candidate: float, reference: float, higher_is_better: bool, min_delta: float) -> bool:
    """``candidate`` beats ``reference`` by more than ``min_delta``; a NaN never beats anything."""
    if not math.isfinite(candidate):
        return False
    return candidate > reference + min_delta if higher_is_better else candidate < reference - min_delta
