"""Predictions for a DataFrame of RAW input columns, from a ``model.pt``.

The checkpoint carries what inference needs: its inputs and their fitted
encoders (training/kinds/registry.py: the same ``encode`` the node cache and
evaluation use: strings for categoricals, lists for vectors, an unseen
category scored as unknown), the train split's feature and target statistics
(normalisation happens here, not in the caller, through
``training/kinds/normalisation.py``, the function training and evaluation use)
and the class-index -> original-label mapping. Regression predictions are on
the target's original scale. The MLflow pyfunc model (``training/inference/serving.py``) wraps
this class, so a served model and an
evaluation agree by construction.

    predictor = Predictor.from_checkpoint("runs/x/model.pt")
    labels = predictor.predict(frame)   # original labels, or floats for regression
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from training.core.manifest import CLASS_TASKS
from training.inference.model_file import checkpoint_codecs, checkpoint_inputs, load_model_checkpoint
from training.kinds.inputs import InputInfo
from training.kinds.normalisation import Normaliser
from training.kinds.registry import NonFiniteInputs, encode_columns
from training.objectives.base import output_members
from training.objectives.registry import objective_from_checkpoint

if TYPE_CHECKING:  # pandas is imported where a frame is made: a scoring rank reads Arrow only (0.23 s less start)
    import pandas as pd

    Rows = pd.DataFrame | pa.RecordBatch | pa.Table  # raw input rows: a served frame, or a scoring rank's batch
OUTPUTS = ("label", "probabilities")  # params={"output": ...}: the labels, or labels and class probabilities
# Rows per forward call on a CPU: a call on a whole 65k-row batch runs ~3x slower per row than 1024-row calls (its
# activations leave the core's cache; docs/benchmarks.md, "Batch scoring"). A GPU takes ``batch_size`` at once.
CPU_FORWARD_ROWS = 1024


class Predictor:
    def __init__(self, model: nn.Module, meta: dict[str, Any], batch_size: int = 65_536):
        self.model = model.eval()
        self.meta = meta
        self.inputs: dict[str, InputInfo] = checkpoint_inputs(meta)
        self.features: list[str] = list(self.inputs)  # every input column the model needs, in order
        self.task: str = meta["task"]
        self.batch_size = batch_size
        self._codecs = checkpoint_codecs(meta)
        self._normaliser = Normaliser.from_checkpoint(meta)
        self._classes = self.task in CLASS_TASKS  # outputs are per class (softmax, binary, multilabel)
        self._labels = np.asarray(meta["label_mapping"]) if self._classes else None
        self._objective = objective_from_checkpoint(meta)  # reads the outputs (a binary model has one logit)
        self._members = output_members(model)  # an ensemble's k: its one prediction is the mean of its members'
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> Predictor:
        """Run the model on ``device`` (a scoring rank's GPU): each batch is moved there, its outputs back."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @classmethod
    def from_checkpoint(cls, path: str | Path, batch_size: int = 65_536) -> Predictor:
        model, meta = load_model_checkpoint(path)
        return cls(model, meta, batch_size)

    def batch_inputs(self, frame: Rows) -> dict[str, torch.Tensor]:
        """The raw input columns (a DataFrame's, or an Arrow batch's as they are: no pandas round trip) -> the
        model's batch dict, through the codecs evaluation uses; names what is missing or invalid. An unseen
        category is the unknown index (never an error)."""
        present = frame.column_names if _is_arrow(frame) else frame.columns
        missing = [name for name in self.features if name not in present]
        if missing:
            raise ValueError(f"input is missing feature columns {missing}; the model needs {self.features}")
        columns = {name: _column(frame, name) for name in self.features}
        # A null or NaN is imputed (the train median, or mean under scaling: standard; and the missing indicator where
        # the model has one); one the codec cannot impute (missing: error, or a model without imputation) is refused,
        # and inf always is: ``NonFiniteInputs`` names the columns.
        try:
            return encode_columns(columns, self.inputs, self._codecs, self._normaliser)
        except NonFiniteInputs:
            raise
        except ValueError as error:
            raise ValueError(f"input rows cannot be encoded: {error}") from None

    @property
    def forward_rows(self) -> int:
        """Rows per forward call: ``batch_size``, at most ``CPU_FORWARD_ROWS`` on a CPU. Rows are scored
        independently (the model is in eval mode), so the chunks change no answer, only the speed."""
        return min(self.batch_size, CPU_FORWARD_ROWS) if self.device.type == "cpu" else self.batch_size

    def outputs(self, frame: Rows) -> torch.Tensor:
        """The model's outputs for every row (regression: on the original scale)."""
        batch = self.batch_inputs(frame)
        outputs, step = [], self.forward_rows
        with torch.inference_mode():
            for start in range(0, len(frame), step):
                rows = {name: tensor[start : start + step].to(self.device) for name, tensor in batch.items()}
                output = self._objective.prediction(self.model(rows), self._members).cpu()
                outputs.append(output if self._classes else self._normaliser.target_inverse(output))
        if not outputs:
            return torch.empty(0, len(self._labels) if self._labels is not None else 1)
        return torch.cat(outputs)

    def predict_raw(self, frame: Rows) -> np.ndarray:
        """Class indices (classification), multi-hot bool rows [N, C] (multilabel) or float predictions on the
        original scale (regression)."""
        if len(frame) == 0:
            if self.task == "multilabel":
                return np.zeros((0, len(self._labels)), dtype=bool)
            return np.empty(0, dtype=np.int64 if self.task == "classification" else np.float32)
        outputs = self.outputs(frame)
        if self._classes:
            return self._objective.decode(outputs)[0].numpy()
        return outputs.reshape(-1).float().numpy()

    def predict(self, frame: Rows) -> np.ndarray:
        """Original labels (classification), each row's list of original labels (multilabel; an object array)
        or float predictions (regression)."""
        raw = self.predict_raw(frame)
        if self.task == "multilabel":
            return label_sets(raw, self._labels)
        return self._labels[raw] if self._labels is not None else raw

    def scores(self, frame: Rows, output: str = "label") -> pd.DataFrame | np.ndarray:
        """What the served model returns for ``params={"output": output}`` (``OUTPUTS``), from ONE forward pass:
        the labels (or values) as an array; ``probabilities``: a frame of ``label`` and one ``probability_<class>``
        column per class (regression: the values). The pyfunc answers through this, batch scoring through
        ``score_columns``: the same arrays."""
        import pandas as pd

        columns = self.score_columns(frame, output)
        if len(columns) == 1:
            return columns["label"]
        return pd.DataFrame(columns, index=_index(frame))

    def score_columns(self, frame: Rows, output: str = "label") -> dict[str, np.ndarray]:
        """``scores`` as arrays, no pandas: ``{"label": ...}``, and for ``probabilities`` of a classifier one
        ``probability_<class>`` array per class."""
        if output not in OUTPUTS:
            raise ValueError(f"params.output must be one of {OUTPUTS}, not {output!r}")
        if output == "label" or self._labels is None:
            return {"label": self.predict(frame)}
        decoded, probabilities = self._objective.decode(self.outputs(frame))
        raw = decoded.numpy()
        columns = {"label": label_sets(raw, self._labels) if self.task == "multilabel" else self._labels[raw]}
        for i, label in enumerate(self._labels):
            columns[f"probability_{label}"] = probabilities[:, i].numpy()
        return columns

    def predict_proba(self, frame: Rows) -> pd.DataFrame:
        """Classification: a column per class (its original label), each row's probabilities (multilabel: each
        label's own sigmoid probability; the row's do not sum to 1)."""
        import pandas as pd

        if self._labels is None:
            raise ValueError("predict_proba: a regression model has no class probabilities")
        probabilities = self._objective.decode(self.outputs(frame))[1].numpy()
        return pd.DataFrame(probabilities, columns=[str(label) for label in self._labels], index=_index(frame))


def label_sets(multi_hot: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Multi-hot rows [N, C] -> an object array of N lists of the original labels, in label order."""
    sets = np.empty(len(multi_hot), dtype=object)
    sets[:] = [labels[row].tolist() for row in np.asarray(multi_hot, dtype=bool)]
    return sets


def _is_arrow(frame: Rows) -> bool:
    return isinstance(frame, (pa.RecordBatch, pa.Table))


def _index(frame: Rows) -> pd.Index | None:
    """A DataFrame's index for the answer's rows (an Arrow batch's rows: 0..n-1)."""
    return None if _is_arrow(frame) else frame.index


def _column(frame: Rows, name: str) -> pa.Array:
    """One input column as Arrow: a DataFrame's converted, an Arrow batch's as it is (a table's in one chunk)."""
    if not _is_arrow(frame):
        return _arrow(frame[name], name)
    column = frame.column(name)
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _arrow(series: pd.Series, name: str) -> pa.Array:
    """A DataFrame column as Arrow (lists stay lists, strings strings)."""
    try:
        return pa.array(series.tolist() if series.dtype == object else series.to_numpy(), from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise ValueError(f"input column {name!r} cannot be read: {error}") from None
