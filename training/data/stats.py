"""Per-column mean and standard deviation, merged batch by batch (Chan et al.).

Prepare keeps one for the train split's features and, for regression, one for
its target (``Manifest.label_mean/label_std``).

Each batch's own mean and squared deviations are computed in float64 with
numpy, then merged into the running totals; this is as accurate as one
``numpy.mean``/``numpy.std`` over all rows, without holding them.
"""

from __future__ import annotations

import numpy as np


class RunningMoments:
    def __init__(self, n_features: int):
        self.count = 0
        self.mean = np.zeros(n_features, dtype=np.float64)
        self.m2 = np.zeros(n_features, dtype=np.float64)

    def update(self, columns: np.ndarray) -> None:
        """``columns``: shape (n_features, rows), any float dtype."""
        rows = columns.shape[1]
        if rows == 0:
            return
        centered = columns.astype(np.float64)  # a copy, centred in place below
        batch_mean = centered.mean(axis=1)
        centered -= batch_mean[:, None]
        batch_m2 = np.einsum("ij,ij->i", centered, centered)  # no squared temporary: 3x faster
        total = self.count + rows
        delta = batch_mean - self.mean
        self.mean += delta * (rows / total)
        self.m2 += batch_m2 + np.square(delta) * (self.count * rows / total)
        self.count = total

    def std(self) -> np.ndarray:
        """Population std (numpy's default ddof=0); 0 -> 1 so normalising never divides by zero."""
        std = np.sqrt(self.m2 / max(self.count, 1))
        return np.where(std > 0, std, 1.0)
