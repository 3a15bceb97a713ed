"""The baselines every evaluation is compared with, scored on the same test rows through the same tallies.

- trivial, always (``baseline_trivial/<metric>``): a constant "model" whose outputs are the train split's
  class prior as log-probabilities (softmax; binary: the prior's logit; multilabel: each label's prior
  logit) or the train split's mean (regression). Its accuracy is the share of test rows in the train
  split's majority class, its log loss the prior's, its ROC AUC 0.5 (every row tied), its R² about 0.
- reference, for tables (``baseline_reference/<metric>``): scikit-learn's HistGradientBoosting fitted on
  the train split (training/inference/reference.py), on by default (``eval.reference``).

Both are read as the candidate's own outputs are: through its objective (model.pt's), its class order,
its target normalisation, and ``training/inference/evaluate.py``'s tallies, so every metric has the definition the
candidate's has, and the rows are the manifest's test rows, each once (the count is checked).

    baselines = evaluate_baselines("runs/x/model.pt", "data/shards/<fp>", "test", reference=True)
    baselines.metrics()   # {"baseline_trivial/test_accuracy": 0.76, "baseline_reference/test_accuracy": 0.80, ...}

Plain code (no Prefect, no MLflow); the evaluate task runs it in its own process, never in the ranks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.core.location import open_parquet
from training.core.manifest import Manifest, read_manifest
from training.inference.evaluate import OutputScorer, _labels, class_outputs, value_outputs
from training.inference.reference import (
    DEFAULT_MAX_ROWS,
    FittedReference,
    reference_baseline,
    reference_skip_reason,
)
from training.kinds.normalisation import Normaliser
from training.objectives.registry import Objective, objective_from_checkpoint

TRIVIAL, REFERENCE = "baseline_trivial", "baseline_reference"
BASELINES = (TRIVIAL, REFERENCE)
# A class (or multilabel label state) without a train row counts as this many rows, so the prior's log loss
# stays finite on a test row of that class.
ABSENT_ROWS = 0.5
LABEL_BATCH_ROWS = 262_144

_logger = logging.getLogger("ddpflow.baselines")


def baseline_metric(which: str, metric: str) -> str:
    """``baseline_trivial/test_accuracy``: the MLflow name of a baseline's metric."""
    return f"{which}/{metric}"


def is_baseline_metric(name: str) -> bool:
    return name.split("/", 1)[0] in BASELINES


def model_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The candidate's own metrics, without its baselines'."""
    return {name: value for name, value in metrics.items() if not is_baseline_metric(name)}


def baseline_values(metrics: dict[str, float], which: str) -> dict[str, float]:
    """One baseline's metrics by their plain names (``test_accuracy``), from a flat dict."""
    prefix = f"{which}/"
    return {name[len(prefix) :]: value for name, value in metrics.items() if name.startswith(prefix)}


@dataclass
class Baselines:
    """The two baselines' metrics on one split (plain names, ``test_accuracy``), or why one is missing."""

    trivial: dict[str, float] | None = None
    reference: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)  # why a baseline is missing; how the reference was fitted
    reference_fit: dict[str, Any] | None = None  # rows, sampled, iterations, seconds

    def metrics(self) -> dict[str, float]:
        """Flat and MLflow-ready: ``baseline_trivial/<metric>``, ``baseline_reference/<metric>``; each class's
        precision and recall, and the test split's majority share (a property of its labels, not of a model),
        stay with the candidate's own metrics."""
        flat = {}
        for which, values in ((TRIVIAL, self.trivial), (REFERENCE, self.reference)):
            for name, value in (values or {}).items():
                if not any(part in name for part in ("_precision_", "_recall_", "_majority_share")):
                    flat[baseline_metric(which, name)] = value
        return flat


def log_prior(counts: np.ndarray, rows: float) -> np.ndarray:
    """log(count / rows) per class, a class without train rows counting ``ABSENT_ROWS``."""
    return np.log(np.where(counts > 0, counts, ABSENT_ROWS) / rows)


# ---------------------------------------------------------------------------------------- the train split


def label_batches(manifest: Manifest, dataset_dir: str | Path, split: str) -> Iterator[torch.Tensor]:
    """The split's labels as training and evaluation read them (``_labels``), shard by shard, in order."""
    for shard in manifest.shard_locations(dataset_dir, split):
        for batch in open_parquet(shard).iter_batches(batch_size=LABEL_BATCH_ROWS, columns=[manifest.label]):
            yield _labels(batch.column(0), manifest)


def train_class_counts(manifest: Manifest, dataset_dir: str | Path) -> np.ndarray:
    """Rows per class of the train split: the manifest's (prepare counted them), else counted from its shards
    (a manifest without them; multilabel: rows holding each label)."""
    if manifest.task == "classification" and manifest.train_class_counts is not None:
        return np.asarray(manifest.train_class_counts, dtype=np.float64)
    counts = np.zeros(manifest.n_outputs, dtype=np.float64)
    for labels in label_batches(manifest, dataset_dir, "train"):
        if manifest.task == "multilabel":
            counts += labels.double().sum(dim=0).numpy()
        else:
            counts += np.bincount(labels.numpy(), minlength=len(counts))
    return counts


def train_mean(manifest: Manifest, dataset_dir: str | Path) -> float:
    """The train split's mean target: the manifest's (prepare computed it), else from its shards."""
    if manifest.label_mean is not None:
        return float(manifest.label_mean)
    total, rows = 0.0, 0
    for labels in label_batches(manifest, dataset_dir, "train"):
        total, rows = total + float(labels.double().sum()), rows + len(labels)
    return total / max(rows, 1)


def trivial_outputs(
    objective: Objective, manifest: Manifest, dataset_dir: str | Path, normaliser: Normaliser
) -> torch.Tensor:
    """The constant model's one output row ``[1, n_outputs]``."""
    if manifest.task == "regression":
        return value_outputs(torch.tensor([train_mean(manifest, dataset_dir)]), normaliser)
    counts, rows = train_class_counts(manifest, dataset_dir), manifest.rows("train")
    if manifest.task == "multilabel":  # each label's prior logit: log p - log(1 - p)
        return torch.from_numpy(log_prior(counts, rows) - log_prior(rows - counts, rows)).float().unsqueeze(0)
    return class_outputs(objective, torch.from_numpy(log_prior(counts, rows)).float().unsqueeze(0))


# ---------------------------------------------------------------------------------------- both baselines


def checkpoint_reading(model_path: str | Path) -> tuple[Objective, Normaliser]:
    """How the candidate's outputs are read: model.pt's objective and target normalisation (weights untouched:
    memory-mapped, never read)."""
    meta = torch.load(Path(model_path), map_location="cpu", weights_only=True, mmap=True)
    return objective_from_checkpoint(meta), Normaliser.from_checkpoint(meta)


def trivial_baseline(
    objective: Objective, normaliser: Normaliser, manifest: Manifest, dataset_dir: str | Path, split: str = "test"
) -> dict[str, float]:
    """The constant model's metrics on every row of ``split`` (names as the candidate's: ``test_accuracy``)."""
    constant = trivial_outputs(objective, manifest, dataset_dir, normaliser)
    scorer = OutputScorer(objective, manifest, normaliser)
    for labels in label_batches(manifest, dataset_dir, split):
        scorer.add(constant.expand(len(labels), -1), labels)
    return scorer.metrics(split)


def evaluate_baselines(
    model_path: str | Path,
    dataset_dir: str | Path,
    split: str = "test",
    reference: bool = True,
    reference_max_rows: int | None = None,
    logger: Any = None,
    fitted_reference: FittedReference | None = None,
) -> Baselines:
    """Both baselines for the candidate ``model_path`` on ``split``; a baseline that does not apply is left out
    with the reason in ``notes`` (and in the log). ``fitted_reference``: the reference fitted while the candidate
    trained (``reference.fit_before_scoring``), scored here instead of fitting it now."""
    log = logger or _logger
    manifest = read_manifest(dataset_dir)
    objective, normaliser = checkpoint_reading(model_path)
    baselines = Baselines()
    if not objective.has_baselines:  # a user objective's outputs mean what its code says
        baselines.notes.append(
            f"no baselines: train.objective {objective.name!r} is not one whose outputs a constant or another "
            "model can stand for (Objective.has_baselines)"
        )
        log.info("Baselines: %s", baselines.notes[-1])
        return baselines
    started = time.perf_counter()
    baselines.trivial = trivial_baseline(objective, normaliser, manifest, dataset_dir, split)
    log.info("Baseline trivial (train prior or mean) scored in %.2fs", time.perf_counter() - started)
    skip = "eval.reference is false" if not reference else reference_skip_reason(manifest)
    if skip:
        baselines.notes.append(f"no reference model: {skip}")
        log.info("Baselines: %s", baselines.notes[-1])
        return baselines
    failure = fitted_reference.error if fitted_reference is not None else None
    if failure is None:
        try:
            max_rows = reference_max_rows or DEFAULT_MAX_ROWS
            scored = reference_baseline(objective, normaliser, manifest, dataset_dir, split, max_rows, fitted_reference)
        except Exception as error:  # a baseline never fails the candidate's evaluation: say why it is missing
            failure = f"{type(error).__name__}: {error}"
    if failure is not None:
        baselines.notes.append(f"no reference model: fitting it failed: {failure}")
        log.warning("Baselines: %s", baselines.notes[-1])
        return baselines
    baselines.reference, baselines.reference_fit = scored.metrics, scored.fit
    fit = scored.fit
    baselines.notes.append(
        f"reference: HistGradientBoosting fitted on {fit['rows']} train rows"
        + (f" (a sample of {fit['train_rows']})" if fit["rows"] < fit["train_rows"] else "")
        + f", {fit['iterations']} iterations in {fit['seconds']:.1f}s"
        + (", beside the training" if fitted_reference is not None else "")
    )
    log.info("Baselines: %s", baselines.notes[-1])
    return baselines


def comparison(metrics: dict[str, float], names: list[str]) -> str:
    """``test_roc_auc 0.781 · reference 0.781 · guessing 0.500`` for each of ``names`` the candidate has;
    '' when no baseline was scored."""
    parts = []
    for name in names:
        if name not in metrics:
            continue
        line = f"{name} {_number(metrics[name])}"
        for which, word in ((REFERENCE, "reference"), (TRIVIAL, "guessing")):
            value = metrics.get(baseline_metric(which, name))
            if value is not None:
                line += f" · {word} {_number(value)}"
        if line != f"{name} {_number(metrics[name])}":
            parts.append(line)
    return "; ".join(parts)


def _number(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) and abs(value) < 1000 else f"{value:.4g}"
