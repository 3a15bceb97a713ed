"""The objectives' registry: which objective ``train.objective`` names, built-in (``builtin.py``,
``next_token.py``) or a user's, and what a run builds from it (the contract: ``base.py: Objective``).

``auto`` (the default): classification -> softmax (also for 2 classes, so today's models train to the
same weights), a list<string> label -> multilabel, regression -> mse.

A user objective ``package.module:factory`` is called as ``factory(n_classes, **train.objective_kwargs)``
(``n_classes`` None for regression) and returns an ``Objective`` (subclass ``base.py: Objective``): it must define
``per_row_loss``, may override ``n_outputs``, ``decode``, and name per-row metrics in
``metric_names``/``row_metrics`` (each reported as its mean over the split: ``val_<name>``,
``test_<name>``). The preflight calls it on a tiny batch and names the objective and the shape it
returned when that is not one loss per row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from training.core.config import ConfigError
from training.core.imports import import_factory
from training.objectives.base import CLASS_INDEX, MULTI_HOT, VALUE, Evaluation, Objective
from training.objectives.builtin import Binary, Huber, MeanSquaredError, Multilabel, Softmax
from training.objectives.next_token import NextToken, next_token_kwargs

BUILT_INS: dict[str, type[Objective]] = {
    "softmax": Softmax,
    "binary": Binary,
    "multilabel": Multilabel,
    "mse": MeanSquaredError,
    "huber": Huber,
    "next_token": NextToken,  # a language model: any task's data, the label unused
}
BUILT_IN = tuple(BUILT_INS)
TASKS = {"softmax": "classification", "binary": "classification", "mse": "regression", "huber": "regression"}
# Built-ins whose kwargs come from the dataset (next_token: the text input and its vocabulary size).
DATASET_KWARGS = {"next_token": next_token_kwargs}


def auto_objective(task: str, multi_hot_label: bool = False) -> str:
    """The objective ``auto`` means (the one rule): classification -> softmax, a list<string> label ->
    multilabel, regression -> mse."""
    if multi_hot_label:
        return "multilabel"
    return "softmax" if task == "classification" else "mse"


def resolved_name(name: str, task: str, multi_hot_label: bool = False) -> str:
    """The objective ``train.objective`` names: ``auto``'s choice (``auto_objective``), or the name as given."""
    return auto_objective(task, multi_hot_label) if name == "auto" else name


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
    resolved = resolved_name(name, task, multi_hot_label)
    if label_smoothing and resolved != "softmax":
        raise ConfigError(
            f"train.label_smoothing: {label_smoothing} applies to the softmax objective only; "
            f"train.objective is {resolved!r}"
        )
    if resolved in DATASET_KWARGS:  # fits any task's data: what it reads is in its kwargs
        return BUILT_INS[resolved](n_classes, **kwargs)
    if resolved not in BUILT_INS:
        return _user_objective(resolved, task, n_classes, kwargs, multi_hot_label)
    _check_fits(resolved, task, n_classes, multi_hot_label)
    try:
        if resolved == "softmax":
            return Softmax(n_classes, label_smoothing=label_smoothing, **kwargs)
        return BUILT_INS[resolved](n_classes, **kwargs)
    except TypeError as error:
        raise ConfigError(f"train.objective_kwargs: {resolved} does not take {kwargs}: {error}") from None


def objective_record(name: str, task: str, multi_hot_label: bool = False) -> type[Objective]:
    """The record of the objective ``name`` (``train.objective``) for a ``task`` dataset, without building it: its
    class, which answers how its models are evaluated and judged (``uses_label``, ``has_baselines``,
    ``evaluation``). A user's factory that is an ``Objective`` subclass is its own record; any other factory is
    read with the contract's defaults (evaluated as its task's objectives are)."""
    resolved = resolved_name(name, task, multi_hot_label)
    if resolved in BUILT_INS:
        return BUILT_INS[resolved]
    factory = resolve_user_objective(resolved)
    return factory if isinstance(factory, type) and issubclass(factory, Objective) else Objective


def evaluation_of(train, task: str, n_classes: int | None = None) -> Evaluation:
    """How a model trained by ``train`` (a TrainConfig) on a ``task`` dataset whose label has ``n_classes`` classes
    (``Manifest.n_classes``; None: not known) is evaluated and judged (``Evaluation.for_classes``)."""
    return objective_record(train.objective, task).evaluation(task).for_classes(n_classes)


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
            "training.objectives.registry.Objective (subclass it and define per_row_loss)"
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
    """Whether the manifest's label is a list<string> (multi-hot) label: a multilabel task, or a label prepare
    recorded as multi-hot."""
    return getattr(manifest, "task", None) == "multilabel" or manifest.extra.get("label_kind") == MULTI_HOT


def label_smoothing(train, manifest) -> float:
    """``train.label_smoothing`` (a TrainConfig's) as a number on ``manifest``'s data (``auto``:
    ``TrainConfig.smoothing`` of the objective it resolves to and the label's classes)."""
    n_classes = len(manifest.label_mapping) if manifest.label_mapping is not None else None
    return train.smoothing(resolved_name(train.objective, manifest.task, multi_hot_label(manifest)), n_classes)


def build_objective(train, manifest) -> Objective:
    """The training objective of ``train`` (a TrainConfig) on ``manifest``'s data: the rank and the preflight."""
    multi_hot = multi_hot_label(manifest)
    n_classes = len(manifest.label_mapping) if manifest.label_mapping is not None else None
    kwargs = train.objective_kwargs
    if train.objective in DATASET_KWARGS:
        kwargs = DATASET_KWARGS[train.objective](kwargs, manifest)
    smoothing = label_smoothing(train, manifest)
    objective = make_objective(train.objective, manifest.task, n_classes, kwargs, smoothing, multi_hot)
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
    """The objective a model.pt was trained with (its ``describe()``); a file without an ``objective``
    entry was trained with ``auto``'s choice for its task."""
    recorded = meta.get("objective") or {"name": "auto", "kwargs": {}}
    n_classes = len(meta["label_mapping"]) if meta.get("label_mapping") is not None else None
    multi_hot = meta.get("task") == "multilabel"
    return make_objective(recorded["name"], meta["task"], n_classes, recorded.get("kwargs"), 0.0, multi_hot)


def check_objective(objective: Objective, n_classes: int | None) -> None:
    """Call the objective on a tiny batch: ConfigError naming it and the shape when it is not one loss per row."""
    if objective.name in DATASET_KWARGS:
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
