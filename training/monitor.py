"""The one rule for a metric's direction and for what counts as better.

Shared by the champion gate (``ddpflow/tracking/gate.py``, ``registry.metric``) and the
trainer's model selection and early stopping (``training/selection.py``, ``train.monitor``):
a metric whose name says it is a loss or an error is better lower, every other one higher.
"""

from __future__ import annotations

import math

LOWER_IS_BETTER_WORDS = ("loss", "rmse", "mae", "mse", "error")


def higher_is_better(metric: str) -> bool:
    """Inferred from the name: ``val_loss``, ``test_rmse``... lower; ``val_accuracy``, ``test_f1``... higher."""
    return not any(word in metric for word in LOWER_IS_BETTER_WORDS)


def is_better(candidate: float, reference: float, higher_is_better: bool, min_delta: float) -> bool:
    """``candidate`` beats ``reference`` by more than ``min_delta``; a NaN never beats anything."""
    if not math.isfinite(candidate):
        return False
    return candidate > reference + min_delta if higher_is_better else candidate < reference - min_delta
