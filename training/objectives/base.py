"""The one loss contract: every objective returns a PER-ROW loss, and the step's loss is

    L = Σ_i w_i · ℓ_i / Σ_i w_i     over the real rows of the GLOBAL batch (all ranks, all micro-batches),

w_i the row's weight (its data.weight times its class weight under ``train.class_weights``; 1 otherwise; sampler padding
0). training/loop/step.py: ``TrainStep`` makes DDP's averaged gradient exactly ∇L whatever the world size
(its docstring). An objective says:

- ``n_outputs(n_classes)``: the width of the model's output ``[B, n]``;
- ``label_kind``: what a label is: a class index (int64 ``[B]``), a multi-hot row (float32 ``[B, C]``)
  or a value (float32 ``[B]``, the standardised regression target);
- ``per_row_loss(outputs, labels) -> [B]``: float32, computed in fp32 also under bf16 autocast;
- ``tally(n_classes)``: the sums its exact metrics come from (training/objectives/metrics.py);
- a model of k members (an ensemble: ``output_members(model) = k``, its outputs ``[B, k, n]``) trains on
  ``member_loss`` (each member its OWN per-row loss, averaged over the k members: TabM) and is read through
  ``combine_members``, the one place where k members' outputs become one prediction per row ``[B, n]``: in the
  objective's own output space, so that ``decode`` gives the MEAN of the members' probabilities (classes) or
  values (regression). ``loss_of`` and ``prediction`` take either kind of model;
- ``decode(outputs) -> (label index or value, probabilities or None)``: what evaluation and serving report;
- ``uses_label``, ``has_baselines`` and ``evaluation(task) -> Evaluation``: how a model trained with it is
  evaluated, shown and judged (which evaluator scores it, what its result is called, the gate's default metric,
  the headline metrics, its figure): the questions tasks/ and ddpflow/tracking/ ask the objective's record
  (``registry.py: objective_record``) instead of naming an objective. The defaults follow the dataset's task,
  so a user's objective is evaluated as today's built-in of its task.

The built-in objectives implement it beside this module (``builtin.py``, ``next_token.py``); the registry
(``registry.py``) builds the one ``train.objective`` names, built-in or a user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from training.objectives.metrics import MeanTally, Tally

CLASS_INDEX, MULTI_HOT, VALUE = "class_index", "multi_hot", "value"  # what a label is
# Which evaluator scores a model (training/inference/evaluate.py: evaluate_split).
ROW_SCORER, TOKEN_SCORER = "rows", "tokens"


@dataclass(frozen=True)
class Evaluation:
    """How a model trained with an objective is evaluated, shown and judged.

    ``scored_as``: what its evaluation is (``EvalResult.task``): the dataset's task or the objective's own kind;
    ``scorer``: ROW_SCORER (a label per row, training/inference/evaluate.py) or TOKEN_SCORER (a language model's target
    tokens, training/inference/token_scoring.py); ``gate_metric``: what the gate judges unless
    ``registry.metric`` says otherwise; ``headline``: the metrics the evaluate task's log line shows;
    ``keeps_predictions``: its figure needs per-row predictions; ``figure``: the figure's name
    (ddpflow/tracking/plots.py: FIGURES), None for the task's own (confusion matrix, per-class recall, residuals);
    ``note``: what the evaluate task logs besides (``str.format`` with the metrics and ``samples``);
    ``two_class_gate_metric``: the gate's default instead of ``gate_metric`` for a label of exactly two classes
    (``for_classes``); ``signal_metric``: the proper score that tells a model that learnt something from a guess
    whatever the gate metric (the log loss of classes, the RMSE of values; ddpflow/tracking/gate.py says what a
    model that beats the trivial baseline on it but not on the gate metric fails)."""

    scored_as: str
    gate_metric: str
    headline: tuple[str, ...]
    scorer: str = ROW_SCORER
    keeps_predictions: bool = False
    figure: str | None = None
    note: str | None = None
    two_class_gate_metric: str | None = None
    signal_metric: str | None = None

    def for_classes(self, n_classes: int | None) -> Evaluation:
        """The evaluation of a label with ``n_classes`` classes (None: not classes, or not known): with exactly two
        and a ``two_class_gate_metric``, the gate judges that (ROC AUC: the ranking, whose trivial baseline is 0.5,
        where the accuracy of a model with real signal can equal the majority class's share), first in the
        headline; otherwise this evaluation as it is. The one rule of the two-class default."""
        if n_classes != 2 or self.two_class_gate_metric is None:
            return self
        metric = self.two_class_gate_metric
        return replace(self, gate_metric=metric, headline=(metric, *(name for name in self.headline if name != metric)))


TASK_EVALUATIONS = {  # an objective of the dataset's task, per row (every built-in but a language model's)
    "classification": Evaluation(
        "classification", "test_accuracy", ("test_accuracy", "test_macro_f1", "test_loss"),
        two_class_gate_metric="test_roc_auc", signal_metric="test_log_loss",
    ),
    "multilabel": Evaluation(
        "multilabel", "test_micro_f1", ("test_micro_f1", "test_macro_f1", "test_exact_match"), signal_metric="test_loss"
    ),
    "regression": Evaluation(
        "regression", "test_rmse", ("test_rmse", "test_mae", "test_r2"),
        keeps_predictions=True, signal_metric="test_rmse",
    ),
}  # fmt: skip


def mean_in_log_space(log_values: torch.Tensor) -> torch.Tensor:
    """``log(mean over dim 1 of exp(log_values))``, computed stably: the log of the members' mean probability."""
    return torch.logsumexp(log_values, dim=1) - math.log(log_values.shape[1])


def output_members(model: torch.nn.Module) -> int:
    """How many members a model's outputs hold: k for an ensemble that says so (``output_members = k``, its
    outputs ``[B, k, n]``: training/models/tabular.py), 1 for every other model (``[B, n]``); a DDP wrapper
    answers for the module it wraps."""
    return int(getattr(getattr(model, "module", model), "output_members", 1))


class Objective:
    """The contract (module docstring). A user objective subclasses it and defines ``per_row_loss``."""

    name = "objective"
    label_kind = VALUE
    uses_label = True  # the dataset's label is what it learns (drift reports the label's drift)
    has_baselines = False  # a constant or another model can stand for its outputs (training/inference/baselines.py)
    # The loss on the target's original scale is the standardised one times target_std ** this
    # (mse: 2, exact; every other objective reports its loss on the scale it trains on: 0).
    loss_scale_power = 0

    def __init__(self, n_classes: int | None = None, **kwargs: Any):
        self.n_classes = n_classes
        self.kwargs = dict(kwargs)
        self.class_weights: torch.Tensor | None = None  # [C] float32, set by build_objective

    @classmethod
    def evaluation(cls, task: str) -> Evaluation:
        """How a model trained with it on a ``task`` dataset is evaluated and judged (``Evaluation``)."""
        return TASK_EVALUATIONS.get(task, TASK_EVALUATIONS["regression"])

    def n_outputs(self, n_classes: int | None) -> int:
        return n_classes if self.label_kind != VALUE and n_classes else 1

    def per_row_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define per_row_loss(outputs, labels) -> [B]")

    def loss_of(self, outputs: torch.Tensor, labels: torch.Tensor, members: int = 1) -> torch.Tensor:
        """The per-row loss training minimises: ``per_row_loss``, or with k > 1 members ``member_loss``."""
        return self.per_row_loss(outputs, labels) if members == 1 else self.member_loss(outputs, labels)

    def member_loss(self, members: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """k members' outputs ``[B, k, n]`` -> ``[B]``: the mean over the members of each member's own
        ``per_row_loss`` (TabM, Gorishniy et al., ICLR 2025): every member learns to predict on its own, so a
        member's gradient does not depend on the others' outputs."""
        rows, k = members.shape[:2]
        flat = members.reshape(rows * k, *members.shape[2:])
        return self.per_row_loss(flat, labels.repeat_interleave(k, dim=0)).reshape(rows, k).mean(dim=1)

    def prediction(self, outputs: torch.Tensor, members: int = 1) -> torch.Tensor:
        """The model's outputs as one output per row ``[B, n]``: as they are, or ``combine_members``."""
        return outputs if members == 1 else self.combine_members(outputs)

    def combine_members(self, members: torch.Tensor) -> torch.Tensor:
        """k members' outputs ``[B, k, n]`` -> ``[B, n]`` that ``decode`` reads as the mean of the members'
        predictions: a value -> the members' mean value; class logits (softmax) -> the log of the members' mean
        probabilities (their softmax is that mean, their cross entropy the mean prediction's log loss). An
        objective whose ``decode`` reads its outputs otherwise (sigmoid: ``builtin.py``) says so here."""
        members = members.float()
        if self.label_kind == VALUE:
            return members.mean(dim=1)
        return mean_in_log_space(members.log_softmax(dim=-1))

    def metric_names(self) -> tuple[str, ...]:
        return ()

    def row_metrics(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def decode(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.label_kind == VALUE:
            return outputs.float().reshape(len(outputs)), None
        probabilities = outputs.float().softmax(dim=1)
        return outputs.argmax(dim=1), probabilities

    def tally(self, n_classes: int | None) -> Tally:
        return MeanTally(self.per_row_loss, self.row_metrics, self.metric_names(), self.loss_scale_power)

    def row_weights(self, labels: torch.Tensor) -> torch.Tensor | None:
        """Each row's class weight (``train.class_weights``), or None when every row weighs 1."""
        if self.class_weights is None:
            return None
        return self.class_weights.to(labels.device).index_select(0, labels.long())

    def remap_outputs(self, outputs: torch.Tensor, remap: torch.Tensor) -> torch.Tensor:
        """Outputs in the model's class order -> the dataset's (``remap[model index] = dataset index``)."""
        return torch.empty_like(outputs).index_copy_(1, remap.to(outputs.device), outputs)

    def targets(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """What ``per_row_loss`` compares the outputs with: the batch's labels (next_token: its own tokens)."""
        return labels

    def split_row_weights(self, split) -> torch.Tensor | None:
        """Each train row's weight in the loss, for the whole split (``TrainBatches``): its class weight."""
        return self.row_weights(split.labels)

    def model_kwargs(self) -> dict[str, Any]:
        """What the model must be told beyond ``train.model_kwargs`` (next_token: which text it models)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What model.pt records (``objective_from_checkpoint`` rebuilds it): the name and its kwargs only;
        label smoothing and class weights shape training, not how a model's outputs are read."""
        return {"name": self.name, "kwargs": dict(self.kwargs)}
