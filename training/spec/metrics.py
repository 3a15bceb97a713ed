"""Exact metrics from sums: the tallies an objective fills (training/spec/objectives.py), ROC AUC and PR AUC.

A tally turns each batch into a fixed-length float64 vector of SUMS (counts, loss sums, per-class
true positives...). Sums add across batches, across ranks (one all-reduce of the vector) and across
shards, so a metric computed from the total is exact: no per-batch average is ever averaged again.
The same tally serves validation in the ranks (training/loop.py: ``evaluate``, summed over ranks by
the Trainer) and the test-split evaluation in one process (training/evaluate.py), so both report
the same formulas.

    tally = objective.tally(n_classes)
    tally.add(outputs, labels, weights)       # per batch; weights None: every row counts 1
    sums = tally.sums()                       # float64 [tally.size], all-reducible
    tally.metrics(sums, "val", target_std)    # {"val_loss": ..., "val_accuracy": ...}

F1 conventions (sklearn's ``zero_division=0``): a class never predicted has precision 0, a class
without support recall 0, and F1 0 when both are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

TOP_K = 5
TOP_K_ABOVE_CLASSES = 10  # top-5 accuracy is reported only above this many classes


def f1_scores(true_positive: torch.Tensor, predicted: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per-class F1 from counts: 2 TP / (predicted + actual), 0 where both counts are 0."""
    denominator = predicted + actual
    return torch.where(denominator > 0, 2 * true_positive / denominator.clamp(min=1e-12), torch.zeros_like(denominator))


def precision_recall(
    true_positive: torch.Tensor, predicted: torch.Tensor, actual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    zero = torch.zeros_like(true_positive)
    precision = torch.where(predicted > 0, true_positive / predicted.clamp(min=1e-12), zero)
    recall = torch.where(actual > 0, true_positive / actual.clamp(min=1e-12), zero)
    return precision, recall


def roc_auc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Exact ROC AUC: the probability that a random positive scores above a random negative, ties counting
    one half (the Mann-Whitney U statistic with average ranks; equals sklearn's ``roc_auc_score``).
    NaN when one class is absent (AUC is undefined)."""
    scores = np.asarray(scores, dtype=np.float64)
    positives = np.asarray(positives).astype(bool)
    n_positive = int(positives.sum())
    n_negative = len(positives) - n_positive
    if n_positive == 0 or n_negative == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of tied scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(sorted_scores)]
    run_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(run_rank, ends - starts)
    u = ranks[positives].sum() - n_positive * (n_positive + 1) / 2.0
    return float(u / (n_positive * n_negative))


def pr_auc(scores: np.ndarray, positives: np.ndarray) -> float:
    """Exact PR AUC as average precision: the precision at each distinct score threshold (rows tied on a score
    enter together), weighted by the recall it adds (equals sklearn's ``average_precision_score``). NaN when no
    row is positive (undefined); 1 when every row is."""
    scores = np.asarray(scores, dtype=np.float64)
    positives = np.asarray(positives).astype(bool)
    n_positive = int(positives.sum())
    if n_positive == 0:
        return math.nan
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, hits = scores[order], positives[order]
    # The last row of each run of tied scores: one threshold each.
    ends = np.r_[np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]), len(sorted_scores) - 1]
    true_positive = np.cumsum(hits)[ends]
    precision = true_positive / (ends + 1)
    recall_added = np.diff(np.r_[0, true_positive]) / n_positive
    return float(np.sum(recall_added * precision))


class Tally:
    """A fixed layout of named float64 sums; subclasses say what a batch adds and what the sums mean."""

    def __init__(self, layout: dict[str, int]):
        self.layout = layout  # name -> length, in order
        self.size = sum(layout.values())
        self._sums: torch.Tensor | None = None  # on the device of the first batch: no sync per batch

    def part(self, sums: torch.Tensor, name: str) -> torch.Tensor:
        start = 0
        for key, length in self.layout.items():
            if key == name:
                piece = sums[start : start + length]
                return piece[0] if length == 1 else piece
            start += length
        raise KeyError(name)

    def _add(self, device: torch.device, **values: torch.Tensor | float | None) -> None:
        pieces = []
        for key, length in self.layout.items():
            value = values.get(key)
            if value is None:
                pieces.append(torch.zeros(length, dtype=torch.float64, device=device))
            else:
                pieces.append(torch.as_tensor(value).detach().to(device, torch.float64).reshape(length))
        batch = torch.cat(pieces)
        self._sums = batch if self._sums is None else self._sums + batch

    def sums(self) -> torch.Tensor:
        """The sums so far (float64 [size]), on the batches' device; zeros before any batch."""
        return torch.zeros(self.size, dtype=torch.float64) if self._sums is None else self._sums.clone()

    def rows(self, sums: torch.Tensor) -> int:
        return int(round(float(self.part(sums, "rows"))))

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def metrics(self, sums: torch.Tensor, prefix: str, target_std: float = 1.0) -> dict[str, float]:
        raise NotImplementedError

    def scored_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(score, is positive) of every row added, where a metric needs the rows themselves (ROC AUC ranks
        them: no sum gives it exactly); None for tallies of sums only. Ranks gather theirs and concatenate."""
        return None


def _weighted(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return values.double().sum() if weights is None else (values.double() * weights.double()).sum()


def _weight_sum(rows: int, weights: torch.Tensor | None) -> torch.Tensor | float:
    return float(rows) if weights is None else weights.double().sum()


class ClassTally(Tally):
    """softmax and binary: the objective's (weighted) loss, log loss, accuracy, top-5, and per-class counts.

    ``decode`` gives (predicted class index, class probabilities [B, C]) for a batch of outputs; ``loss``
    the objective's per-row loss (with label smoothing in training) and ``log_loss`` the plain negative
    log-likelihood per row."""

    def __init__(
        self,
        n_classes: int,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        log_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        decode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        score: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.n_classes = n_classes
        self.top_k = n_classes > TOP_K_ABOVE_CLASSES
        self._loss, self._log_loss, self._decode = loss, log_loss, decode
        # Two classes (binary, softmax): each row's score for class 1 (its log-odds), kept for the exact ROC AUC and
        # PR AUC (4 + 1 bytes a row).
        self._score = score
        self._scores: list[np.ndarray] = []
        self._positives: list[np.ndarray] = []
        super().__init__(
            {"rows": 1, "weight": 1, "loss": 1, "log_loss": 1, "correct": 1, "top_k": 1}
            | {"true_positive": n_classes, "predicted": n_classes, "actual": n_classes}
        )

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        outputs, labels = outputs.float(), labels.long()
        predicted, probabilities = self._decode(outputs)
        hit = predicted == labels
        counts = {
            "true_positive": torch.bincount(labels[hit], minlength=self.n_classes),
            "predicted": torch.bincount(predicted, minlength=self.n_classes),
            "actual": torch.bincount(labels, minlength=self.n_classes),
        }
        top_k = None
        if self.top_k:
            top = probabilities.topk(TOP_K, dim=1).indices
            top_k = (top == labels[:, None]).any(dim=1).sum()
        self._add(
            outputs.device,
            rows=float(len(labels)),
            weight=_weight_sum(len(labels), weights),
            loss=_weighted(self._loss(outputs, labels), weights),
            log_loss=self._log_loss(outputs, labels).double().sum(),
            correct=hit.sum(),
            top_k=top_k,
            **counts,
        )
        if self._score is not None:
            self._scores.append(self._score(outputs).detach().float().cpu().numpy())
            self._positives.append((labels == 1).cpu().numpy())

    def scored_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self._score is None:
            return None
        if not self._scores:
            return np.empty(0, np.float32), np.empty(0, bool)
        return np.concatenate(self._scores), np.concatenate(self._positives)

    def metrics(
        self,
        sums: torch.Tensor,
        prefix: str,
        target_std: float = 1.0,
        scored: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> dict[str, float]:
        """``scored``: every row's ``scored_rows()`` (all ranks'), for ``<prefix>_roc_auc`` and ``<prefix>_pr_auc``."""
        rows, weight = float(self.part(sums, "rows")), float(self.part(sums, "weight"))
        if rows == 0:
            return {}
        f1 = f1_scores(self.part(sums, "true_positive"), self.part(sums, "predicted"), self.part(sums, "actual"))
        metrics = {
            f"{prefix}_loss": float(self.part(sums, "loss")) / weight,
            f"{prefix}_accuracy": float(self.part(sums, "correct")) / rows,
            f"{prefix}_macro_f1": float(f1.mean()),
            f"{prefix}_log_loss": float(self.part(sums, "log_loss")) / rows,
        }
        if self.top_k:
            metrics[f"{prefix}_top{TOP_K}_accuracy"] = float(self.part(sums, "top_k")) / rows
        if scored is not None:
            metrics[f"{prefix}_roc_auc"] = roc_auc(*scored)
            metrics[f"{prefix}_pr_auc"] = pr_auc(*scored)
        return metrics

    def majority_share(self, sums: torch.Tensor) -> float:
        """The share of the rows in the most frequent class: the accuracy of always answering it."""
        actual = self.part(sums, "actual")
        return float(actual.max() / actual.sum()) if float(actual.sum()) > 0 else math.nan

    def per_class(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(precision, recall, support) per class."""
        actual = self.part(sums, "actual")
        precision, recall = precision_recall(self.part(sums, "true_positive"), self.part(sums, "predicted"), actual)
        return precision, recall, actual


class MultilabelTally(Tally):
    """multilabel: the (weighted) loss and per-label counts at a 0.5 probability threshold: micro and macro F1."""

    def __init__(self, n_labels: int, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.n_labels, self._loss = n_labels, loss
        super().__init__(
            {"rows": 1, "weight": 1, "loss": 1, "exact_match": 1}
            | {"true_positive": n_labels, "predicted": n_labels, "actual": n_labels}
        )

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        outputs, labels = outputs.float(), labels.float()
        predicted, actual = outputs > 0, labels > 0.5  # sigmoid(x) > 0.5 <=> x > 0
        self._add(
            outputs.device,
            rows=float(len(labels)),
            weight=_weight_sum(len(labels), weights),
            loss=_weighted(self._loss(outputs, labels), weights),
            exact_match=(predicted == actual).all(dim=1).sum(),
            true_positive=(predicted & actual).sum(dim=0),
            predicted=predicted.sum(dim=0),
            actual=actual.sum(dim=0),
        )

    def metrics(self, sums: torch.Tensor, prefix: str, target_std: float = 1.0) -> dict[str, float]:
        rows, weight = float(self.part(sums, "rows")), float(self.part(sums, "weight"))
        if rows == 0:
            return {}
        tp, predicted, actual = (self.part(sums, name) for name in ("true_positive", "predicted", "actual"))
        micro = f1_scores(tp.sum(), predicted.sum(), actual.sum())
        return {
            f"{prefix}_loss": float(self.part(sums, "loss")) / weight,
            f"{prefix}_micro_f1": float(micro),
            f"{prefix}_macro_f1": float(f1_scores(tp, predicted, actual).mean()),
            f"{prefix}_exact_match": float(self.part(sums, "exact_match")) / rows,
        }


class RegressionTally(Tally):
    """mse and huber on the standardised target: the (weighted) loss, and RMSE, MAE, R² on the original scale
    (``target_std``: squared errors times std², absolute errors times std; R² does not change)."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss_scale_power: int):
        self._loss = loss
        self.loss_scale_power = loss_scale_power  # mse: 2 (exact on the original scale); huber: 0 (standardised)
        super().__init__({"rows": 1, "weight": 1, "loss": 1, "squared": 1, "absolute": 1, "y": 1, "y_squared": 1})

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        predicted = outputs.float().reshape(labels.shape)
        error = predicted.double() - labels.double()
        self._add(
            outputs.device,
            rows=float(len(labels)),
            weight=_weight_sum(len(labels), weights),
            loss=_weighted(self._loss(predicted, labels), weights),
            squared=error.square().sum(),
            absolute=error.abs().sum(),
            y=labels.double().sum(),
            y_squared=labels.double().square().sum(),
        )

    def metrics(self, sums: torch.Tensor, prefix: str, target_std: float = 1.0) -> dict[str, float]:
        rows, weight = float(self.part(sums, "rows")), float(self.part(sums, "weight"))
        if rows == 0:
            return {}
        squared = float(self.part(sums, "squared"))
        y, y_squared = float(self.part(sums, "y")), float(self.part(sums, "y_squared"))
        total = y_squared - y * y / rows
        mse = squared / rows
        return {
            f"{prefix}_loss": float(self.part(sums, "loss")) / weight * target_std**self.loss_scale_power,
            f"{prefix}_rmse": math.sqrt(mse) * target_std,
            f"{prefix}_mae": float(self.part(sums, "absolute")) / rows * target_std,
            # A constant target: R² is undefined; report 0 rather than inf/NaN.
            f"{prefix}_r2": 1.0 - squared / total if total > 0 else 0.0,
        }


class MeanTally(Tally):
    """A user objective: its (weighted) loss and the means of the per-row metrics it names."""

    def __init__(self, loss: Callable, row_metrics: Callable, names: tuple[str, ...], loss_scale_power: int = 0):
        self._loss, self._row_metrics, self.names = loss, row_metrics, names
        self.loss_scale_power = loss_scale_power
        super().__init__({"rows": 1, "weight": 1, "loss": 1} | {f"m_{name}": 1 for name in names})

    def add(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        values = self._row_metrics(outputs.float(), labels)
        self._add(
            outputs.device,
            rows=float(len(labels)),
            weight=_weight_sum(len(labels), weights),
            loss=_weighted(self._loss(outputs.float(), labels), weights),
            **{f"m_{name}": values[name].double().sum() for name in self.names},
        )

    def metrics(self, sums: torch.Tensor, prefix: str, target_std: float = 1.0) -> dict[str, float]:
        rows, weight = float(self.part(sums, "rows")), float(self.part(sums, "weight"))
        if rows == 0:
            return {}
        metrics = {f"{prefix}_loss": float(self.part(sums, "loss")) / weight * target_std**self.loss_scale_power}
        for name in self.names:
            metrics[f"{prefix}_{name}"] = float(self.part(sums, f"m_{name}")) / rows
        return metrics
