"""What a config's ``auto`` settings become for a prepared dataset and a world size, decided once; and what a
training script's run records of its script.

    config = resolve_for_data(config, manifest, world_size)
    config = resolve_script(config)          # train.script: an absolute path, and the file's sha256

- ``train.model: auto`` -> the built-in model for the inputs (``training/models/registry.py: with_resolved_model``);
- the built-in ``mlp``'s defaults (``training/models/tabular.py: MLP_DEFAULTS``, and ``default_ensemble`` of the
  train rows) that differ from the class's own filled into ``train.model_kwargs`` where the user left them out
  (``defaults_to_record``), so the run records the
  architecture it trains (a model.pt whose model_kwargs do not hold them rebuilds with the class's own
  defaults, as it was trained); none while they agree;
- ``train.batch_size: auto`` -> ``auto_batch_size(train rows, world size)`` (``training/core/config.py``);
- ``train.lr: auto`` -> for the built-in ``mlp``, ``default_lr`` of the rows per optimizer step and the task
  (``training/models/tabular.py``: lower for a regression target's small steps); for every other model
  ``DEFAULT_LR``;
- ``train.early_stopping_patience: auto`` -> ``DEFAULT_PATIENCE`` with a val split, none without one;
- ``train.label_smoothing: auto`` -> ``DEFAULT_LABEL_SMOOTHING`` for a softmax over more than two classes, else 0
  (``training/objectives/registry.py: label_smoothing``);
- ``data.stream: auto`` -> true when the node cache would take more than half of its disk's free space, else false
  (``training/loading/stream.py: stream_wanted``; the stream's order is another training).

The pipeline resolves before anything records the config or computes its training identity (resume,
``train.skip_if_unchanged``, the MLflow run); the train stage (``ddpflow/launch/stage.py: run_train_stage``)
resolves again (a no-op on a resolved config), so config.json and every rank hold numbers, never ``auto``. A rank
given an unresolved config (a launcher called directly, as some tests do) reads the batch, the patience and the
label smoothing ``auto`` the same way (``TrainConfig.rank_batch_size``, ``TrainConfig.patience``,
``TrainConfig.smoothing``); its ``mlp`` is the class's own defaults (the architecture of a model.pt whose
model_kwargs do not hold ``MLP_DEFAULTS``) and its ``lr`` DEFAULT_LR (``TrainConfig.learning_rate``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from training.core.config import PipelineConfig
from training.core.fileio import DATA, log_rank
from training.core.location import join
from training.core.manifest import Manifest
from training.loading.stream import stream_wanted
from training.models.registry import with_resolved_model
from training.models.tabular import default_lr, defaults_to_record
from training.objectives.registry import label_smoothing


def resolve_for_data(config: PipelineConfig, manifest: Manifest, world_size: int) -> PipelineConfig:
    """The config with every ``auto`` above replaced by its value for ``manifest`` on ``world_size`` ranks."""
    config = with_resolved_model(config, manifest)
    train = config.train
    update = {}
    if train.model == "mlp":
        kwargs = {**defaults_to_record(manifest.rows("train")), **train.model_kwargs}
        if kwargs != train.model_kwargs:
            update["model_kwargs"] = kwargs
    if train.batch_size == "auto":
        update["batch_size"] = train.rank_batch_size(world_size, manifest.rows("train"))
    if train.lr == "auto":
        rows = train.rows_per_step(world_size, manifest.rows("train"))
        update["lr"] = default_lr(rows, manifest.task) if train.model == "mlp" else train.learning_rate()
    if train.early_stopping_patience == "auto":
        update["early_stopping_patience"] = train.patience(manifest.rows("val"))
    if train.label_smoothing == "auto":
        update["label_smoothing"] = label_smoothing(train, manifest)
    config = _with_stream_decided(config, manifest)
    if not update:
        return config
    return config.model_copy(update={"train": train.model_copy(update=update)})


def _with_stream_decided(config: PipelineConfig, manifest: Manifest) -> PipelineConfig:
    """``data.stream: auto`` -> true or false for this dataset on this machine's cache disk, said in the log
    (``training/loading/stream.py: stream_wanted``): the stream's order changes the weights, so a run records it."""
    data = config.data
    if data is None or data.stream is True or data.stream is False:
        return config
    on, why = stream_wanted(data, join(data.root, manifest.fingerprint), manifest)
    log_rank(why, DATA)
    return config.model_copy(update={"data": data.model_copy(update={"stream": on})})


def resolve_script(config: PipelineConfig) -> PipelineConfig:
    """``train.script`` made absolute (a relative path is the working directory's: where the run starts) and
    ``train.script_sha256`` the file's hash: an edited script is another training (resume, skip_if_unchanged)."""
    path = Path(str(config.train.script)).resolve()
    update = {"script": str(path), "script_sha256": file_sha256(path)}
    return config.model_copy(update={"train": config.train.model_copy(update=update)})


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
