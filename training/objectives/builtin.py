"""The built-in objectives (the contract: ``base.py: Objective``).

Built-ins (``train.objective``):

- ``softmax``: C outputs, a class index label; cross entropy (with ``train.label_smoothing``);
  metrics: loss, accuracy, macro-F1, log loss, top-5 accuracy above 10 classes; with 2 classes ROC AUC and
  PR AUC too, as binary (class index 1 positive, scored by its log-odds).
- ``binary``: ONE logit, the class index 0/1 of a 2-class label (index 1, the second label in sorted
  order, is the positive class); BCE with logits; the same metrics, plus ROC AUC (exact: every row's
  score is kept and ranked).
- ``multilabel``: C outputs, a sigmoid each, a multi-hot label; BCE AVERAGED over the C labels of the
  row (so the loss does not grow with C; as ``BCEWithLogitsLoss(reduction="mean")`` over ``[B, C]``);
  metrics: loss, micro-F1, macro-F1 (threshold 0.5), exact match.
- ``mse``: 1 output, a value; squared error; metrics: loss, RMSE, MAE, R² (on the original scale).
- ``huber``: the same, Huber loss with ``delta`` (``train.objective_kwargs``, default 1.0) in units of
  the target's standard deviation (it trains on the standardised target); its loss is reported on
  that standardised scale.

An ensemble (a model of k members) trains on the mean of its members' own losses and predicts with the mean of
their probabilities (``softmax``: the log of the mean as its outputs; ``binary``, ``multilabel``: the logit of the
mean sigmoid) or values (``base.py: Objective.member_loss, combine_members``).

Each is evaluated as its task's (``base.py: Objective.evaluation``) and has baselines (a constant or the
reference model can stand for its outputs: ``has_baselines``). ``next_token`` (a language model) has its own
module, ``next_token.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.core.config import ConfigError
from training.objectives.base import CLASS_INDEX, MULTI_HOT, VALUE, Objective, mean_in_log_space
from training.objectives.metrics import ClassTally, MultilabelTally, RegressionTally

DEFAULT_HUBER_DELTA = 1.0


class Softmax(Objective):
    has_baselines = True
    name, label_kind = "softmax", CLASS_INDEX

    def __init__(self, n_classes: int | None = None, label_smoothing: float = 0.0):
        super().__init__(n_classes)
        self.label_smoothing = label_smoothing

    def per_row_loss(self, outputs, labels):
        return F.cross_entropy(outputs.float(), labels.long(), reduction="none", label_smoothing=self.label_smoothing)

    def log_loss(self, outputs, labels):
        return F.cross_entropy(outputs.float(), labels.long(), reduction="none")

    def tally(self, n_classes):
        score = self.positive_score if n_classes == 2 else None  # two classes: ROC AUC and PR AUC, as binary
        return ClassTally(n_classes, self.per_row_loss, self.log_loss, self.decode, score=score)

    def positive_score(self, outputs):
        """Two classes: the row's log-odds of class 1 (logit 1 - logit 0); it ranks rows as its probability does."""
        outputs = outputs.float()
        return outputs[:, 1] - outputs[:, 0]


class Binary(Objective):
    has_baselines = True
    name, label_kind = "binary", CLASS_INDEX

    def n_outputs(self, n_classes):
        return 1

    def per_row_loss(self, outputs, labels):
        logits = outputs.float().reshape(len(outputs))
        return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")

    def decode(self, outputs):
        logits = outputs.float().reshape(len(outputs))
        positive = torch.sigmoid(logits)
        return (logits > 0).long(), torch.stack([1 - positive, positive], dim=1)

    def tally(self, n_classes):
        return ClassTally(2, self.per_row_loss, self.per_row_loss, self.decode, score=self.positive_score)

    def positive_score(self, outputs):
        """The row's logit for class 1: it ranks rows as its probability does (ROC AUC)."""
        return outputs.float().reshape(len(outputs))

    def combine_members(self, members):
        return mean_sigmoid_logit(members)

    def remap_outputs(self, outputs, remap):
        # One logit for class index 1: a model whose classes are the other way round scores the other class.
        return outputs if remap.tolist() == [0, 1] else -outputs


class Multilabel(Objective):
    has_baselines = True
    name, label_kind = "multilabel", MULTI_HOT

    def per_row_loss(self, outputs, labels):
        losses = F.binary_cross_entropy_with_logits(outputs.float(), labels.float(), reduction="none")
        return losses.mean(dim=1)  # averaged over the labels: the loss scale does not depend on C

    def decode(self, outputs):
        return outputs > 0, torch.sigmoid(outputs.float())

    def tally(self, n_classes):
        return MultilabelTally(n_classes, self.per_row_loss)

    def combine_members(self, members):
        return mean_sigmoid_logit(members)


def mean_sigmoid_logit(members: torch.Tensor) -> torch.Tensor:
    """Sigmoid outputs of k members ``[B, k, n]`` -> the logit of their mean probability ``[B, n]`` (stable:
    log p̄ - log(1 - p̄), each a log of a mean of sigmoids)."""
    members = members.float()
    return mean_in_log_space(F.logsigmoid(members)) - mean_in_log_space(F.logsigmoid(-members))


class MeanSquaredError(Objective):
    has_baselines = True
    name, label_kind, loss_scale_power = "mse", VALUE, 2

    def per_row_loss(self, outputs, labels):
        return (outputs.float().reshape(labels.shape) - labels.float()).square()

    def tally(self, n_classes):
        return RegressionTally(self.per_row_loss, self.loss_scale_power)


class Huber(Objective):
    has_baselines = True
    name, label_kind = "huber", VALUE

    def __init__(self, n_classes: int | None = None, delta: float = DEFAULT_HUBER_DELTA):
        if not delta > 0:
            raise ConfigError(f"train.objective_kwargs: huber's delta must be positive, got {delta!r}")
        super().__init__(n_classes, delta=float(delta))
        self.delta = float(delta)

    def per_row_loss(self, outputs, labels):
        predicted = outputs.float().reshape(labels.shape)
        return F.huber_loss(predicted, labels.float(), reduction="none", delta=self.delta)

    def tally(self, n_classes):
        return RegressionTally(self.per_row_loss, self.loss_scale_power)
