"""Checks that reject a config before any process starts.

Pydantic already rejects values that are wrong on their own (negative epochs).
These need the machine or the prepared data: more ranks than the machine has,
a model import path that does not import, a batch larger than a rank's share.
"""

from __future__ import annotations

import os

from training.config import ConfigError, PipelineConfig
from training.data.manifest import Manifest
from training.models import ModelSpec, build_model, resolve_factory


def local_slots(backend: str) -> tuple[int, str]:
    """How many ranks this machine can run, and what it counts (GPUs or CPU cores)."""
    import torch  # lazily: the CLI validates configs without paying for torch

    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1), "CPU cores"


def ranks_per_node(nproc_per_node: int | str, gpus: int) -> int:
    """``train.nproc_per_node`` as a number. ``auto``: one rank per GPU; on CPU one rank.

    Why 1 on CPU: a single rank already uses every core through torch's
    intra-op threads; N CPU ranks on one machine split those cores N ways and
    add a gloo all-reduce of every gradient per step, so for the MLP-sized
    models this project trains they are not faster (docs/benchmarks.md, DDP
    scaling). Several CPU ranks remain available by setting an int.
    """
    if nproc_per_node != "auto":
        return int(nproc_per_node)
    return gpus if gpus > 0 else 1


def resolved_nproc(config: PipelineConfig) -> int:
    slots, kind = local_slots(config.train.backend)
    return ranks_per_node(config.train.nproc_per_node, slots if kind == "GPUs" else 0)


def check_runnable(config: PipelineConfig) -> None:
    """Machine-level checks: enough GPUs/cores for the ranks, the model factory imports."""
    nproc = config.train.nproc_per_node
    if nproc != "auto":
        slots, kind = local_slots(config.train.backend)
        if nproc > slots:
            raise ConfigError(f"train.nproc_per_node: {nproc} ranks asked for, but this machine has {slots} {kind}")
    resolve_factory(config.train.model)  # ModelImportError (a ValueError) names train.model


def check_fits_dataset(config: PipelineConfig, manifest: Manifest) -> None:
    """Data-level checks: every rank gets at least one full batch; the model builds for these shapes."""
    world_size = resolved_nproc(config) * config.train.nnodes
    train_rows = manifest.rows("train")
    per_rank = train_rows // world_size
    if config.train.batch_size > per_rank:
        raise ConfigError(
            f"train.batch_size: {config.train.batch_size} is larger than each rank's share of the train split "
            f"({train_rows} rows / {world_size} ranks = {per_rank}); lower it or add data"
        )
    spec = ModelSpec(config.train.model, manifest.n_features, manifest.n_outputs, dict(config.train.model_kwargs))
    try:
        build_model(spec)
    except TypeError as error:  # a factory that rejects model_kwargs
        raise ConfigError(
            f"train.model_kwargs: {config.train.model} cannot be built with {config.train.model_kwargs}: {error}"
        ) from None
