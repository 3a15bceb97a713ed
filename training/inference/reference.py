"""The reference model for tables: scikit-learn's HistGradientBoosting, fitted on the train split and scored
on the test rows through the candidate's tallies (training/inference/baselines.py), so a user sees what a one-line
boosting model gets on their own split.

    scored = reference_baseline(objective, normaliser, manifest, dataset_dir, "test", max_rows=200_000)
    scored.metrics["test_accuracy"], scored.fit["seconds"]

The fit needs the prepared data only, not the candidate: ``fit_before_scoring`` fits it while the candidate trains
(the pipeline's reference task, beside the train task), and ``reference_baseline(..., fitted=...)`` then scores it.

- Inputs: numeric, categorical, hashed and datetime ones only (``reference_skip_reason`` says why a dataset has
  none: images, text, vectors, a multilabel label). Numeric as they are stored, a null as NaN (boosting takes it
  natively); a datetime as its hour, weekday, day of year, month and days since the train split's earliest time;
  categorical and hashed through the dataset's own encoders (fitted on the train split) and then
  as native categories: the ``MAX_CATEGORIES - 1`` most frequent codes of the fitted rows each one category,
  the rest one "other" category, a null missing (HistGradientBoosting takes at most 255 categories).
- Caps: at most ``max_rows`` train rows (a uniform sample above it, fixed seed), ``MAX_ITER`` boosting
  iterations with early stopping on a tenth of the fitted rows above 10,000 rows (scikit-learn's ``auto``),
  and no more than ``MAX_CLASSES`` classes (one tree per class per iteration). Measured on 2 cores: see
  docs/training.md "Baselines".
- Scored on every test row of the manifest, in shard order, as the candidate is.

scikit-learn is imported when a reference is fitted: never by a rank, never at import time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.core.location import open_parquet
from training.core.manifest import Manifest
from training.inference.evaluate import OutputScorer, _labels, class_outputs, value_outputs
from training.kinds.base import CATEGORY, NUMBERS
from training.kinds.inputs import InputInfo, inputs_from_manifest
from training.kinds.normalisation import Normaliser
from training.kinds.registry import Codec, codecs_for, kind_record, known_kinds, read_encoders
from training.objectives.registry import Objective

DEFAULT_MAX_ROWS = 200_000  # eval.reference_max_rows' default
MAX_ITER = 100  # scikit-learn's default; early stopping ends most fits well before it
MAX_CATEGORIES = 255  # HistGradientBoosting's most categories per feature (max_bins)
MAX_CLASSES = 100
SEED = 0
BATCH_ROWS = 65_536


@dataclass
class FittedReference:
    """A reference fitted before the candidate it is scored with: the model, its columns and what the fit took, or
    why the fit failed (``error``: the evaluation then names it, as a failed fit at scoring time does)."""

    model: Any = None
    columns: Any = None
    fit: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class ReferenceScore:
    metrics: dict[str, float]  # plain names, as the candidate's: test_accuracy, test_roc_auc, ...
    fit: dict[str, Any]  # rows, train_rows, iterations, seconds


def reference_skip_reason(manifest: Manifest) -> str | None:
    """Why the reference does not apply to this dataset, or None."""
    if manifest.task not in ("classification", "regression"):
        return f"the label is {manifest.task}; the reference fits one class label or one value"
    others = {name: info.kind for name, info in inputs_from_manifest(manifest).items()}
    others = {name: kind for name, kind in others.items() if kind_record(kind).reference_column is None}
    if others:
        takes = [kind for kind in known_kinds() if kind_record(kind).reference_column is not None]
        return f"inputs {others} are not table columns (the reference takes {', '.join(takes)} inputs)"
    if manifest.task == "classification" and manifest.n_outputs > MAX_CLASSES:
        return f"{manifest.n_outputs} classes (the reference fits up to {MAX_CLASSES})"
    if manifest.rows("train") == 0:
        return "the train split is empty"
    return None


class _Columns:
    """Shard columns -> the reference's float64 matrix: numeric as stored (null: NaN), categorical and hashed
    as ranked categories, a NUMBERS input (datetime) as its several numbers (module docstring)."""

    def __init__(self, manifest: Manifest, dataset_dir: str | Path):
        self.inputs: dict[str, InputInfo] = inputs_from_manifest(manifest)
        self.codecs: dict[str, Codec] = codecs_for(self.inputs, read_encoders(dataset_dir, manifest))
        widths = [codec.reference_width() if codec.reference_column == NUMBERS else 1 for codec in self.codecs.values()]
        self.first = dict(zip(self.inputs, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))  # its first column
        taken_as = [kind_record(info.kind).reference_column for info in self.inputs.values()]
        self.categorical = np.repeat([column == CATEGORY for column in taken_as], widths)
        self.lookup: dict[str, np.ndarray] = {}

    def codes(self, batch) -> np.ndarray:
        """Each input's encoded values (numeric float, categorical and hashed the codec's index, a NUMBERS input's
        columns), [rows, columns]. A numeric input's values as stored, a null as NaN (``raw``: not the network's
        imputed value, boosting takes missing values natively)."""
        columns = []
        for name in self.inputs:
            codec, column = self.codecs[name], batch.column(name)
            taken_as = codec.reference_column
            if taken_as == NUMBERS:
                columns.append(codec.reference_values(column))
            else:
                columns.append(codec.encode(column) if taken_as == CATEGORY else codec.raw(column))
        return np.column_stack(columns).astype(np.float64)

    def fit(self, codes: np.ndarray) -> None:
        """Rank each categorical column's codes by count in the fitted rows (ties: the smaller code first)."""
        for name, j in self.first.items():
            if not self.categorical[j]:
                continue
            column = codes[:, j].astype(np.int64)
            values, counts = np.unique(column[column > 0], return_counts=True)  # 0: null
            kept = values[np.lexsort((values, -counts))][: MAX_CATEGORIES - 1]
            lookup = np.full(int(self.codecs[name].cardinality()), MAX_CATEGORIES - 1, dtype=np.float64)  # other
            lookup[kept] = np.arange(len(kept), dtype=np.float64)
            lookup[0] = np.nan  # null: missing
            self.lookup[name] = lookup

    def matrix(self, codes: np.ndarray) -> np.ndarray:
        for name, lookup in self.lookup.items():
            j = self.first[name]
            codes[:, j] = lookup[codes[:, j].astype(np.int64)]
        return codes


def _train_rows(manifest: Manifest, dataset_dir: str | Path, columns: _Columns, max_rows: int):
    """(codes, labels) of the train split, or of a uniform sample of ``max_rows`` of its rows (fixed seed)."""
    total = manifest.rows("train")
    chosen = None
    if total > max_rows:
        chosen = np.sort(np.random.default_rng(SEED).choice(total, size=max_rows, replace=False))
    names, blocks, labels, offset = [*columns.inputs, manifest.label], [], [], 0
    for shard in manifest.shard_locations(dataset_dir, "train"):
        for batch in open_parquet(shard).iter_batches(batch_size=BATCH_ROWS, columns=names):
            if chosen is not None:
                picked = chosen[(chosen >= offset) & (chosen < offset + batch.num_rows)] - offset
                offset += batch.num_rows
                if not len(picked):
                    continue
                batch = batch.take(picked)
            blocks.append(columns.codes(batch))
            labels.append(batch.column(manifest.label).to_numpy(zero_copy_only=False))
    return np.concatenate(blocks), np.concatenate(labels)


def fit_threads() -> int:
    """Half this process's cores, at least one: OpenMP threads that spin on cores other processes use (the
    Prefect worker, other flows) cost more than they bring (1,500 rows: 0.4 s on one thread, 4.0 s on two of
    two busy cores; 100,000 rows x 10 columns: 2.2 s on one)."""
    return max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else 1


def fit_reference(manifest: Manifest, dataset_dir: str | Path, max_rows: int):
    """The fitted HistGradientBoosting model, the column encoding and what the fit took."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from threadpoolctl import threadpool_limits

    started = time.perf_counter()
    columns = _Columns(manifest, dataset_dir)
    codes, y = _train_rows(manifest, dataset_dir, columns, max_rows)
    columns.fit(codes)
    estimator = HistGradientBoostingClassifier if manifest.task == "classification" else HistGradientBoostingRegressor
    model = estimator(
        max_iter=MAX_ITER,
        early_stopping="auto",
        categorical_features=columns.categorical if columns.categorical.any() else None,
        random_state=SEED,
    )
    with threadpool_limits(limits=fit_threads()):
        model.fit(columns.matrix(codes), y)
    fit = {
        "rows": len(y),
        "train_rows": manifest.rows("train"),
        "iterations": int(model.n_iter_),
        "seconds": time.perf_counter() - started,
    }
    return model, columns, fit


def _log_probabilities(model, matrix: np.ndarray, n_classes: int, fitted_rows: int) -> torch.Tensor:
    """Class log-probabilities ``[B, n_classes]`` from the raw scores (stable, never log 0); a class the fitted
    rows lacked gets about half a fitted row's probability, as the trivial prior does."""
    raw = torch.from_numpy(np.asarray(model.decision_function(matrix), dtype=np.float64))
    present = torch.from_numpy(np.asarray(model.classes_, dtype=np.int64))
    if raw.ndim == 1:  # two classes: one logit for classes_[1]
        raw = torch.stack([torch.zeros_like(raw), raw], dim=1)
    known = torch.log_softmax(raw, dim=1)
    if len(present) == n_classes:
        return known.float()
    missing = n_classes - len(present)
    absent = min(0.5 / max(fitted_rows, 1), 0.5 / missing)  # together at most half the probability
    full = torch.full((len(raw), n_classes), np.log(absent), dtype=torch.float64)
    full[:, present] = known + np.log1p(-absent * missing)
    return full.float()


def fit_before_scoring(manifest: Manifest, dataset_dir: str | Path, max_rows: int) -> FittedReference | None:
    """The reference fitted now, to be scored once the candidate exists; None where it does not apply
    (``reference_skip_reason``); a failed fit is returned with its error, never raised."""
    if reference_skip_reason(manifest) is not None:
        return None
    try:
        return FittedReference(*fit_reference(manifest, dataset_dir, max_rows))
    except Exception as error:  # a baseline never fails the candidate's evaluation: it says why it is missing
        return FittedReference(error=f"{type(error).__name__}: {error}")


def reference_baseline(
    objective: Objective,
    normaliser: Normaliser,
    manifest: Manifest,
    dataset_dir: str | Path,
    split: str,
    max_rows: int,
    fitted: FittedReference | None = None,
) -> ReferenceScore:
    """Fit on the train split (or its sample), unless ``fitted`` holds that fit already, and score every row of
    ``split`` through the candidate's tallies."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=fit_threads()):  # predicting runs OpenMP threads too
        if fitted is None:
            fitted = FittedReference(*fit_reference(manifest, dataset_dir, max_rows))
        return _score(objective, normaliser, manifest, dataset_dir, split, fitted)


def _score(
    objective: Objective,
    normaliser: Normaliser,
    manifest: Manifest,
    dataset_dir: str | Path,
    split: str,
    fitted: FittedReference,
) -> ReferenceScore:
    model, columns, fit = fitted.model, fitted.columns, fitted.fit
    scorer = OutputScorer(objective, manifest, normaliser)
    names = [*columns.inputs, manifest.label]
    for shard in manifest.shard_locations(dataset_dir, split):
        for batch in open_parquet(shard).iter_batches(batch_size=BATCH_ROWS, columns=names):
            matrix = columns.matrix(columns.codes(batch))
            if manifest.task == "classification":
                outputs = class_outputs(objective, _log_probabilities(model, matrix, manifest.n_outputs, fit["rows"]))
            else:
                outputs = value_outputs(torch.from_numpy(np.asarray(model.predict(matrix))), normaliser)
            scorer.add(outputs, _labels(batch.column(manifest.label), manifest))
    return ReferenceScore(scorer.metrics(split), fit)
