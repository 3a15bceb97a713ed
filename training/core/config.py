"""The one configuration every stage shares: ``PipelineConfig``.

It is a pydantic v2 model so that the same object validates a YAML file, a
``--set`` override on the command line and a Prefect flow parameter (Prefect
renders it as a form). It imports neither Prefect nor torch, so ranks and the
CLI load it fast.

    cfg = load_config("configs/demo.yaml", ["train.epochs=3"])
    cfg.model_dump_json()

Bad values are rejected before anything runs, and the error names the field by
its dotted path (``train.epochs: Input should be greater than or equal to 1``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A user's configuration is wrong; the message names the field."""


@dataclass(frozen=True)
class WeightsEffect:
    """Declared on every train field: whether it changes the trained weights.

    The fields that do, with the data's fingerprint, are a training's identity
    (training/checkpoint/identity.py: ``training_identity``): a run resumes only a checkpoint of the
    same identity, and ``train.skip_if_unchanged`` compares it with the champion's. The
    others (timeouts, restarts, threads, paths, launcher, progress...) may change between
    attempts of one training.
    """

    changes_weights: bool
    # A field added after identities were first recorded (on runs, model versions, last.pt): left out of
    # the identity while it holds its default, so every identity recorded before it existed stays the same.
    omitted_at_default: bool = False
    # A field whose default changed since: the value the identity omits is the earlier default (the training
    # every record that omitted it did), not today's default.
    omitted_value: Any = None
    omits_earlier_default: bool = False


_T = TypeVar("_T")
ChangesWeights = Annotated[_T, WeightsEffect(True)]  # part of the training identity
# Part of the identity once set away from its default (a field added later: WeightsEffect.omitted_at_default).
ChangesWeightsWhenSet = Annotated[_T, WeightsEffect(True, omitted_at_default=True)]
KeepsWeights = Annotated[_T, WeightsEffect(False)]  # may change between attempts of one training


# The training defaults a run resolves once the data is prepared (training/resolve.py; docs/models.md says where
# each comes from): the epoch budget, early stopping's patience, the per-rank batch cap and the rows per step.
DEFAULT_EPOCHS = 100
DEFAULT_PATIENCE = 10
# train.lr auto: DEFAULT_LR, lower for the built-in mlp's small steps on a regression target
# (training/models/tabular.py: default_lr).
DEFAULT_LR = 1e-3
# Softmax's label smoothing when train.label_smoothing is auto: RealMLP's 0.1 for a label of more than two classes;
# none for two classes, whose ROC AUC it did not lift, nor for any other objective (docs/models.md: what was measured).
DEFAULT_LABEL_SMOOTHING = 0.1
AUTO_BATCH_MAX = 512
AUTO_BATCH_STEPS = 16  # train.batch_size auto: at least this many steps an epoch
DEFAULT_SHUFFLE_WINDOW = 8  # data.shuffle_window: shards whose rows the stream shuffles together

MODELS = ("auto", "mlp", "image_cnn", "transformer")  # train.model's built-in names (training/models/registry.py)

OBJECTIVES = (
    "auto",
    "softmax",
    "binary",
    "multilabel",
    "mse",
    "huber",
    "next_token",
)  # train.objective's built-in names


class _Section(BaseModel):
    # Unknown keys are typos in a user's YAML: reject them instead of ignoring.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# The built-in data.inputs kinds, in the order logs list them; each one's record: training/kinds/registry.py.
INPUT_KINDS = ("numeric", "categorical", "hashed", "vector", "datetime", "image", "text")


class InputSpec(_Section):
    """One entry of ``data.inputs``, long form: ``{kind: categorical, min_count: 5, max_size: 100000}``.

    The short form is the kind alone (``country: categorical``). Options belong to one kind each, and the kind's
    record says which it takes, checks them and fills the defaults (training/kinds/registry.py:
    ``input_options``, ``check_inputs``: run by the CLI as it loads a config and by the preflight): numeric ``missing``
    (impute, the default, or error) and ``scaling`` (robust, the default, or standard); categorical
    ``min_count`` (default 1) and ``max_size`` (default: no limit); hashed ``buckets`` (required), declared here.
    The image and text options are their kinds' own, kept here as given like a plugin kind's keys
    (docs/models.md) and checked by their records: ``training/kinds/image.py: ImageOptions`` (``size``,
    ``channels``, ``mean``, ``std``, ``augment``), ``training/kinds/text.py: TextOptions`` (``max_len``,
    ``tokenizer``).
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    kind: str = Field(min_length=1)  # a registered kind: INPUT_KINDS, or a plugin's (checked by check_inputs)
    missing: Literal["impute", "error"] | None = Field(
        None,
        description="numeric: impute (default: the train median, plus a learned missing indicator) or error "
        "(a null or NaN is invalid: data.on_invalid).",
    )
    scaling: Literal["robust", "standard"] | None = Field(
        None,
        description="numeric: robust (default: the train median and interquartile range, smoothly clipped) or "
        "standard (the train mean and std).",
    )
    min_count: int | None = Field(None, ge=1, description="categorical: values seen fewer times in train are unknown.")
    max_size: int | None = Field(None, ge=1, description="categorical: keep at most this many most frequent values.")
    buckets: int | None = Field(None, ge=1, description="hashed: the number of hash buckets (required).")

    def given_options(self) -> dict[str, Any]:
        """The options set (not None), declared ones in field order, then the keys kept as given (the image and text
        kinds', a plugin kind's)."""
        declared = {name: getattr(self, name) for name in type(self).model_fields if name != "kind"}
        given = {name: value for name, value in declared.items() if value is not None}
        return {**given, **(self.model_extra or {})}


class SplitSpec(_Section):
    """``data.split``: how rows go to train, val and test.

    ``{by: hash}`` (the default, also when ``data.split`` is unset): a stable hash of each row (``data.key``, else
    its content) against ``data.val_fraction`` and ``data.test_fraction``; a row keeps its split when rows are added.
    ``{by: time, column: <col>, val: ..., test: ...}``: the newest rows go to test and the ones before them to val,
    so a model is judged on the rows after those it learnt from; ``val`` and ``test`` are each a fraction of the
    rows (the newest ``test`` share of the rows by ``column``, the ``val`` share before them; unset:
    ``data.val_fraction``, ``data.test_fraction``) or a cut-off date or time (ISO 8601: the rows at or after it;
    in the column's own time zone unless it names one). training/prepare/time_split.py; docs/data.md.
    """

    by: Literal["hash", "time"] = "hash"
    column: str | None = Field(None, description="time: the column of each row's time (a timestamp, date or ISO text).")
    val: float | str | None = Field(None, description="time: a fraction of the rows, or a cut-off date or time.")
    test: float | str | None = Field(None, description="time: a fraction of the rows, or a cut-off date or time.")

    @field_validator("val", "test", mode="before")
    @classmethod
    def _dates_as_text(cls, value: Any) -> Any:
        """A YAML date (``val: 2024-06-01``) or time as its ISO text; a number stays a fraction."""
        return value.isoformat() if isinstance(value, (dt.date, dt.datetime)) else value

    @field_validator("val", "test")
    @classmethod
    def _fraction_or_date(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not 0.0 <= value < 1.0:
            raise ValueError(f"a fraction of the rows is at least 0 and below 1, not {value}")
        if isinstance(value, str):
            try:
                dt.datetime.fromisoformat(value.strip())
            except ValueError:
                raise ValueError(
                    f"{value!r} is neither a fraction of the rows nor an ISO-8601 date or time (2024-06-01, "
                    "2024-06-01T00:00:00+02:00)"
                ) from None
        return value

    @model_validator(mode="after")
    def _one_rule(self) -> SplitSpec:
        if self.by == "hash" and (self.column, self.val, self.test) != (None, None, None):
            raise ValueError(
                "by: hash takes no column, val or test (its fractions are data.val_fraction and data.test_fraction)"
            )
        if self.by == "time" and not self.column:
            raise ValueError("by: time needs column: the column that holds each row's time")
        fractions = [value for value in (self.val, self.test) if isinstance(value, float)]
        if len(fractions) == 2 and sum(fractions) >= 1.0:
            raise ValueError(
                f"val ({self.val}) + test ({self.test}) must sum to less than 1, so that train is not empty"
            )
        return self


class DataConfig(_Section):
    source: str = Field(
        "synthetic://classification?rows=20000&features=16&classes=4&seed=0",
        description="Parquet/CSV file, directory, glob, fsspec URL (s3://...) or synthetic://classification|regression?rows=N&features=F&classes=C&seed=S",
    )
    format: Literal["auto", "parquet", "csv", "images"] = Field(
        "auto",
        description="Source file format; auto uses the file extension (a folder of <class>/<image> files: images).",
    )
    label: str = Field("label", description="Name of the label column.")
    features: list[str] | None = Field(
        None, description="Feature columns; default: every numeric column except label and key."
    )
    inputs: ChangesWeights[dict[str, InputSpec] | None] = Field(
        None,
        description="The model's inputs, name -> kind (numeric | categorical | hashed | vector | datetime | image | "
        "text) or "
        "{kind: ..., options}; default: every numeric column except label, key and weight (data.features).",
    )
    weight: ChangesWeights[str | None] = Field(
        None, description="Optional column of per-row weights (finite, >= 0, not all 0)."
    )
    key: str | None = Field(None, description="Optional stable row id; the split hashes it (else the row's content).")
    task: Literal["classification", "regression", "multilabel"] | None = Field(
        None,
        description="Inferred from the label when not given; multilabel: a list<string> (or list<int>) label, "
        "any number of classes per row.",
    )
    on_invalid: Literal["error", "drop"] = Field("error", description="What to do with rows holding NaN, inf or null.")
    root: str = Field("data/shards", description="Where prepared shards live: <root>/<fingerprint>/{train,val,test}/.")
    cache_dir: str | None = Field(
        None,
        description="The node cache (each split loaded once per node, normalised, memory-mapped by every local rank): "
        "<cache_dir>/<fingerprint>/; default <root>/<fingerprint>/cache/. Set a node-local path (local scratch) "
        "on multi-node runs, so each node builds its own from the shared shards.",
    )
    # The stream (training/loading/stream.py, docs/data.md "Streaming from object storage"): its order is not the
    # node cache's, so it changes the weights, and so does its window; the cache's size changes only what is kept
    # on disk. None of the three is part of the fingerprint (the shards are the same) nor, while data.stream is
    # false, of the training identity (DataConfig.order_identity).
    stream: ChangesWeightsWhenSet[bool | Literal["auto"]] = Field(
        False,
        description="Ranks read the train and val shards from data.root (a path or an fsspec URL) through a bounded "
        "local cache instead of the node cache: for splits larger than a node's disk. auto: on when the node cache "
        "would take more than half of its disk's free space (decided once, as the run starts, and recorded).",
    )
    stream_cache_limit: KeepsWeights[int] = Field(
        4 * 2**30,
        ge=1,
        description="The stream's local cache, in bytes: the most its shard files on a node's disk may take "
        "(<data.cache_dir>/<fingerprint>/stream/); at least two windows of the largest shards.",
    )
    shuffle_window: ChangesWeightsWhenSet[int] = Field(
        DEFAULT_SHUFFLE_WINDOW,
        ge=1,
        description="The stream's shuffle: each epoch the shards are shuffled and cut into windows of this many, "
        "and rows are shuffled within a window. Larger mixes more and needs a larger data.stream_cache_limit.",
    )
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    split: ChangesWeights[SplitSpec | None] = Field(
        None,
        description="How rows go to train/val/test: unset or {by: hash} (a stable hash of each row, "
        "data.val_fraction/test_fraction), or {by: time, column: <col>, val: <fraction or date>, test: <fraction "
        "or date>} (the newest rows to test, those before them to val).",
    )
    rows_per_shard: int = Field(262_144, ge=1)
    row_group_size: int = Field(65_536, ge=1)
    read_batch_rows: int = Field(131_072, ge=1, description="Rows per record batch while streaming the source.")

    @model_validator(mode="after")
    def _fractions_leave_room_for_train(self) -> DataConfig:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"val_fraction ({self.val_fraction}) + test_fraction ({self.test_fraction}) must sum to less than 1, "
                "so that the train split is not empty"
            )
        if self.features is not None and len(self.features) == 0:
            raise ValueError("features, when given, must list at least one column")
        if self.features is not None and self.inputs is not None:
            raise ValueError("set data.inputs or data.features, not both (features means numeric inputs)")
        if self.inputs is not None and len(self.inputs) == 0:
            raise ValueError("inputs, when given, must list at least one column")
        reserved = {"label": self.label, "key": self.key, "weight": self.weight}
        for name in self.inputs or {}:
            role = next((role for role, column in reserved.items() if column == name), None)
            if role is not None:
                raise ValueError(f"inputs.{name}: {name!r} is the {role} column and cannot also be an input")
        return self

    @field_validator("inputs", mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        """``name: kind`` is ``name: {kind: kind}``."""
        if isinstance(value, dict):
            return {name: {"kind": spec} if isinstance(spec, str) else spec for name, spec in value.items()}
        return value

    @staticmethod
    def order_identity(data: Mapping[str, Any] | None) -> dict[str, Any]:
        """The data settings that change the weights beyond the fingerprint, from a data section's JSON form:
        the stream's order (``stream`` and its ``shuffle_window``) while ``stream`` is on; {} otherwise, so an
        identity recorded before the stream existed, or of a run on the node cache, stays what it was."""
        data = data or {}
        stream = data.get("stream", False)
        if stream is False:
            return {}
        return {"stream": stream, "shuffle_window": data.get("shuffle_window", DEFAULT_SHUFFLE_WINDOW)}

    def input_specs(self) -> dict[str, InputSpec] | None:
        """``data.inputs``, or ``data.features`` as numeric inputs, or None (the default columns)."""
        if self.inputs is not None:
            return dict(self.inputs)
        if self.features is not None:
            return {name: InputSpec(kind="numeric") for name in self.features}
        return None


class TrainConfig(_Section):
    epochs: ChangesWeights[int] = Field(
        DEFAULT_EPOCHS,
        ge=1,
        description="The most epochs trained; early stopping (train.early_stopping_patience, on by default) ends "
        "most runs sooner, with the best epoch's weights (train.select).",
    )
    batch_size: ChangesWeights[Annotated[int, Field(ge=1)] | Literal["auto"] | None] = Field(
        "auto",
        description="Per rank; auto (the default): min(512, the largest power of two <= the train rows per rank / "
        "16), so a small table gets at least 16 steps an epoch and is never refused; the run records the number. "
        "none (and left unset) when train.global_batch_size is set.",
    )
    global_batch_size: ChangesWeightsWhenSet[int | None] = Field(
        None,
        ge=1,
        description="Rows of one step over all ranks, instead of train.batch_size: each rank takes it / world size. "
        "With it a run checkpointed on W ranks can resume on another number of ranks (docs/training.md).",
    )
    lr: ChangesWeights[Annotated[float, Field(gt=0)] | Literal["auto"]] = Field(
        "auto",
        description=f"The optimizer's learning rate. auto (the default): {DEFAULT_LR}; for the built-in mlp on a "
        f"regression target, {DEFAULT_LR} x sqrt(rows per optimizer step / 256) below 256 rows a step; the run "
        "records the number.",
    )
    weight_decay: ChangesWeights[float] = Field(0.01, ge=0)
    lr_schedule: ChangesWeights[Literal["constant", "cosine"]] = "constant"
    grad_clip: ChangesWeights[float | None] = Field(
        None, gt=0, description="Max global grad norm; none disables clipping."
    )
    grad_accum: ChangesWeights[int] = Field(
        1, ge=1, description="Micro-batches per optimizer step (no_sync accumulation); changes the effective batch."
    )
    seed: ChangesWeights[int] = 0
    model: ChangesWeights[str] = Field(
        "auto",
        description="'auto' (the default: the built-in model for the inputs, mlp for tables, image_cnn with an "
        "image input, transformer with text; a run records, and its identity holds, the model auto picked), 'mlp' "
        "(embeddings for categorical and hashed inputs), 'image_cnn' (image inputs), 'transformer' (text inputs) "
        "or a user factory 'package.module:factory' called as "
        "factory(inputs, n_outputs, **model_kwargs) (docs/models.md; the older factory(n_features, n_outputs) "
        "takes numeric inputs).",
    )
    model_kwargs: ChangesWeights[dict[str, Any]] = Field(default_factory=dict)
    objective: ChangesWeightsWhenSet[str] = Field(
        "auto",
        description="The loss: auto (classification -> softmax, a list<string> label -> multilabel, regression -> "
        "mse), softmax, binary, multilabel, mse, huber, or a user objective 'package.module:factory' "
        "(docs/models.md, Objectives).",
    )
    objective_kwargs: ChangesWeightsWhenSet[dict[str, Any]] = Field(
        default_factory=dict, description="Passed to the objective: huber's delta; a user factory's keywords."
    )
    class_weights: ChangesWeightsWhenSet[Literal["none", "balanced"] | dict[str, float]] = Field(
        "none",
        description="Per-class loss weights (softmax, binary): none; balanced (n / (classes * count), from the "
        "train split's class counts); or {label: weight}, 1 for classes not named. They weigh each row's loss "
        "and the step's denominator alike, so the update stays exact.",
    )
    # Omitted from the identity at 0 (its default before auto), so the records of runs without it keep theirs.
    label_smoothing: Annotated[
        Annotated[float, Field(ge=0.0, lt=1.0)] | Literal["auto"],
        WeightsEffect(True, omitted_at_default=True, omitted_value=0.0, omits_earlier_default=True),
    ] = Field(
        "auto",
        description="Cross-entropy label smoothing (softmax only). auto (the default): "
        f"{DEFAULT_LABEL_SMOOTHING} for the softmax objective over more than two classes, 0 otherwise; the run "
        "records the number.",
    )
    nproc_per_node: ChangesWeights[int | Literal["auto"]] = Field(
        "auto", description="Ranks per node; auto: one per GPU, or 1 on CPU (see docs)."
    )
    launcher: KeepsWeights[Literal["local", "slurm"]] = Field(
        "local",
        description="local: torchrun on this machine (several nodes: the same flow on each, node_rank apart); "
        "slurm: one batch job of nnodes nodes through sbatch (see the slurm section and docs/slurm.md).",
    )
    nnodes: ChangesWeights[int] = Field(1, ge=1, description="Nodes; with launcher slurm, the job's node count.")
    node_rank: KeepsWeights[int] = Field(0, ge=0)
    rdzv_endpoint: KeepsWeights[str | None] = Field(
        None, description="host:port of the c10d rendezvous, required when nnodes > 1 (launcher local)."
    )
    rdzv_id: KeepsWeights[str | None] = None
    backend: KeepsWeights[Literal["auto", "nccl", "gloo"]] = "auto"
    max_restarts: KeepsWeights[int] = Field(
        1, ge=0, description="torchrun restarts of the worker group; each resumes from last.pt."
    )
    timeout_s: KeepsWeights[float] = Field(
        3600.0, gt=0, description="Wall-clock limit for the whole torchrun launch, enforced by the task."
    )
    collective_timeout_s: KeepsWeights[float] = Field(
        300.0, gt=0, description="Process-group timeout: a stalled collective fails after this."
    )
    checkpoint_timeout_s: KeepsWeights[float] = Field(
        1800.0,
        gt=0,
        description="How long the other ranks wait for rank 0 to write a checkpoint (apart from collective_timeout_s).",
    )
    stall_timeout_s: KeepsWeights[float | None] = Field(
        None,
        gt=0,
        description="Kill the run when torchrun and its ranks print no line for this long (every rank hung); "
        "unset: no such watchdog.",
    )
    preempt_signal: KeepsWeights[str | None] = Field(
        "SIGUSR1",
        description="Besides SIGTERM and SIGINT, the signal that preempts a run (Slurm's --signal=B:USR1@120): "
        "every rank saves a step checkpoint at the next optimizer step and stops, resumable (docs/reliability.md).",
    )
    preempt_grace_s: KeepsWeights[float] = Field(
        30.0, gt=0, description="How long a preempted run's ranks get to save and exit before the tree is killed."
    )
    run_root: KeepsWeights[str] = Field("runs", description="Every run gets its own directory under here.")
    init_from: KeepsWeights[str | None] = Field(
        None, description="Warm start: 'champion' (the registry alias) or a model.pt path."
    )
    num_threads: KeepsWeights[int | None] = Field(
        None, ge=1, description="Torch threads per rank; default cores // local ranks."
    )
    cpu_affinity: KeepsWeights[bool] = Field(True, description="Pin each CPU rank to its own cores.")
    cpu_poll_allreduce: KeepsWeights[bool | Literal["auto"]] = Field(
        False,
        description="Opt-in: CPU ranks poll for the gradient all-reduce, yielding their core, instead of sleeping "
        "in it. It costs a core spun for up to 0.1 s every step, taken from a hyperthread sibling or from "
        "data-loading workers; it helps only where an idle vCPU wakes late (often a scheduler tick, on some VMs). "
        "true: every CPU rank; auto: only ranks pinned to cores of their own (train.cpu_affinity). Never on GPUs; "
        "the arithmetic is DDP's own either way.",
    )
    sync_batchnorm: ChangesWeightsWhenSet[bool] = Field(
        False,
        description="Convert a user model's BatchNorm layers to SyncBatchNorm (statistics over the global batch; "
        "GPUs only). The built-in image model uses GroupNorm and needs none.",
    )
    bf16: ChangesWeights[bool] = Field(True, description="bf16 autocast on CUDA.")
    tf32: ChangesWeights[bool] = Field(True, description="Allow TF32 matmuls on CUDA.")
    pin_memory: KeepsWeights[bool] = True
    # Not eval.batch_size: that one streams the test split in a process of its own; this one runs beside the
    # training state, and an activation per row of 65,536 images would not fit (nor, for a wide MLP, stay small).
    val_batch_size: KeepsWeights[int | None] = Field(
        None,
        ge=1,
        description="Rows per forward pass of the validation every epoch (per rank); default: the per-rank train "
        "batch, which fits where training does. The val metrics are float64 sums: the batching moves them by "
        "rounding only.",
    )
    num_workers: KeepsWeights[Annotated[int, Field(ge=0)] | Literal["auto"]] = Field(
        "auto",
        description="DataLoader worker processes per rank, kept for the run: where ragged inputs (images) are "
        "decoded and augmented. 0: in the rank itself, all tabular and text data needs. auto: 0 without an image "
        "input; with one, from the rank's cores (training/distributed/process.py: decode_workers; docs/training.md).",
    )
    data_on_device: KeepsWeights[bool | Literal["auto"]] = Field(
        "auto",
        description="Copy the train and val splits to the GPU once and gather batches there; "
        "auto: when a split takes at most a quarter of the GPU memory free after the model (never on CPU).",
    )
    progress_interval_s: KeepsWeights[float] = Field(5.0, gt=0)
    # Which epoch's weights model.pt holds, and when training stops (training/loop/selection.py).
    select: ChangesWeightsWhenSet[Literal["best", "last"]] = Field(
        "best", description="model.pt holds the weights of the best epoch by train.monitor, or of the last one."
    )
    monitor: ChangesWeightsWhenSet[str] = Field(
        "val_loss", description="The validation metric that judges epochs (val_loss, val_accuracy, val_rmse...)."
    )
    monitor_mode: ChangesWeightsWhenSet[Literal["auto", "min", "max"]] = Field(
        "auto", description="auto: lower is better for a loss or an error (as the gate infers), else higher."
    )
    min_delta: ChangesWeightsWhenSet[float] = Field(0.0, ge=0, description="An epoch improves by more than this.")
    # Omitted from the identity at none (never stop, its default before auto), so records from then keep theirs.
    early_stopping_patience: Annotated[
        Annotated[int, Field(ge=1)] | Literal["auto"] | None,
        WeightsEffect(True, omitted_at_default=True, omitted_value=None, omits_earlier_default=True),
    ] = Field(
        "auto",
        description="Stop after this many epochs without improvement of train.monitor; none: never. auto (the "
        f"default): {DEFAULT_PATIENCE} where there is a val split, none without one; the run records the number.",
    )
    # The optimizer and its schedule (training/loop/optim.py).
    optimizer: ChangesWeightsWhenSet[Literal["adamw", "adam", "sgd"]] = "adamw"
    optimizer_kwargs: ChangesWeightsWhenSet[dict[str, Any]] = Field(
        default_factory=dict, description="Passed to the torch optimizer: betas, eps, momentum, nesterov..."
    )
    warmup_steps: ChangesWeightsWhenSet[int] = Field(
        0, ge=0, description="Optimizer steps of linear warmup before the constant or cosine schedule."
    )
    log_every_steps: KeepsWeights[int | None] = Field(
        50, ge=1, description="Train loss, lr and gradient norm to MLflow every N optimizer steps; none: off."
    )
    # Step checkpoints (training/checkpoint/files.py): a resumable state within an epoch.
    checkpoint_every_steps: KeepsWeights[int | None] = Field(
        None, ge=1, description="Write a step checkpoint every N optimizer steps; none: only at the end of epochs."
    )
    checkpoint_every_s: KeepsWeights[float | None] = Field(
        None, gt=0, description="Write a step checkpoint when this many seconds passed since the last one."
    )
    keep_checkpoints: KeepsWeights[int] = Field(
        2, ge=1, description="Step checkpoints kept (the newest); older ones are deleted once a newer is complete."
    )
    skip_if_unchanged: KeepsWeights[bool] = Field(
        False,
        description="Skip training (no torchrun, no new model version; the MLflow run is tagged ddpflow.skipped) "
        "when @champion was trained on the same dataset fingerprint with the same weight-changing settings.",
    )
    # A user's own training script (docs/scripts.md): torchrun runs it on every rank instead of ddpflow's trainer.
    script: KeepsWeights[str | None] = Field(
        None,
        description="A Python file of your own DDP training, run as it is on every rank by the same launcher "
        "(train.launcher); relative to the directory the run starts in. ddpflow's own training settings (epochs, "
        "lr, model, batch_size...) do not apply to it; the data section is optional (docs/scripts.md).",
    )
    script_args: ChangesWeightsWhenSet[list[str]] = Field(
        default_factory=list, description="train.script's command-line arguments, as given."
    )
    script_params: ChangesWeightsWhenSet[dict[str, Any]] = Field(
        default_factory=dict,
        description="Passed to train.script after script_args as --key value arguments, and readable in the "
        "script with ddpflow.params(); a sweep may search them (sweep.space: train.script_params.KEY).",
    )
    script_sha256: ChangesWeightsWhenSet[str | None] = Field(
        None,
        description="Filled in by ddpflow as the run starts: the sha256 of train.script's file, so an edited "
        "script is another training (resume, train.skip_if_unchanged). A value given is replaced.",
    )

    @classmethod
    def weight_fields(cls) -> tuple[str, ...]:
        """The fields declared ``ChangesWeights``, in order; TypeError naming any field declared neither way."""
        effects = {name: _weights_effect(info.metadata) for name, info in cls.model_fields.items()}
        undeclared = [name for name, effect in effects.items() if effect is None]
        if undeclared:
            raise TypeError(f"train fields {undeclared} declare neither ChangesWeights[...] nor KeepsWeights[...]")
        return tuple(name for name, effect in effects.items() if effect.changes_weights)

    @classmethod
    def identity_defaults(cls) -> dict[str, Any]:
        """The weight fields left out of the identity at their default (``ChangesWeightsWhenSet``): name -> default
        (the earlier default where it changed since: ``WeightsEffect.omitted_value``)."""
        return {
            name: effect.omitted_value if effect.omits_earlier_default else info.get_default(call_default_factory=True)
            for name, info in cls.model_fields.items()
            if (effect := _weights_effect(info.metadata)) is not None and effect.omitted_at_default
        }

    @classmethod
    def world_fields(cls) -> tuple[str, ...]:
        """The weight fields that ``global_batch_size``, once set, stands for: the per-rank batch and the world."""
        return ("batch_size", "nproc_per_node", "nnodes")

    def rank_batch_size(self, world_size: int, train_rows: int | None = None) -> int:
        """This run's per-rank batch: ``batch_size`` (``auto``: ``auto_batch_size`` of ``train_rows``), or
        ``global_batch_size`` / ``world_size`` (it must divide)."""
        if self.batch_size == "auto":
            if train_rows is None:
                raise ValueError("train.batch_size auto needs the train split's row count")
            return auto_batch_size(train_rows, world_size)
        if self.global_batch_size is None:
            return int(self.batch_size)
        per_rank, left = divmod(self.global_batch_size, world_size)
        if left or per_rank == 0:
            raise ConfigError(
                f"train.global_batch_size {self.global_batch_size} does not divide over {world_size} ranks "
                f"({self.global_batch_size} / {world_size} = {self.global_batch_size / world_size:g}); choose a "
                "multiple of the world size"
            )
        return per_rank

    def rank_val_batch_size(self, world_size: int, train_rows: int | None = None) -> int:
        """Rows per forward pass of a rank's validation: ``val_batch_size``, or the per-rank train batch."""
        return self.val_batch_size or self.rank_batch_size(world_size, train_rows)

    def learning_rate(self) -> float:
        """The optimizer's learning rate: ``lr``, or (``auto`` left unresolved: a launcher called directly, as some
        tests do) DEFAULT_LR. A run resolves ``auto`` before it trains (training/resolve.py)."""
        return DEFAULT_LR if self.lr == "auto" else float(self.lr)

    def rows_per_step(self, world_size: int, train_rows: int | None = None) -> int:
        """Rows of one optimizer step over every rank: the per-rank batch x the world x ``grad_accum``."""
        return self.rank_batch_size(world_size, train_rows) * world_size * self.grad_accum

    def smoothing(self, objective: str, n_classes: int | None) -> float:
        """The label smoothing of ``objective`` (resolved: ``softmax``, ``mse``...) on ``n_classes`` classes:
        ``label_smoothing``, or (``auto``) DEFAULT_LABEL_SMOOTHING for a softmax over more than two, else 0."""
        if self.label_smoothing == "auto":
            return DEFAULT_LABEL_SMOOTHING if objective == "softmax" and (n_classes or 0) > 2 else 0.0
        return self.label_smoothing

    def patience(self, val_rows: int) -> int | None:
        """Early stopping's patience: ``early_stopping_patience``, or (``auto``) DEFAULT_PATIENCE when there is
        a val split to judge epochs by, else None."""
        if self.early_stopping_patience == "auto":
            return DEFAULT_PATIENCE if val_rows > 0 else None
        return self.early_stopping_patience

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainConfig:
        if self.global_batch_size is None:
            if self.batch_size is None:
                raise ValueError("set train.batch_size (per rank) or train.global_batch_size")
            return self
        if "batch_size" in self.model_fields_set and self.batch_size not in (None, "auto"):
            raise ValueError(
                f"set train.batch_size ({self.batch_size}, per rank) or train.global_batch_size "
                f"({self.global_batch_size}, all ranks), not both"
            )
        self.__dict__["batch_size"] = None  # derived per world size (rank_batch_size); no validation loop
        return self

    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> TrainConfig:
        if self.launcher == "slurm":
            # The job's first node hosts the rendezvous, and Slurm numbers the nodes.
            if self.rdzv_endpoint or self.node_rank:
                raise ValueError(
                    "rdzv_endpoint and node_rank are not used with launcher 'slurm': "
                    "the job's first node hosts the rendezvous; remove them"
                )
            return self
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("rdzv_endpoint (host:port) is required when nnodes > 1")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        return self

    @field_validator("nproc_per_node")
    @classmethod
    def _positive_nproc(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value

    @field_validator("preempt_signal", mode="before")
    @classmethod
    def _a_signal_name(cls, value: str | int | None) -> str | None:
        """ "USR1", "SIGUSR1" or "10" -> "SIGUSR1"; SIGKILL and SIGSTOP cannot be caught."""
        if value is None:
            return None
        text = str(value).strip().upper()
        try:
            name = text if text.startswith("SIG") else f"SIG{text}"
            sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise ValueError(f"{value!r} is not a signal name such as SIGUSR1") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught, so it cannot preempt a run")
        return sig.name

    @field_validator("objective")
    @classmethod
    def _objective_name_or_import_path(cls, value: str) -> str:
        if value not in OBJECTIVES and (":" not in value or not all(value.split(":", 1))):
            raise ValueError(
                f"{value!r} is neither one of {list(OBJECTIVES)} nor an import path 'package.module:factory'"
            )
        return value

    @field_validator("class_weights", mode="before")
    @classmethod
    def _class_weights_by_label(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        # YAML reads a label 1 as a number: a class is named by its label's text (str of the label value).
        weights = {str(label): weight for label, weight in value.items()}
        bad = {
            label: weight for label, weight in weights.items() if not (isinstance(weight, (int, float)) and weight > 0)
        }
        if bad:
            raise ValueError(f"class weights must be positive numbers; got {bad}")
        return weights

    @field_validator("monitor")
    @classmethod
    def _validation_metric(cls, value: str) -> str:
        if not value.startswith("val_"):
            raise ValueError(f"{value!r} is not a validation metric: name one such as val_loss or val_accuracy")
        return value

    @field_validator("optimizer_kwargs")
    @classmethod
    def _kwargs_without_own_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted({"lr", "weight_decay", "params"} & set(value))
        if owned:
            raise ValueError(f"{owned} have their own train fields (train.lr, train.weight_decay); remove them here")
        return value

    def monitor_higher_is_better(self) -> bool:
        """train.monitor_mode, or the gate's rule on the metric's name (training/core/directions.py)."""
        from training.core.directions import higher_is_better  # the one rule; torch-free

        return higher_is_better(self.monitor) if self.monitor_mode == "auto" else self.monitor_mode == "max"

    @field_validator("model")
    @classmethod
    def _model_name_or_import_path(cls, value: str) -> str:
        if value not in MODELS and (":" not in value or not all(value.split(":", 1))):
            raise ValueError(f"{value!r} is neither one of {list(MODELS)} nor an import path 'package.module:factory'")
        return value


def auto_batch_size(train_rows: int, world_size: int) -> int:
    """``train.batch_size: auto``: the largest power of two at most the train rows per rank / AUTO_BATCH_STEPS,
    between 1 and AUTO_BATCH_MAX. A small table gets at least AUTO_BATCH_STEPS steps an epoch, and a batch every
    rank can fill (the preflight's rule); a table of 16,384 rows or more per rank gets AUTO_BATCH_MAX."""
    per_rank = max(1, train_rows // (world_size * AUTO_BATCH_STEPS))
    return min(AUTO_BATCH_MAX, 1 << (per_rank.bit_length() - 1))


def _weights_effect(metadata: list[Any]) -> WeightsEffect | None:
    effects = [item for item in metadata if isinstance(item, WeightsEffect)]
    return effects[-1] if effects else None


class EvalConfig(_Section):
    batch_size: int = Field(65_536, ge=1, description="Rows per inference batch while streaming the test split.")
    reference: bool = Field(
        True,
        description="Fit scikit-learn's HistGradientBoosting on the train split and score it on the test rows "
        "beside the model (baseline_reference/*; tables only: numeric, categorical and hashed inputs). The "
        "trivial baseline (train prior or mean, baseline_trivial/*) is always scored.",
    )
    reference_max_rows: int = Field(
        200_000, ge=100, description="The reference fits a uniform sample of this many train rows above it."
    )


class RegistryConfig(_Section):
    model_name: str = Field("ddpflow-model", min_length=1)
    metric: str | None = Field(
        None,
        description="Gate metric; default the objective's: test_roc_auc (a label of two classes), test_accuracy "
        "(more classes), test_micro_f1 (multilabel), test_rmse (regression), test_loss (train.objective next_token, "
        "lower is better).",
    )
    greater_is_better: bool | None = Field(None, description="Default: inferred from the metric name.")
    min_delta: float = Field(0.0, ge=0, description="The candidate must beat the champion by more than this.")
    min_metric: float | None = Field(None, description="Floor a model must reach to be registered at all.")
    min_lift: float = Field(
        0.0,
        ge=0,
        description="The candidate must beat the trivial baseline (train prior or mean, scored on the same test "
        "rows) on the gate metric by more than this, or it is rejected, also as the first model.",
    )
    require_reference: bool = Field(
        False,
        description="Reject a candidate that trails the reference model (baseline_reference) on the gate metric "
        "by more than registry.reference_margin; default: a warning in the log and the summary.",
    )
    reference_margin: float = Field(
        0.02, ge=0, description="How far the candidate may trail the reference model before it is flagged."
    )
    replace_unreadable_champion: bool = Field(
        False,
        description="Opt-in: promote the candidate over a champion whose files are missing or unreadable "
        "(default: the candidate waits as challenger and the run fails).",
    )
    max_drift_psi: float | None = Field(
        None,
        gt=0,
        description="Hold the candidate as @challenger, whatever its metric, when a feature of its train split "
        "drifted from the champion's training data by a population stability index above this (e.g. 0.25); "
        "none: drift is only reported.",
    )

    def gate_metric(self, default: str) -> str:
        """``registry.metric``, else ``default``: the objective's (training/objectives/base.py: ``Evaluation``)."""
        return self.metric or default

    def higher_is_better(self, default: str) -> bool:
        """``registry.greater_is_better``, else the gate metric's direction (``default``: as ``gate_metric``)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        from training.core.directions import higher_is_better  # the one rule; torch-free

        return higher_is_better(self.gate_metric(default))


class MlflowConfig(_Section):
    tracking_uri: str | None = Field(
        None,
        description="The MLflow store. $MLFLOW_TRACKING_URI, when set, wins over it (ddpflow run and ddpflow score "
        "say so when the two differ); neither set: sqlite:///<working directory>/mlflow.db.",
    )
    experiment: str = Field("ddpflow", min_length=1)
    artifact_location: str | None = Field(
        None, description="Artifact root for a new experiment; default ./mlartifacts."
    )


# sbatch's [days-]hours:minutes:seconds forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; or no limit.
_SLURM_TIME = re.compile(r"^(?:\d+(?::\d{1,2}){0,2}|\d+-\d{1,2}(?::\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
# Options ddpflow sets itself (the job's shape, its output, how it is submitted), or that have their own field.
SBATCH_OWNED_OPTIONS = {
    "--nodes": "train.nnodes", "-N": "train.nnodes",
    "--ntasks": "ddpflow (one torchrun agent per node)", "-n": "ddpflow (one torchrun agent per node)",
    "--ntasks-per-node": "ddpflow (one torchrun agent per node)",
    "--output": "ddpflow (RUN_DIR/slurm/)", "-o": "ddpflow (RUN_DIR/slurm/)",
    "--error": "ddpflow (RUN_DIR/slurm/)", "-e": "ddpflow (RUN_DIR/slurm/)",
    "--job-name": "ddpflow", "-J": "ddpflow", "--chdir": "ddpflow", "-D": "ddpflow",
    "--parsable": "ddpflow", "--wait": "ddpflow (it follows the job itself)", "-W": "ddpflow",
    "--array": "ddpflow (one job per run)", "-a": "ddpflow (one job per run)", "--wrap": "ddpflow",
    "--partition": "slurm.partition", "-p": "slurm.partition",
    "--account": "slurm.account", "-A": "slurm.account",
    "--time": "slurm.time_limit", "-t": "slurm.time_limit",
    "--signal": "slurm.signal_before_s", "--requeue": "slurm.requeue", "--no-requeue": "slurm.requeue",
    "--open-mode": "ddpflow (a requeued job appends to its output)",
    "--gpus-per-node": "slurm.gpus_per_node",
    "--cpus-per-task": "slurm.cpus_per_task", "-c": "slurm.cpus_per_task",
}  # fmt: skip
# sbatch (getopt_long) also takes an unambiguous abbreviation (--part=x): these real options merely look like one.
_SBATCH_OPTIONS_NOT_ABBREVIATIONS = {"--gpus"}


def _owned_sbatch_option(arg: str) -> str | None:
    """The ddpflow-owned option ``arg`` sets (as written or abbreviated), or None."""
    if not arg.startswith("--"):
        return arg[:2] if arg[:2] in SBATCH_OWNED_OPTIONS else None
    name = arg.split("=", 1)[0]
    if name in SBATCH_OWNED_OPTIONS:
        return name
    if name in _SBATCH_OPTIONS_NOT_ABBREVIATIONS or len(name) < 4:
        return None
    return next((owned for owned in SBATCH_OWNED_OPTIONS if owned.startswith(name)), None)


class SlurmConfig(_Section):
    """Used when ``train.launcher`` is ``slurm``: how the batch job is asked for (see docs/slurm.md)."""

    partition: str | None = Field(None, min_length=1, description="Default: the cluster's default partition.")
    account: str | None = Field(None, min_length=1, description="sbatch --account; default: yours.")
    time_limit: str | None = Field(
        None,
        description="sbatch --time, a quoted string: 'MM', 'HH:MM:SS', 'D-HH:MM:SS' or 'UNLIMITED'; "
        "default: the partition's.",
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (sbatch --gpus-per-node); auto ranks: one each.")
    cpus_per_task: int | None = Field(
        None, ge=1, description="CPUs of each node's one task, which runs all of that node's ranks."
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="Extra sbatch options, one per item with its value ('--mem=8G', '--constraint=a100'); "
        "passed as arguments, never through a shell.",
    )
    poll_interval_s: float = Field(2.0, gt=0, le=600, description="How often `scontrol show job` is asked.")
    signal_before_s: int | None = Field(
        120,
        ge=1,
        le=65535,
        description="sbatch --signal=B:<train.preempt_signal>@N: Slurm signals the job this many seconds before its "
        "time limit; the ranks save a step checkpoint and the job requeues itself (docs/reliability.md). "
        "null: no signal asked for.",
    )
    requeue: bool = Field(
        True,
        description="sbatch --requeue: a preempted job (the signal above, `scontrol requeue`, a preemption) goes back "
        "to the queue and resumes from its checkpoint; false: --no-requeue.",
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _slurm_time(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str):
            # YAML reads an unquoted 1:30:00 as the number 5400: only a string says what was meant.
            raise ValueError("must be a quoted string such as '01:30:00' (YAML reads an unquoted 1:30:00 as a number)")
        if not _SLURM_TIME.match(value) or not re.search(r"[1-9]|UNLIMITED|INFINITE", value):
            raise ValueError(
                f"{value!r} is not a Slurm time limit: use 'MM', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', "
                "'D-HH:MM:SS' (above zero) or 'UNLIMITED'"
            )
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _extra_options_only(cls, args: list[str]) -> list[str]:
        for index, arg in enumerate(args):
            if not arg.startswith("-"):
                raise ValueError(
                    f"item {index} ({arg!r}) is not an option: give each option with its value in one item, "
                    "e.g. '--mem=8G'"
                )
            owned = _owned_sbatch_option(arg)
            if owned is not None:
                raise ValueError(f"item {index} ({arg!r}): {owned} is set by {SBATCH_OWNED_OPTIONS[owned]}")
        return args


class ScoreConfig(_Section):
    """``ddpflow score`` and the score-pipeline flow: a registered model scores a whole table on DDP ranks, each row
    exactly once, resumable (docs/scoring.md)."""

    model: str | None = Field(
        None,
        description="NAME@alias, NAME/version, or a path to a run's model.pt; default: registry.model_name@champion.",
    )
    source: str | None = Field(None, description="What data.source takes (file, directory, glob, fsspec URL).")
    format: Literal["auto", "parquet", "csv"] = Field("auto", description="The source's format; auto: from names.")
    output: str | None = Field(None, description="Directory of Parquet part files, a manifest.json written last.")
    keep: list[str] | None = Field(
        None,
        description="Columns carried beside the scores; default: data.key when set, else the key the model was "
        "trained with (model.pt's), else none.",
    )
    output_kind: Literal["auto", "label", "probabilities", "value"] = Field(
        "auto", description="label or probabilities (classification), value (regression); auto: the richest."
    )
    nproc_per_node: int | Literal["auto"] = Field(
        2, description="Scoring ranks per node; auto: one per GPU, or 1 on CPU (the train section's rule)."
    )
    launcher: Literal["local", "slurm"] | None = Field(
        None,
        description="local: torchrun on this machine; slurm: one batch job of score.nnodes nodes through sbatch "
        "(the slurm section; docs/scoring.md). Default: train.launcher's value, so scoring runs where training does.",
    )
    nnodes: int = Field(1, ge=1, description="Nodes of the scoring's Slurm job (above 1: score.launcher slurm only).")
    batch_size: int = Field(65_536, ge=1, description="Rows per record batch read and scored.")
    on_invalid: Literal["error", "skip"] = Field(
        "error", description="A row the model cannot take: stop naming it, or write it to rejects/ with the reason."
    )
    timeout_s: float | None = Field(None, gt=0, description="Stop the ranks after this long.")


class PipelineConfig(_Section):
    # None only for a training script run without a data section (train.script): it has no prepared dataset.
    data: DataConfig | None = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    # `ddpflow sweep` reads and validates it (ddpflow/sweep/space.py); a run ignores it, and no record holds it.
    sweep: dict[str, Any] | None = Field(None, exclude=True, description="A sweep's section: see docs/sweeps.md.")
    score: ScoreConfig = Field(default_factory=ScoreConfig)

    @property
    def score_launcher(self) -> Literal["local", "slurm"]:
        """score.launcher, else train.launcher: a scoring runs where training runs unless told otherwise."""
        return self.score.launcher or self.train.launcher

    @model_validator(mode="before")
    @classmethod
    def _script_without_data(cls, raw: Any) -> Any:
        """A training script's run that names no data section has no dataset (``data`` is None); every other
        run has one: the section's defaults when it is left out."""
        if isinstance(raw, dict) and "data" not in raw and _names_script(raw.get("train")):
            return {**raw, "data": None}
        return raw

    @model_validator(mode="after")
    def _data_unless_script(self) -> PipelineConfig:
        if self.data is None and self.train.script is None:
            raise ValueError("data: only a run of train.script may go without its data section")
        return self

    @model_validator(mode="after")
    def _score_nodes_need_slurm(self) -> PipelineConfig:
        if self.score.nnodes > 1 and self.score_launcher != "slurm":
            raise ValueError(
                f"score.nnodes is {self.score.nnodes}: more than one node needs score.launcher 'slurm' (it is "
                f"{self.score_launcher!r}{'' if self.score.launcher else ', from train.launcher'}): "
                "a local scoring runs on this machine only"
            )
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted keys to scalar values, for MLflow params."""
        return _flatten(self.model_dump(mode="json", exclude={"score"}))  # a scoring's settings are not a run's

    def write_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path


def _names_script(train: Any) -> bool:
    """Whether a raw ``train`` section (a dict or a TrainConfig) names a training script."""
    script = train.get("script") if isinstance(train, dict) else getattr(train, "script", None)
    return bool(script)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and not dotted.endswith("model_kwargs"):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = json.dumps(value) if isinstance(value, (dict, list)) else value
    return flat


def format_validation_error(error: ValidationError, within: tuple[str, ...] = ()) -> str:
    """One line per problem, each naming the field by its dotted path (under ``within``: a section's own model,
    such as an input kind's options, checked on its own)."""
    lines = []
    for problem in error.errors():
        path = ".".join(str(part) for part in (*within, *problem["loc"])) or "config"
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(
            f"{path}: {message} (got {problem.get('input')!r})"
            if "input" in problem and not isinstance(problem["input"], dict)
            else f"{path}: {message}"
        )
    return "invalid configuration: " + "; ".join(lines)


def validate_config(raw: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.epochs=3`` -> (['train', 'epochs'], 3). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, _, value = text.partition("=")
    path = [part for part in dotted.strip().split(".") if part]
    if len(path) < 2:
        raise ConfigError(f"override {text!r} must name a section and a key, e.g. train.epochs=3")
    return path, yaml.safe_load(value) if value.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    return raw


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """YAML file (optional) plus ``section.key=value`` overrides, validated."""
    raw = read_yaml(path) if path else {}
    return validate_config(apply_overrides(raw, list(overrides or [])))
