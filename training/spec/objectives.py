"""The one loss contract: every objective returns a PER-ROW loss, and the step's loss is

    L = Σ_i w_i · ℓ_i / Σ_i w_i     over the real rows of the GLOBAL batch (all ranks, all micro-batches),

w_i the row's weight (its data.weight times its class weight under ``train.class_weights``; 1 otherwise; sampler padding
0). training/loop.py: ``TrainStep`` makes DDP's averaged gradient exactly ∇L whatever the world size
(its docstring). An objective says:

- ``n_outputs(n_classes)``: the width of the model's output ``[B, n]``;
- ``label_kind``: what a label is: a class index (int64 ``[B]``), a multi-hot row (float32 ``[B, C]``)
  or a value (float32 ``[B]``, the standardised regression target);
- ``per_row_loss(outputs, labels) -> [B]``: float32, computed in fp32 also under bf16 autocast;
- ``tally(n_classes)``: the sums its exact metrics come from (training/spec/metrics.py);
- ``decode(outputs) -> (label index or value, probabilities or None)``: what evaluation and serving report.

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

``auto`` (the default): classification -> softmax (also for 2 classes, so today's models train to the
same weights), a list<string> label -> multilabel, regression -> mse.

A user objective ``package.module:factory`` is called as ``factory(n_classes, **train.objective_kwargs)``
(``n_classes`` None for regression) and returns an ``Objective`` (subclass this one): it must define
``per_row_loss``, may override ``n_outputs``, ``decode``, and name per-row metrics in
``metric_names``/``row_metrics`` (each reported as its mean over the split: ``val_<name>``,
``test_<name>``). The preflight calls it on a tiny batch and names the objective and the shape it
returned when that is not one loss per row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from training.config import ConfigError
from training.imports import import_factory
from training.spec.metrics import ClassTally, MeanTally, MultilabelTally, RegressionTally, Tally

CLASS_INDEX, MULTI_HOT, VALUE = "class_index", "multi_hot", "value"  # what a label is
BUILT_IN = ("softmax", "binary", "multilabel", "mse", "huber", "next_token")
DEFAULT_HUBER_DELTA = 1.0


class Objective:
    """The contract (module docstring). A user objective subclasses it and defines ``per_row_loss``."""

    name = "objective"
    label_kind = VALUE
    # The loss on the target's original scale is the standardised one times target_std ** this
    # (mse: 2, exact; every other objective reports its loss on the scale it trains on: 0).
    loss_scale_power = 0

    def __init__(self, n_classes: int | None = None, **kwargs: Any):
        self.n_classes = n_classes
        self.kwargs = dict(kwargs)
        self.class_weights: torch.Tensor | None = None  # [C] float32, set by build_objective

    def n_outputs(self, n_classes: int | None) -> int:
        return n_classes if self.label_kind != VALUE and n_classes else 1

    def per_row_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define per_row_loss(outputs, labels) -> [B]")

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


class Softmax(Objective):
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

    def remap_outputs(self, outputs, remap):
        # One logit for class index 1: a model whose classes are the other way round scores the other class.
        return outputs if remap.tolist() == [0, 1] else -outputs


class Multilabel(Objective):
    name, label_kind = "multilabel", MULTI_HOT

    def per_row_loss(self, outputs, labels):
        losses = F.binary_cross_entropy_with_logits(outputs.float(), labels.float(), reduction="none")
        return losses.mean(dim=1)  # averaged over the labels: the loss scale does not depend on C

    def decode(self, outputs):
        return outputs > 0, torch.sigmoid(outputs.float())

    def tally(self, n_classes):
        return MultilabelTally(n_classes, self.per_row_loss)


class MeanSquaredError(Objective):
    name, label_kind, loss_scale_power = "mse", VALUE, 2

    def per_row_loss(self, outputs, labels):
        return (outputs.float().reshape(labels.shape) - labels.float()).square()

    def tally(self, n_classes):
        return RegressionTally(self.per_row_loss, self.loss_scale_power)


class Huber(Objective):
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


BUILT_INS: dict[str, Callable[..., Objective]] = {
    "softmax": Softmax,
    "binary": Binary,
    "multilabel": Multilabel,
    "mse": MeanSquaredError,
    "huber": Huber,
}
TASKS = {"softmax": "classification", "binary": "classification", "mse": "regression", "huber": "regression"}


def auto_objective(task: str, multi_hot_label: bool = False) -> str:
    """The objective ``auto`` means (the one rule): classification -> softmax, a list<string> label ->
    multilabel, regression -> mse."""
    if multi_hot_label:
        return "multilabel"
    return "softmax" if task == "classification" else "mse"


def resolve_user_objective(name: str) -> Callable[..., Objective]:
    """The factory behind ``package.module:factory``; ConfigError naming train.objective when it does not import."""
    return import_factory(name, "train.objective", ConfigError)


def make_objective(
    name: str,
    task: str,
    n_classes: int | None,
    kwargs: Mapping[str, Any] | None = None,
    label_smoothing: float = 0.0,
    multi_hot_label: bool = False,
) -> Objective:
    """An objective for a dataset of ``task`` with ``n_classes``; ConfigError naming the field when it does not fit."""
    kwargs = dict(kwargs or {})
    resolved = auto_objective(task, multi_hot_label) if name == "auto" else name
    if label_smoothing and resolved != "softmax":
        raise ConfigError(
            f"train.label_smoothing: {label_smoothing} applies to the softmax objective only; "
            f"train.objective is {resolved!r}"
        )
    if resolved == "next_token":  # its own module (training/spec/next_token.py); any task's data
        from training.spec.next_token import NextToken

        return NextToken(n_classes, **kwargs)
    if resolved not in BUILT_INS:
        return _user_objective(resolved, task, n_classes, kwargs, multi_hot_label)
    _check_fits(resolved, task, n_classes, multi_hot_label)
    try:
        if resolved == "softmax":
            return Softmax(n_classes, label_smoothing=label_smoothing, **kwargs)
        return BUILT_INS[resolved](n_classes, **kwargs)
    except TypeError as error:
        raise ConfigError(f"train.objective_kwargs: {resolved} does not take {kwargs}: {error}") from None


def _check_fits(name: str, task: str, n_classes: int | None, multi_hot_label: bool) -> None:
    if multi_hot_label != (name == "multilabel"):
        what = "a list<string> label" if multi_hot_label else f"a {task} label"
        raise ConfigError(f"train.objective: {name!r} does not fit {what}; use 'auto'")
    if name in TASKS and TASKS[name] != task:
        raise ConfigError(f"train.objective: {name!r} is a {TASKS[name]} objective; the dataset's task is {task}")
    if name == "binary" and n_classes != 2:
        raise ConfigError(f"train.objective: 'binary' needs a label of exactly 2 classes; this one has {n_classes}")


def _user_objective(
    name: str, task: str, n_classes: int | None, kwargs: dict[str, Any], multi_hot_label: bool
) -> Objective:
    factory = resolve_user_objective(name)
    try:
        objective = factory(n_classes, **kwargs)
    except TypeError as error:
        raise ConfigError(f"train.objective: {name} cannot be built with objective_kwargs {kwargs}: {error}") from None
    if not isinstance(objective, Objective):
        raise ConfigError(
            f"train.objective: {name} returned {type(objective).__name__}; it must return a "
            "training.spec.objectives.Objective (subclass it and define per_row_loss)"
        )
    objective.name = name  # what model.pt records, so evaluation rebuilds the same objective
    objective.kwargs = kwargs
    if "label_kind" not in vars(type(objective)) and type(objective).label_kind == Objective.label_kind:
        # Not said: the label the dataset has (a class index, a multi-hot row or a value).
        objective.label_kind = MULTI_HOT if multi_hot_label else CLASS_INDEX if task == "classification" else VALUE
    return objective


def class_weight_vector(
    setting: str | Mapping[str, float], label_mapping: Sequence[Any], train_counts: Sequence[int] | None, where: str
) -> torch.Tensor | None:
    """``train.class_weights`` as a weight per class index: none -> None; balanced -> n / (C · count_c)
    (sklearn's rule, from the manifest's train class counts; a class without train rows counts 1);
    {label: weight} -> those weights, 1 for the classes it does not name."""
    if setting == "none":
        return None
    n_classes = len(label_mapping)
    if setting == "balanced":
        if train_counts is None:
            raise ConfigError(
                f"train.class_weights: 'balanced' needs the train split's class counts, which {where} lacks "
                "(prepared by an older ddpflow): delete that dataset directory and prepare the data again"
            )
        counts = torch.tensor(list(train_counts), dtype=torch.float64).clamp(min=1)
        return (counts.sum() / (n_classes * counts)).float()
    names = {str(label): index for index, label in enumerate(label_mapping)}
    unknown = sorted(str(label) for label in setting if str(label) not in names)
    if unknown:
        raise ConfigError(f"train.class_weights: labels {unknown} are not classes of {where} ({sorted(names)})")
    weights = torch.ones(n_classes, dtype=torch.float32)
    for label, weight in setting.items():
        weights[names[str(label)]] = float(weight)
    return weights


def multi_hot_label(manifest) -> bool:
    """Whether the manifest's label is a list<string> (multi-hot) label. The typed-input seam (issue 21, data
    side) records that; until it does, no prepared label is one."""
    return getattr(manifest, "task", None) == "multilabel" or manifest.extra.get("label_kind") == MULTI_HOT


def build_objective(train, manifest) -> Objective:
    """The training objective of ``train`` (a TrainConfig) on ``manifest``'s data: the rank and the preflight."""
    multi_hot = multi_hot_label(manifest)
    n_classes = len(manifest.label_mapping) if manifest.label_mapping is not None else None
    kwargs = train.objective_kwargs
    if train.objective == "next_token":
        from training.spec.next_token import next_token_kwargs

        kwargs = next_token_kwargs(kwargs, manifest)  # the text input and its vocabulary size
    objective = make_objective(train.objective, manifest.task, n_classes, kwargs, train.label_smoothing, multi_hot)
    if train.class_weights != "none":
        if objective.label_kind != CLASS_INDEX:
            raise ConfigError(
                f"train.class_weights: applies to class labels (softmax, binary); train.objective is {objective.name!r}"
            )
        counts = getattr(manifest, "train_class_counts", None)
        where = f"dataset {manifest.fingerprint}"
        objective.class_weights = class_weight_vector(train.class_weights, manifest.label_mapping, counts, where)
    return objective


def objective_from_checkpoint(meta: Mapping[str, Any]) -> Objective:
    """The objective a model.pt was trained with (its ``describe()``); files from before objectives existed
    were trained with ``auto``'s choice for their task."""
    recorded = meta.get("objective") or {"name": "auto", "kwargs": {}}
    n_classes = len(meta["label_mapping"]) if meta.get("label_mapping") is not None else None
    multi_hot = meta.get("task") == "multilabel"
    return make_objective(recorded["name"], meta["task"], n_classes, recorded.get("kwargs"), 0.0, multi_hot)


def check_objective(objective: Objective, n_classes: int | None) -> None:
    """Call the objective on a tiny batch: ConfigError naming it and the shape when it is not one loss per row."""
    if objective.name == "next_token":
        return  # built in, and per position: the one-row-one-output probe below does not apply
    rows, width = 2, objective.n_outputs(n_classes)
    outputs = torch.zeros(rows, width)
    labels = example_labels(objective.label_kind, rows, n_classes)
    try:
        loss = objective.per_row_loss(outputs, labels)
    except Exception as error:  # a user's code: say whose it is and what it was given
        raise ConfigError(
            f"train.objective: {objective.name}.per_row_loss failed on outputs of shape {tuple(outputs.shape)} "
            f"and labels of shape {tuple(labels.shape)}: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != (rows,) or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(
            f"train.objective: {objective.name}.per_row_loss returned {got} for outputs of shape "
            f"{tuple(outputs.shape)}; it must return one floating-point loss per row, shape ({rows},)"
        )
    metrics = objective.row_metrics(outputs, labels)
    for name in objective.metric_names():
        value = metrics.get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (rows,):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                f"train.objective: {objective.name}.row_metrics()[{name!r}] is {got}; "
                f"each named metric must be one value per row, shape ({rows},)"
            )


def example_labels(label_kind: str, rows: int, n_classes: int | None) -> torch.Tensor:
    if label_kind == CLASS_INDEX:
        return torch.zeros(rows, dtype=torch.int64)
    if label_kind == MULTI_HOT:
        return torch.zeros(rows, n_classes or 1)
    return torch.zeros(rows)
