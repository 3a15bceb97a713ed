"""The preflight: checks that reject a config before any process starts, each run once.

Pydantic already rejects values that are wrong on their own (negative epochs).
These need the machine or the prepared data:

    layout = check_machine(config)                    # before prepare: a bad config fails fast
    check_data(config, prepared.manifest, layout)     # after prepare: the data fits the ranks

``check_machine``: NCCL without GPUs, more ranks than the machine has, a model
import path that does not import, an objective (``train.objective``) that does not import; with
``train.script`` (a user's training script, whose model and data are its own): the script's file, and the ranks.
``check_data``: a batch larger than a rank's share of the train split, an objective
that does not fit the label (binary on 3 classes, label smoothing outside softmax,
balanced class weights without class counts) or whose per-row loss is not one value
per row (called on a tiny batch), a model that cannot be built for the data's shapes,
an optimizer keyword the optimizer does not take, early stopping without a val split.
The pipeline runs the first before preparing the data and the train stage
(every launcher, through ddpflow/launch/stage.py: ``check_request``) the second,
just before the ranks start; ``check_request`` runs ``check_machine`` itself only
when the request carries no layout. Every error is a ConfigError (a ValueError) naming the field.
"""

from __future__ import annotations

from pathlib import Path

from training.core.config import ConfigError, PipelineConfig
from training.core.manifest import Manifest
from training.core.topology import RankLayout, resolve_ranks
from training.kinds.inputs import inputs_from_manifest
from training.kinds.registry import check_inputs
from training.loading.stream import check_stream_cache
from training.models.registry import ModelSpec, build_model, resolve_factory
from training.objectives.registry import BUILT_IN, build_objective, check_objective, resolve_user_objective


def check_machine(config: PipelineConfig, gpus: int | None = None) -> RankLayout:
    """Machine-level checks; returns the rank layout (training/core/topology.py) they checked.

    ``gpus=None`` asks torch how many GPUs this machine has. With ``train.launcher: slurm`` the
    ranks run on the job's nodes instead: see ``_check_slurm_nodes``.
    """
    if config.data is not None:
        check_inputs(config.data)  # each input's kind is registered and takes its options (its record says)
    if config.train.script:
        check_script(config.train.script)
    if config.train.launcher == "slurm":
        return _check_slurm_nodes(config)
    layout = resolve_ranks(config.train, gpus)  # ConfigError for NCCL without GPUs
    if layout.nproc_per_node > layout.slots:
        raise ConfigError(
            f"train.nproc_per_node: {layout.nproc_per_node} ranks asked for, "
            f"but this machine has {layout.slots} {layout.slot_kind}"
        )
    _check_trainer(config)
    return layout


def check_script(script: str) -> None:
    """``train.script`` names a Python file that can be read (ConfigError naming it otherwise)."""
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"train.script: no file at {path.resolve()}")
    if path.suffix != ".py":
        raise ConfigError(f"train.script: {path} is not a Python file (.py)")
    try:
        path.read_bytes()
    except OSError as error:
        raise ConfigError(f"train.script: {path} cannot be read ({error.strerror})") from None


def _check_trainer(config: PipelineConfig) -> None:
    """ddpflow's own trainer: its model and objective import, its optimizer takes its keywords (a training script
    brings its own)."""
    if config.train.script:
        return
    resolve_factory(config.train.model)  # ModelImportError (a ValueError) names train.model
    _check_objective_imports(config)
    check_optimizer(config)


def check_optimizer(config: PipelineConfig) -> None:
    """``train.optimizer_kwargs`` that ``train.optimizer`` does not take fail here, not in every rank. Without
    keywords no optimizer is built: none can fail (the config bounds ``lr`` and ``weight_decay``), and the first
    optimizer built in a process imports ``torch._dynamo``, about a second of CPU before the ranks start."""
    if not config.train.optimizer_kwargs:
        return
    import torch

    from training.loop.optim import build_optimizer

    try:
        build_optimizer(torch.nn.Linear(1, 1), config.train)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_slurm_nodes(config: PipelineConfig) -> RankLayout:
    """The layout on each node of a Slurm job: their GPUs are ``slurm.gpus_per_node``, not this machine's
    (a login node without GPUs submits NCCL jobs), and sbatch itself refuses CPUs a node does not have."""
    gpus = config.slurm.gpus_per_node
    if config.train.backend == "nccl" and gpus == 0:
        raise ConfigError("train.backend: 'nccl' needs GPUs on the job's nodes: set slurm.gpus_per_node")
    layout = resolve_ranks(config.train, gpus)
    if gpus and layout.nproc_per_node > gpus:
        raise ConfigError(
            f"train.nproc_per_node: {layout.nproc_per_node} ranks asked for, but slurm.gpus_per_node is {gpus}"
        )
    _check_trainer(config)
    return layout


def _check_objective_imports(config: PipelineConfig) -> None:
    name = config.train.objective
    if name != "auto" and name not in BUILT_IN:
        resolve_user_objective(name)  # ConfigError naming train.objective


def check_data(config: PipelineConfig, manifest: Manifest, layout: RankLayout) -> None:
    """Data-level checks: every rank gets at least one full batch; the model builds for these shapes."""
    train_rows = manifest.rows("train")
    per_rank = train_rows // layout.world_size
    batch_size = config.train.rank_batch_size(layout.world_size, train_rows)  # ConfigError: global_batch_size
    if batch_size > per_rank:
        raise ConfigError(
            f"train.batch_size: {batch_size} is larger than each rank's share of the train split "
            f"({train_rows} rows / {layout.world_size} ranks = {per_rank}); lower it or add data"
        )
    if isinstance(config.train.early_stopping_patience, int) and manifest.rows("val") == 0:
        raise ConfigError(
            "train.early_stopping_patience: the val split is empty, so no epoch can be judged; "
            "set data.val_fraction above 0 or remove it"
        )
    if config.data is not None and config.data.stream is True:
        check_stream_cache(config.data, manifest)  # ConfigError: two windows of the largest shards must fit
    objective = build_objective(config.train, manifest)  # ConfigError naming the field that does not fit
    check_objective(objective, objective.n_classes)
    n_outputs = objective.n_outputs(objective.n_classes)
    inputs = inputs_from_manifest(manifest)
    model_kwargs = {**objective.model_kwargs(), **config.train.model_kwargs}  # as the rank builds it
    spec = ModelSpec.for_inputs(config.train.model, inputs, n_outputs, model_kwargs)
    try:
        build_model(spec)
    except TypeError as error:  # a factory that rejects model_kwargs
        raise ConfigError(
            f"train.model_kwargs: {config.train.model} cannot be built with {config.train.model_kwargs}: {error}"
        ) from None
