"""Predictions for a DataFrame of RAW feature columns, from a ``model.pt``.

The checkpoint carries what inference needs: feature names, the train split's
feature and target statistics (normalisation happens here, not in the caller,
through ``training/normalisation.py``, the function training and evaluation
use) and the class-index -> original-label mapping. Regression predictions
are on the target's original scale. The MLflow pyfunc model
(``training/serving.py``) wraps this class, so a served model and an
evaluation agree by construction.

    predictor = Predictor.from_checkpoint("runs/x/model.pt")
    labels = predictor.predict(frame)   # original labels, or floats for regression
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from training.evaluate import load_model_checkpoint
from training.normalisation import Normaliser
from training.spec.objectives import objective_from_checkpoint


class Predictor:
    def __init__(self, model: nn.Module, meta: dict[str, Any], batch_size: int = 65_536):
        self.model = model.eval()
        self.meta = meta
        self.features: list[str] = list(meta["features"])
        self.task: str = meta["task"]
        self.batch_size = batch_size
        self._normaliser = Normaliser.from_checkpoint(meta)
        self._objective = objective_from_checkpoint(meta)  # reads the outputs (a binary model has one logit)
        self._labels = np.asarray(meta["label_mapping"]) if self.task == "classification" else None

    @classmethod
    def from_checkpoint(cls, path: str | Path, batch_size: int = 65_536) -> Predictor:
        model, meta = load_model_checkpoint(path)
        return cls(model, meta, batch_size)

    def features_matrix(self, frame: pd.DataFrame) -> np.ndarray:
        """The model's feature columns, in its order, as float32; names what is missing."""
        missing = [name for name in self.features if name not in frame.columns]
        if missing:
            raise ValueError(f"input is missing feature columns {missing}; the model needs {self.features}")
        matrix = frame[self.features].to_numpy(dtype=np.float32, copy=True)
        if not np.isfinite(matrix).all():
            bad = [name for name, ok in zip(self.features, np.isfinite(matrix).all(axis=0)) if not ok]
            raise ValueError(f"input columns {bad} hold NaN or infinite values")
        return matrix

    def predict_raw(self, frame: pd.DataFrame) -> np.ndarray:
        """Class indices (classification) or float predictions on the original scale (regression)."""
        matrix = torch.from_numpy(self.features_matrix(frame))  # our own copy: normalised in place
        outputs = []
        with torch.inference_mode():
            for start in range(0, len(matrix), self.batch_size):
                output = self.model(self._normaliser.features_(matrix[start : start + self.batch_size]))
                if self.task == "classification":
                    outputs.append(self._objective.decode(output)[0])
                else:
                    outputs.append(self._normaliser.target_inverse(output.reshape(-1)))
        if not outputs:
            return np.empty(0, dtype=np.int64 if self.task == "classification" else np.float32)
        return torch.cat(outputs).numpy()

    def predict(self, frame: pd.DataFrame) -> np.ndarray:
        """Original labels (classification) or float predictions (regression)."""
        raw = self.predict_raw(frame)
        return self._labels[raw] if self._labels is not None else raw
