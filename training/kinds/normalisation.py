"""The ONE normalisation of model inputs and regression targets, shared by training, evaluation and serving.

Features: ``(x - center) / scale``, with the train split's statistics (prepare computes them, each numeric
input's codec from its whole train column: training/kinds/tabular.py), then, for the columns marked ``clip``,
the smooth clip ``z / sqrt(1 + (z / 3)^2)`` (RealMLP's), which keeps every value within (-3, 3) and leaves
the bulk (|z| < 1) almost as it is. A numeric input's default scaling is robust: center the median, scale the
interquartile range, clipped (``{kind: numeric, scaling: standard}``: the mean and std, not clipped, the
rule before PREPARE_VERSION 6). The missing indicators are 0/1 columns: center 0, scale 1, never clipped. A
manifest or model.pt before PREPARE_VERSION 6 has ``feature_mean``/``feature_std`` only: those, unclipped. Regression
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
# training/loading/batches.py: load_split returns): node caches built under another version
# (training/loading/node_cache.py) then get another file name and are rebuilt.
# 2: robust scaling (center/scale/clip per column).
NORMALISATION_VERSION = 2

SMOOTH_CLIP = 3.0  # the smooth clip's bound: z / sqrt(1 + (z / SMOOTH_CLIP)^2) lies within (-3, 3)


def scale_columns_(x: torch.Tensor, center: torch.Tensor, scale: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, F] float32, in place: ``(x - center) / scale``, then the smooth clip on the columns where
    ``clip`` (bool [F]) is true. The one arithmetic of features (``Normaliser.features_``) and of the numeric
    embeddings' bin edges (training/kinds/tabular.py), so an input equal to an edge lands on it exactly."""
    x.sub_(center).div_(scale)
    if bool(clip.any()):
        # Every column computed in one temporary, each step in place on it, and the clipped columns kept: the same
        # bits as clipping the selected columns alone, without gathering and scattering them. 4.5 ms per 65,536 rows
        # x 36 columns (one thread); a fresh temporary per step cost 5x that under glibc's default malloc (each a
        # fresh mapping, every page a fault).
        clipped = x / SMOOTH_CLIP
        clipped.square_().add_(1.0).sqrt_()  # sqrt(1 + (z / 3)^2)
        torch.div(x, clipped, out=clipped)
        torch.where(clip, clipped, x, out=x)
    return x


@dataclass(frozen=True)
class Normaliser:
    feature_mean: torch.Tensor  # [n_features] float32: each column's center (the mean under standard scaling)
    feature_std: torch.Tensor  # [n_features] float32, no zeros: each column's scale (the std under standard)
    target_mean: float = 0.0
    target_std: float = 1.0
    feature_clip: torch.Tensor | None = None  # [n_features] bool: the smoothly clipped columns (None: none)

    @classmethod
    def from_stats(
        cls,
        feature_mean: Sequence[float],
        feature_std: Sequence[float],
        label_mean: float | None = None,
        label_std: float | None = None,
        feature_clip: Sequence[bool] | None = None,
    ) -> Normaliser:
        """``feature_mean``/``feature_std``: each column's center and scale; ``feature_clip``: which columns are
        smoothly clipped (None: none). ``label_mean``/``label_std`` None (classification, or files before
        PREPARE_VERSION 2): identity."""
        if label_std is not None and not label_std > 0:
            raise ValueError(f"label_std must be positive, got {label_std!r}")
        clip = torch.tensor(list(feature_clip), dtype=torch.bool) if feature_clip is not None else None
        return cls(
            torch.tensor(feature_mean, dtype=torch.float32),
            torch.tensor(feature_std, dtype=torch.float32),
            0.0 if label_mean is None else float(label_mean),
            1.0 if label_std is None else float(label_std),
            clip if clip is not None and bool(clip.any()) else None,
        )

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Normaliser:
        return cls.from_scaling(vars(manifest), manifest.label_mean, manifest.label_std)

    @classmethod
    def from_checkpoint(cls, meta: Mapping[str, Any]) -> Normaliser:
        """From a model.pt's entries (``training/inference/model_file.py: inference_checkpoint``)."""
        return cls.from_scaling(meta, meta.get("label_mean"), meta.get("label_std"))

    @classmethod
    def from_scaling(cls, entries: Mapping[str, Any], label_mean, label_std) -> Normaliser:
        """``feature_center``/``feature_scale``/``feature_clip`` where a manifest or model.pt has them, else
        (written before PREPARE_VERSION 6) ``feature_mean``/``feature_std``, unclipped."""
        if entries.get("feature_center") is not None:
            center, scale, clip = entries["feature_center"], entries["feature_scale"], entries["feature_clip"]
        else:
            center, scale, clip = entries["feature_mean"], entries["feature_std"], None
        return cls.from_stats(center, scale, label_mean, label_std, clip)

    @property
    def standardises_target(self) -> bool:
        return (self.target_mean, self.target_std) != (0.0, 1.0)

    def features_(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the float32 rows ``x`` [rows, n_features] in place; returns ``x``."""
        if self.feature_clip is None:
            return x.sub_(self.feature_mean).div_(self.feature_std)
        return scale_columns_(x, self.feature_mean, self.feature_std, self.feature_clip)

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
