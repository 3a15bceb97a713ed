"""The ONE normalisation of model inputs and regression targets, shared by training, evaluation and serving.

Features: ``(x - feature_mean) / feature_std``, with the train split's statistics
(prepare computes them; a constant feature's std is stored as 1). Regression
targets likewise with ``label_mean`` / ``label_std``: the model trains on the
standardised target, and ``target_inverse`` maps its outputs back to the
original scale before anyone sees them (metrics, served predictions).
Classification targets are class indices and are never touched.

A manifest or model.pt written before targets were standardised has no target
statistics: mean 0 and std 1, the raw scale that model was trained on.

    norm = Normaliser.from_manifest(manifest)   # training (training/loading/batches.py)
    norm = Normaliser.from_checkpoint(meta)     # evaluation and serving (a model.pt's entries)
    norm.features_(x)                           # in place; norm.features(x) leaves x alone
    norm.target_(y); norm.target_inverse(outputs); norm.target_loss_inverse(mse)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from training.core.manifest import Manifest

# Bump with any change to what these functions compute for the same statistics (or to what
# training/loading/batches.py: load_split returns): node caches built under the old rule
# (training/loading/node_cache.py) then get another file name and are rebuilt.
NORMALISATION_VERSION = 1


@dataclass(frozen=True)
class Normaliser:
    feature_mean: torch.Tensor  # [n_features] float32
    feature_std: torch.Tensor  # [n_features] float32, no zeros
    target_mean: float = 0.0
    target_std: float = 1.0

    @classmethod
    def from_stats(
        cls,
        feature_mean: Sequence[float],
        feature_std: Sequence[float],
        label_mean: float | None = None,
        label_std: float | None = None,
    ) -> Normaliser:
        """``label_mean``/``label_std`` None (classification, or files from before they existed): identity."""
        if label_std is not None and not label_std > 0:
            raise ValueError(f"label_std must be positive, got {label_std!r}")
        return cls(
            torch.tensor(feature_mean, dtype=torch.float32),
            torch.tensor(feature_std, dtype=torch.float32),
            0.0 if label_mean is None else float(label_mean),
            1.0 if label_std is None else float(label_std),
        )

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Normaliser:
        return cls.from_stats(manifest.feature_mean, manifest.feature_std, manifest.label_mean, manifest.label_std)

    @classmethod
    def from_checkpoint(cls, meta: Mapping[str, Any]) -> Normaliser:
        """From a model.pt's entries (``training/inference/model_file.py: inference_checkpoint``)."""
        return cls.from_stats(meta["feature_mean"], meta["feature_std"], meta.get("label_mean"), meta.get("label_std"))

    @property
    def standardises_target(self) -> bool:
        return (self.target_mean, self.target_std) != (0.0, 1.0)

    def features_(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the float32 rows ``x`` [rows, n_features] in place; returns ``x``."""
        return x.sub_(self.feature_mean).div_(self.feature_std)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """A normalised float32 copy of ``x`` (the same arithmetic as ``features_``)."""
        return self.features_(x.to(torch.float32, copy=True))

    def target_(self, y: torch.Tensor) -> torch.Tensor:
        """Standardise regression targets in place (float); class indices and unstandardised targets unchanged."""
        if self.standardises_target:
            y.sub_(self.target_mean).div_(self.target_std)
        return y

    def target_inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Model outputs (standardised scale) -> the target's original scale; a new tensor when they differ."""
        if not self.standardises_target:
            return y
        return y * self.target_std + self.target_mean

    def target_loss_inverse(self, squared_error: float) -> float:
        """A squared error (or a sum of them) on the standardised scale, on the original scale: times std^2.

        Exact, as a mean squared error scales with the square of a linear rescaling. For
        classification the std is 1, so a cross-entropy passes through unchanged.
        """
        return squared_error * self.target_std**2
