"""Evaluate a saved ``model.pt`` on one split of a prepared dataset.

Plain code (no Prefect, no MLflow) so it runs anywhere: the evaluate task, the
registry gate (re-scoring the champion on the candidate's test shards) and
tests. The split is streamed shard by shard, record batch by record batch, so
memory stays bounded by ``batch_size`` rows whatever the split's size; every
row is counted exactly once and the count is checked against the manifest.

    result = evaluate_split("runs/x/model.pt", "data/shards/<fp>", split="test")
    result.metrics["test_accuracy"]

Which evaluator scores a model is its objective's (``Evaluation.scorer``, training/objectives/base.py): a
label per row (classification, multilabel, regression: the code below), or a language model's target tokens
(training/inference/token_scoring.py, whose metrics are test_loss, test_perplexity, test_token_accuracy,
test_tokens).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.core.location import open_parquet
from training.core.manifest import CLASS_TASKS, Manifest, read_manifest
from training.inference.model_file import (
    EVAL_BATCH_BYTES,
    EvalResult,
    IncompatibleModelError,
    checkpoint_codecs,
    checkpoint_inputs,
    load_model_checkpoint,
)
from training.inference.token_scoring import check_text_input, evaluate_tokens
from training.inference.wrong_rows import ConfidentlyWrong
from training.kinds.base import PICTURES, TABLE, Codec
from training.kinds.inputs import InputInfo, inputs_from_manifest
from training.kinds.normalisation import Normaliser
from training.kinds.registry import encode_columns, kind_record
from training.loading.batches import fill_labels
from training.objectives.base import TOKEN_SCORER, Objective, output_members
from training.objectives.metrics import precision_recall
from training.objectives.registry import objective_from_checkpoint


def metric_label(value: Any) -> str:
    """A class label as it may appear in an MLflow metric name."""
    return re.sub(r"[^0-9A-Za-z_\-.]", "_", str(value))


def check_compatible(
    meta: dict[str, Any], manifest: Manifest, checkpoint: str | Path = "model.pt"
) -> torch.Tensor | None:
    """Raise ``IncompatibleModelError`` unless the checkpoint can score this dataset.

    For classification returns the index remap (model class index -> dataset
    class index) when both list the same classes in another order, else None.
    """
    if meta["task"] != manifest.task:
        raise IncompatibleModelError(
            f"{checkpoint} is a {meta['task']} model; the dataset {manifest.fingerprint} is {manifest.task}"
        )
    needed, present = checkpoint_inputs(meta), inputs_from_manifest(manifest)
    missing = [name for name in needed if name not in present]
    if missing:
        raise IncompatibleModelError(
            f"{checkpoint} needs feature columns {missing} that dataset {manifest.fingerprint} lacks"
        )
    other_kind = [
        f"{name} ({info.kind}, here {present[name].kind})"
        for name, info in needed.items()
        if present[name].kind != info.kind
    ]
    if other_kind:
        raise IncompatibleModelError(
            f"{checkpoint} takes inputs of other kinds than dataset {manifest.fingerprint}: {other_kind}"
        )
    if meta["label"] != manifest.label:
        raise IncompatibleModelError(
            f"{checkpoint} predicts {meta['label']!r}; dataset {manifest.fingerprint} labels {manifest.label!r}"
        )
    if manifest.task not in CLASS_TASKS or list(meta["label_mapping"]) == list(manifest.label_mapping):
        return None
    if manifest.task == "multilabel":  # a multi-hot row has no class order to remap
        raise IncompatibleModelError(
            f"{checkpoint} knows labels {meta['label_mapping']}; "
            f"dataset {manifest.fingerprint} has {manifest.label_mapping}"
        )
    if sorted(map(str, meta["label_mapping"])) != sorted(map(str, manifest.label_mapping)):
        raise IncompatibleModelError(
            f"{checkpoint} knows classes {meta['label_mapping']}; "
            f"dataset {manifest.fingerprint} has {manifest.label_mapping}"
        )
    position = {str(label): index for index, label in enumerate(manifest.label_mapping)}
    return torch.tensor([position[str(label)] for label in meta["label_mapping"]])


def _iter_batches(manifest: Manifest, dataset_dir: str | Path, split: str, meta: dict[str, Any], batch_size: int):
    """(the model's batch dict, labels) per record batch, over every shard in order: the raw shard columns
    through the model's own codecs and normalisation (``encode_columns``, what serving calls too)."""
    inputs, codecs = checkpoint_inputs(meta), checkpoint_codecs(meta)
    normaliser = Normaliser.from_checkpoint(meta)  # the model's own statistics, also when re-scoring a champion
    columns = [*inputs, manifest.label]
    batch_size = min(batch_size, max(1, EVAL_BATCH_BYTES // _row_bytes(inputs)))  # images decode to large rows
    for shard in manifest.shard_locations(dataset_dir, split):
        parquet = open_parquet(shard)
        for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
            encoded = encode_columns({name: batch.column(name) for name in inputs}, inputs, codecs, normaliser)
            yield encoded, _labels(batch.column(manifest.label), manifest), batch


MISCLASSIFIED_SHOWN = 16


def _row_bytes(inputs: dict[str, InputInfo]) -> int:
    """Bytes of one row of the model's batch dict (4 per float32 or int32 element, 8 per int64)."""
    return sum((8 if info.dtype == "int64" else 4) * max(1, int(np.prod(info.shape))) for info in inputs.values())


def _keep_misclassified(
    kept: list[dict[str, Any]], batch, shown: tuple[str, type[Codec]], wrong, target, predicted, labels
):
    """Up to MISCLASSIFIED_SHOWN wrong rows of an input shown as pictures (``shown``: its name and record), with
    their encoded bytes ("bytes") and labels."""
    image, record = shown
    rows = torch.nonzero(wrong).flatten()[: MISCLASSIFIED_SHOWN - len(kept)].tolist()
    column = record.shown_values(batch.column(image).take(rows), image)
    for row, value in zip(rows, column):
        kept.append(
            {
                "input": image,
                "bytes": value,
                "true": str(labels[int(target[row])]),
                "predicted": str(labels[int(predicted[row])]),
            }
        )


def _labels(column, manifest: Manifest) -> torch.Tensor:
    """The shard's label column as training reads it (``fill_labels``: a multilabel row multi-hot [C])."""
    if manifest.task != "multilabel":  # a copy: Arrow's buffers are read-only and torch warns about sharing them
        return torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
    block = np.empty((len(column), manifest.n_outputs), dtype=np.float32)
    fill_labels(block, column, manifest.task)
    return torch.from_numpy(block)


CONFUSION_MAX_CLASSES = 50  # above: per-class metrics only (a confusion matrix is C² counts, unreadable anyway)


class _ClassificationEvaluation:
    """softmax and binary on one split: the objective's tally (training/objectives/metrics.py, the same formulas as
    validation), per-class precision and recall, a confusion matrix up to ``CONFUSION_MAX_CLASSES`` classes, the
    majority class's share of the rows (``<split>_majority_share``: the accuracy of always guessing it) and, for
    two classes, the exact ROC AUC and PR AUC over every row's score (the evaluation sees every row in one process)."""

    def __init__(self, objective: Objective, n_classes: int):
        self.objective, self.n_classes = objective, n_classes
        self.tally = objective.tally(n_classes)
        self.confusion = (
            torch.zeros(n_classes * n_classes, dtype=torch.int64) if n_classes <= CONFUSION_MAX_CLASSES else None
        )

    def add(self, outputs: torch.Tensor, target: torch.Tensor, remap: torch.Tensor | None) -> torch.Tensor:
        target = target.long()
        if remap is not None:  # reorder the model's classes into the dataset's index order
            outputs = self.objective.remap_outputs(outputs, remap)
        self.tally.add(outputs, target)
        predicted, probabilities = self.objective.decode(outputs)
        if self.confusion is not None:
            self.confusion += torch.bincount(target * self.n_classes + predicted, minlength=self.n_classes**2)
        return predicted

    def metrics(self, split: str, labels: list[Any]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        sums = self.tally.sums()
        metrics = self.tally.metrics(sums, split, scored=self.tally.scored_rows())  # 2 classes: ROC AUC, PR AUC
        metrics[f"{split}_majority_share"] = self.tally.majority_share(sums)  # what always guessing it scores
        return metrics, _per_class(metrics, split, labels, *self.tally.per_class(sums))

    def probabilities(self, outputs: torch.Tensor, remap: torch.Tensor | None) -> torch.Tensor:
        """[B, C] class probabilities in the dataset's index order (binary: both classes)."""
        if remap is not None:
            outputs = self.objective.remap_outputs(outputs, remap)
        return self.objective.decode(outputs)[1]

    def confusion_matrix(self) -> list[list[int]] | None:
        return None if self.confusion is None else self.confusion.view(self.n_classes, self.n_classes).tolist()


def _multilabel_metrics(tally, split: str, labels: list[Any]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The multilabel tally's metrics (micro/macro F1, exact match) and each label's precision, recall, support."""
    sums = tally.sums()
    metrics = tally.metrics(sums, split)
    actual = tally.part(sums, "actual")
    precision, recall = precision_recall(tally.part(sums, "true_positive"), tally.part(sums, "predicted"), actual)
    return metrics, _per_class(metrics, split, labels, precision, recall, actual)


def _per_class(metrics: dict[str, float], split: str, labels: list[Any], precision, recall, support):
    """Each class's (or label's) precision and recall into ``metrics`` (``<split>_precision_<label>``), and the
    per-class table: label -> precision, recall, support."""
    per_class = {}
    for index, label in enumerate(labels):
        metrics[f"{split}_precision_{metric_label(label)}"] = float(precision[index])
        metrics[f"{split}_recall_{metric_label(label)}"] = float(recall[index])
        per_class[str(label)] = {
            "precision": float(precision[index]),
            "recall": float(recall[index]),
            "support": int(support[index]),
        }
    return per_class


class OutputScorer:
    """Outputs and labels, batch by batch, into the metrics ``evaluate_split`` reports for a model: the
    classification evaluation (accuracy, log loss, F1, ROC AUC, per-class precision and recall), the multilabel
    tally, or the regression tally on the standardised target. ``evaluate_split`` scores a model through it and
    the baselines score their constant and reference outputs through it, so every metric has one definition."""

    def __init__(self, objective: Objective, manifest: Manifest, normaliser: Normaliser):
        self.objective, self.manifest, self.normaliser = objective, manifest, normaliser
        self.samples = 0
        if manifest.task == "classification":
            self.evaluation = _ClassificationEvaluation(objective, manifest.n_outputs)
        else:
            self.tally = objective.tally(manifest.n_outputs if manifest.task == "multilabel" else None)

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, remap: torch.Tensor | None = None) -> torch.Tensor:
        """Tally one batch; returns its predictions: class indices (the dataset's index space), multi-hot rows
        ``[B, C]`` (multilabel) or values on the original scale (regression)."""
        self.samples += len(labels)
        if self.manifest.task == "classification":
            return self.evaluation.add(outputs, labels, remap)
        if self.manifest.task == "multilabel":
            self.tally.add(outputs, labels)
            return self.objective.decode(outputs)[0]
        # Scored on the standardised scale the model trained on, as validation is; reported on the original one
        # (the tally's target_std); predictions on the original scale.
        self.tally.add(outputs, self.normaliser.target_(labels.float().clone()))
        return self.normaliser.target_inverse(outputs.reshape(-1).float())

    def scored(self, split: str, where: str | Path = "") -> tuple[dict[str, float], dict[str, dict[str, float]] | None]:
        """The split's metrics (``<split>_<metric>``, ``<split>_samples``) and, for classes and labels, each one's
        precision, recall and support; the row count is checked against the manifest."""
        if self.samples != self.manifest.rows(split):
            listed = self.manifest.rows(split)
            raise RuntimeError(
                f"{where or 'evaluation'}: read {self.samples} {split} rows but the manifest lists {listed}"
            )
        labels, per_class = self.manifest.label_mapping, None
        if self.manifest.task == "classification":
            metrics, per_class = self.evaluation.metrics(split, labels)
        elif self.manifest.task == "multilabel":
            metrics, per_class = _multilabel_metrics(self.tally, split, labels)
        else:
            metrics = self.tally.metrics(self.tally.sums(), split, self.normaliser.target_std)
        metrics[f"{split}_samples"] = float(self.samples)
        return metrics, per_class

    def metrics(self, split: str) -> dict[str, float]:
        return self.scored(split)[0]


def class_outputs(objective: Objective, log_probabilities: torch.Tensor) -> torch.Tensor:
    """Class log-probabilities ``[B, C]`` (the dataset's class order) as the objective's outputs: softmax takes
    them as logits, binary its one logit (log p1 - log p0)."""
    if objective.name == "binary":
        return (log_probabilities[:, 1] - log_probabilities[:, 0]).unsqueeze(1)
    return log_probabilities


def value_outputs(values: torch.Tensor, normaliser: Normaliser) -> torch.Tensor:
    """Predicted values on the original scale as a regression model's outputs (the standardised scale)."""
    return ((values.double() - normaliser.target_mean) / normaliser.target_std).float().reshape(-1, 1)


def evaluate_split(
    model_path: str | Path,
    dataset_dir: str | Path,
    split: str = "test",
    batch_size: int = 65_536,
    return_predictions: bool = False,
    max_predictions: int | None = None,
) -> EvalResult:
    """Score ``model.pt`` on every row of ``split``; metrics named ``<split>_<metric>``.

    ``return_predictions`` keeps per-row predictions and targets (in shard
    order), the first ``max_predictions`` rows only when given, so a plot of
    a huge split stays bounded in memory.
    """
    started = time.perf_counter()
    manifest = read_manifest(dataset_dir)
    if split not in manifest.splits:
        raise ValueError(f"{dataset_dir}: no split {split!r} (has {sorted(manifest.splits)})")
    if manifest.rows(split) == 0:
        raise ValueError(f"{dataset_dir}: split {split!r} is empty; nothing to evaluate")
    model, meta = load_model_checkpoint(model_path)
    objective = objective_from_checkpoint(meta)  # how its outputs are read: model.pt's objective
    evaluation = objective.evaluation(meta["task"])
    if evaluation.scorer == TOKEN_SCORER:  # per target token, no label per row: its own module
        check_text_input(meta, manifest, model_path)
        result = evaluate_tokens(
            model, meta, objective, manifest, dataset_dir, split, batch_size,
            return_predictions=return_predictions, max_predictions=max_predictions, started=started,
        )  # fmt: skip
        result.figure = evaluation.figure
        return result
    remap = check_compatible(meta, manifest, model_path)
    normaliser = Normaliser.from_checkpoint(meta)  # the model's own statistics, also when re-scoring a champion
    classification = manifest.task == "classification"
    scorer = OutputScorer(objective, manifest, normaliser)
    members = output_members(model)  # an ensemble's k: scored by its one prediction, the mean of its members'
    kept_predictions, kept_targets = [], []
    records = {name: kind_record(info.kind) for name, info in checkpoint_inputs(meta).items()}
    image = next(((name, record) for name, record in records.items() if record.shown_as == PICTURES), None)
    misclassified: list[dict[str, Any]] = []
    texts = [name for name, record in records.items() if record.shown_as == TABLE]
    wrong = ConfidentlyWrong(texts, manifest.label_mapping) if classification and texts else None
    with torch.inference_mode():
        for x, y, raw in _iter_batches(manifest, dataset_dir, split, meta, batch_size):
            output = objective.prediction(model(x), members)  # x: the batch dict, through the model's own codecs
            predicted = scorer.add(output, y, remap)
            if classification and image is not None and len(misclassified) < MISCLASSIFIED_SHOWN:
                is_wrong = predicted != y.long()
                _keep_misclassified(misclassified, raw, image, is_wrong, y, predicted, manifest.label_mapping)
            if wrong is not None:
                wrong.add(scorer.samples - len(y), raw, y, predicted, scorer.evaluation.probabilities(output, remap))
            if return_predictions:
                room = len(y) if max_predictions is None else max(0, max_predictions - sum(map(len, kept_targets)))
                if room:
                    kept_predictions.append(predicted[:room].numpy())
                    kept_targets.append(y[:room].numpy())
    result = EvalResult(task=evaluation.scored_as, split=split, samples=scorer.samples, metrics={}, seconds=0.0)
    result.figure = evaluation.figure
    result.metrics, result.per_class = scorer.scored(split, dataset_dir)
    if result.per_class is not None:
        result.class_labels = [str(label) for label in manifest.label_mapping]
    if classification:
        result.confusion_matrix = scorer.evaluation.confusion_matrix()
        result.misclassified = misclassified if image is not None else None
        result.confidently_wrong = wrong.table() if wrong is not None else None
    if return_predictions:
        result.predictions = np.concatenate(kept_predictions) if kept_predictions else np.empty(0)
        result.targets = np.concatenate(kept_targets) if kept_targets else np.empty(0)
    result.seconds = time.perf_counter() - started
    return result
