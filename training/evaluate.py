"""Evaluate a saved ``model.pt`` on one split of a prepared dataset.

Plain code (no Prefect, no MLflow) so it runs anywhere: the evaluate task, the
registry gate (re-scoring the champion on the candidate's test shards) and
tests. The split is streamed shard by shard, record batch by record batch, so
memory stays bounded by ``batch_size`` rows whatever the split's size; every
row is counted exactly once and the count is checked against the manifest.

    result = evaluate_split("runs/x/model.pt", "data/shards/<fp>", split="test")
    result.metrics["test_accuracy"]

A next_token language model is scored per target token by training/token_scoring.py (test_loss,
test_perplexity, test_token_accuracy, test_tokens), apart from the per-row classification and regression
code below.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from training.data.manifest import CLASS_TASKS, Manifest, read_manifest
from training.loading import fill_labels
from training.models import ModelSpec, build_model
from training.normalisation import Normaliser
from training.spec.codecs import Codec, codecs_for, encode_columns
from training.spec.inputs import InputInfo, inputs_from_manifest
from training.spec.metrics import precision_recall
from training.spec.next_token import LANGUAGE_MODEL
from training.spec.objectives import Objective, objective_from_checkpoint
from training.wrong_rows import ConfidentlyWrong

# What a model.pt must hold (docs/architecture.md) to be evaluated or served.
REQUIRED_CHECKPOINT_KEYS = (
    "model",
    "model_spec",
    "features",
    "feature_mean",
    "feature_std",
    "task",
    "label",
    "label_mapping",
)


class IncompatibleModelError(ValueError):
    """A checkpoint cannot score a dataset: other features, task or classes."""


@dataclass
class EvalResult:
    task: str  # the dataset's task, or "next_token" for a language model (training/token_scoring.py)
    split: str
    samples: int
    metrics: dict[str, float]  # flat, MLflow-ready: "<split>_accuracy", "<split>_rmse", ...
    seconds: float
    class_labels: list[str] | None = None  # the dataset's classes, in index order
    # Rows: true class, columns: predicted; None above CONFUSION_MAX_CLASSES classes (per_class has them all).
    confusion_matrix: list[list[int]] | None = None
    per_class: dict[str, dict[str, float]] | None = None  # label -> precision, recall, support
    # Only with return_predictions: class indices (dataset's index space), multi-hot rows [N, C] (multilabel)
    # or regression values.
    predictions: np.ndarray | None = field(default=None, repr=False)
    targets: np.ndarray | None = field(default=None, repr=False)
    # Classification with an image input: the first MISCLASSIFIED_SHOWN wrong rows, {"image" (its encoded bytes),
    # "true", "predicted" (labels), "input"}, for the grid of misclassified images (ddpflow/tracking/plots.py).
    misclassified: list[dict[str, Any]] | None = field(default=None, repr=False)
    # A classifier with text inputs: its most confidently wrong rows (training/wrong_rows.py), a table artifact.
    confidently_wrong: dict[str, list] | None = field(default=None, repr=False)  # {"columns", "data"}

    def to_dict(self) -> dict[str, Any]:
        """What ``eval/metrics.json`` holds (no per-row arrays)."""
        return {
            "task": self.task,
            "split": self.split,
            "samples": self.samples,
            "seconds": self.seconds,
            "metrics": self.metrics,
            "class_labels": self.class_labels,
            "confusion_matrix": self.confusion_matrix,
            "per_class": self.per_class,
        }


def load_model_checkpoint(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model from ``model_spec`` and load its weights, in eval mode.

    Returns the model and the checkpoint's other entries (everything except the
    state dict). ``weights_only=True``: a checkpoint cannot run code on load.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model checkpoint {path} does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    missing = [key for key in REQUIRED_CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"model checkpoint {path} lacks keys {missing}; is it a final model.pt (not checkpoints/last.pt)?"
        )
    spec = ModelSpec.from_dict(checkpoint["model_spec"], checkpoint["features"])
    model = build_model(spec, checkpoint["features"])
    model.load_state_dict(checkpoint["model"])
    model.eval()
    meta = {key: value for key, value in checkpoint.items() if key != "model"}
    meta["model_spec"] = spec.to_dict()  # with its inputs, also for a model.pt from before typed inputs
    return model, meta


def checkpoint_inputs(meta: dict[str, Any]) -> dict[str, InputInfo]:
    """The model's inputs, in order (a model.pt from before typed inputs: its features, numeric)."""
    return ModelSpec.from_dict(meta["model_spec"], meta["features"]).input_infos(meta["features"])


def checkpoint_codecs(meta: dict[str, Any]) -> dict[str, Codec]:
    """The model's own encoders (fitted on ITS train split): they encode any dataset's raw shards alike."""
    return codecs_for(checkpoint_inputs(meta), meta.get("encoders") or {})


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


def _iter_batches(manifest: Manifest, dataset_dir: Path, split: str, meta: dict[str, Any], batch_size: int):
    """(the model's batch dict, labels) per record batch, over every shard in order: the raw shard columns
    through the model's own codecs and normalisation (``encode_columns``, what serving calls too)."""
    inputs, codecs = checkpoint_inputs(meta), checkpoint_codecs(meta)
    normaliser = Normaliser.from_checkpoint(meta)  # the model's own statistics, also when re-scoring a champion
    columns = [*inputs, manifest.label]
    batch_size = min(batch_size, max(1, EVAL_BATCH_BYTES // _row_bytes(inputs)))  # images decode to large rows
    for shard in manifest.split_files(dataset_dir, split):
        parquet = pq.ParquetFile(shard)
        for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
            encoded = encode_columns({name: batch.column(name) for name in inputs}, inputs, codecs, normaliser)
            yield encoded, _labels(batch.column(manifest.label), manifest), batch


EVAL_BATCH_BYTES = 256 << 20  # an evaluation batch's decoded inputs stay within about this much memory
MISCLASSIFIED_SHOWN = 16


def _row_bytes(inputs: dict[str, InputInfo]) -> int:
    """Bytes of one row of the model's batch dict (4 per float32 or int32 element, 8 per int64)."""
    return sum((8 if info.dtype == "int64" else 4) * max(1, int(np.prod(info.shape))) for info in inputs.values())


def _keep_misclassified(kept: list[dict[str, Any]], batch, image: str, wrong: torch.Tensor, target, predicted, labels):
    """Up to MISCLASSIFIED_SHOWN wrong rows of an image input, with their bytes and labels."""
    from training.spec.image import image_bytes

    rows = torch.nonzero(wrong).flatten()[: MISCLASSIFIED_SHOWN - len(kept)].tolist()
    column = image_bytes(batch.column(image), image)
    for row in rows:
        kept.append(
            {
                "input": image,
                "image": column[row].as_py(),
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
    """softmax and binary on one split: the objective's tally (training/spec/metrics.py, the same formulas as
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
        precision, recall, support = self.tally.per_class(sums)
        per_class = {}
        for index, label in enumerate(labels):
            name = metric_label(label)
            metrics[f"{split}_precision_{name}"] = float(precision[index])
            metrics[f"{split}_recall_{name}"] = float(recall[index])
            per_class[str(label)] = {
                "precision": float(precision[index]),
                "recall": float(recall[index]),
                "support": int(support[index]),
            }
        return metrics, per_class

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
    per_class = {}
    for index, label in enumerate(labels):
        metrics[f"{split}_precision_{metric_label(label)}"] = float(precision[index])
        metrics[f"{split}_recall_{metric_label(label)}"] = float(recall[index])
        per_class[str(label)] = {
            "precision": float(precision[index]),
            "recall": float(recall[index]),
            "support": int(actual[index]),
        }
    return metrics, per_class


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
    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    if split not in manifest.splits:
        raise ValueError(f"{dataset_dir}: no split {split!r} (has {sorted(manifest.splits)})")
    if manifest.rows(split) == 0:
        raise ValueError(f"{dataset_dir}: split {split!r} is empty; nothing to evaluate")
    model, meta = load_model_checkpoint(model_path)
    objective = objective_from_checkpoint(meta)  # how its outputs are read: model.pt's objective
    if objective.name == LANGUAGE_MODEL:  # per target token, no label per row: its own module
        from training.token_scoring import check_text_input, evaluate_tokens

        check_text_input(meta, manifest, model_path)
        return evaluate_tokens(
            model, meta, objective, manifest, dataset_dir, split, batch_size,
            return_predictions=return_predictions, max_predictions=max_predictions, started=started,
        )  # fmt: skip
    remap = check_compatible(meta, manifest, model_path)
    normaliser = Normaliser.from_checkpoint(meta)  # the model's own statistics, also when re-scoring a champion
    classification, multilabel = manifest.task == "classification", manifest.task == "multilabel"
    if classification:
        evaluation = _ClassificationEvaluation(objective, manifest.n_outputs)
    else:
        tally = objective.tally(manifest.n_outputs if multilabel else None)
    samples, kept_predictions, kept_targets = 0, [], []
    image = next((name for name, info in checkpoint_inputs(meta).items() if info.kind == "image"), None)
    misclassified: list[dict[str, Any]] = []
    texts = [name for name, info in checkpoint_inputs(meta).items() if info.kind == "text"]
    wrong = ConfidentlyWrong(texts, manifest.label_mapping) if classification and texts else None
    with torch.inference_mode():
        for x, y, raw in _iter_batches(manifest, dataset_dir, split, meta, batch_size):
            output = model(x)  # x: the batch dict, through the model's own codecs and normalisation
            if classification:
                predicted = evaluation.add(output, y, remap)
                if image is not None and len(misclassified) < MISCLASSIFIED_SHOWN:
                    is_wrong = predicted != y.long()
                    _keep_misclassified(misclassified, raw, image, is_wrong, y, predicted, manifest.label_mapping)
                if wrong is not None:
                    wrong.add(samples, raw, y, predicted, evaluation.probabilities(output, remap))
            elif multilabel:  # the objective's multilabel tally; predictions multi-hot [B, C] (no confusion matrix)
                tally.add(output, y)
                predicted = objective.decode(output)[0]
            else:
                # Scored on the standardised scale the model trained on, as validation is; reported on the
                # original one (the tally's target_std); predictions on the original scale.
                tally.add(output, normaliser.target_(y.float().clone()))
                predicted = normaliser.target_inverse(output.reshape(-1).float())
            samples += len(y)
            if return_predictions:
                room = len(y) if max_predictions is None else max(0, max_predictions - sum(map(len, kept_targets)))
                if room:
                    kept_predictions.append(predicted[:room].numpy())
                    kept_targets.append(y[:room].numpy())
    if samples != manifest.rows(split):
        raise RuntimeError(f"{dataset_dir}: read {samples} {split} rows but the manifest lists {manifest.rows(split)}")
    result = EvalResult(task=manifest.task, split=split, samples=samples, metrics={}, seconds=0.0)
    if classification:
        result.metrics, result.per_class = evaluation.metrics(split, manifest.label_mapping)
        result.confusion_matrix = evaluation.confusion_matrix()
        result.class_labels = [str(label) for label in manifest.label_mapping]
        result.misclassified = misclassified if image is not None else None
        result.confidently_wrong = wrong.table() if wrong is not None else None
    elif multilabel:
        result.metrics, result.per_class = _multilabel_metrics(tally, split, manifest.label_mapping)
        result.class_labels = [str(label) for label in manifest.label_mapping]
    else:
        result.metrics = tally.metrics(tally.sums(), split, normaliser.target_std)
    result.metrics[f"{split}_samples"] = float(samples)
    if return_predictions:
        result.predictions = np.concatenate(kept_predictions) if kept_predictions else np.empty(0)
        result.targets = np.concatenate(kept_targets) if kept_targets else np.empty(0)
    result.seconds = time.perf_counter() - started
    return result
