"""Which training a run is, and so which checkpoint it may continue: the resume rule, the only one.

A run continues only the SAME training, and two trainings are the same when ``training_identity(config,
fingerprint)`` is equal: the dataset fingerprint plus the train settings that change the trained weights, each
declared so on the field itself in training/core/config.py (``ChangesWeights[...]``: the model, the optimisation,
the batch, the seed, the world, the numerics), and the stream's order while ``data.stream`` is on. Every other
setting (``KeepsWeights[...]``: timeouts, restarts, threads, paths, backend, init_from, progress interval) may
change between attempts. ``train.epochs`` is part of it: raising it is a new training (the pipeline opens a fresh
run directory; last.pt of another epoch count is refused). Why: one rule anyone can predict, and a resumed run
ends with the weights an uninterrupted run of the same config would have (also with a cosine schedule, which
depends on the epoch count). To train an existing model longer, start a new run with ``train.init_from`` pointing
at its model.pt.

Another world size: with ``train.global_batch_size`` (in the identity instead of the per-rank batch and the
ranks) a run resumes on any world size that divides it. Without it the world size changes the weights (the
global batch is the per-rank batch x the ranks): a changed ``nproc_per_node`` or ``nnodes`` is an identity
difference.

Who applies it: the rank, to the checkpoint it finds (training/checkpoint/files.py: ``resume_mismatches``,
``check_global_batch``, ``ResumeMismatchError``); the pipeline, to pick the run directory to resume
(ddpflow/rundirs.py: ``find_resumable_run``); the MLflow tag of runs and versions
(ddpflow/tracking/runs.py: ``training_identity_tag``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from training.core.config import DataConfig, PipelineConfig, TrainConfig


def training_identity(config: PipelineConfig | Mapping[str, Any], fingerprint: str | None) -> dict[str, Any]:
    """What makes two trainings the same one: the data's fingerprint and the train fields that change the weights.

    ``config`` is a PipelineConfig or its JSON form (a run's config.json, a checkpoint's
    "config"). Equal identities: a run may continue the other's checkpoint, and two models
    were trained the same way on the same data.
    """
    if isinstance(config, PipelineConfig):
        train = config.train.model_dump(mode="json")
        data = config.data.model_dump(mode="json") if config.data is not None else {}
    else:
        train = dict(config.get("train") or {})
        data = dict(config.get("data") or {})
    omitted = TrainConfig.identity_defaults()  # at its default (or absent: recorded before it existed): left out
    fields = {name: train.get(name, omitted.get(name)) for name in TrainConfig.weight_fields()}
    if fields.get("global_batch_size") is not None:  # the global batch, not how it splits over ranks
        fields = {name: value for name, value in fields.items() if name not in TrainConfig.world_fields()}
    identity = {
        "fingerprint": fingerprint,
        "train": {name: value for name, value in fields.items() if name not in omitted or value != omitted[name]},
    }
    order = DataConfig.order_identity(data)  # the stream's order; {} on the node cache: no entry at all
    return {**identity, "data": order} if order else identity


def identity_differences(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """Each way two ``training_identity`` values differ ("train.lr 0.01 != 0.1"); empty when equal."""
    problems = []
    if saved["fingerprint"] != wanted["fingerprint"]:
        problems.append(f"dataset fingerprint {saved['fingerprint']!r} != {wanted['fingerprint']!r}")
    for name in TrainConfig.weight_fields():
        if saved["train"].get(name) != wanted["train"].get(name):
            problems.append(f"train.{name} {saved['train'].get(name)!r} != {wanted['train'].get(name)!r}")
    saved_data, wanted_data = saved.get("data") or {}, wanted.get("data") or {}
    for name in sorted(saved_data.keys() | wanted_data.keys()):
        absent = False if name == "stream" else None  # the node cache: stream false, no window
        before, now = saved_data.get(name, absent), wanted_data.get(name, absent)
        if before != now:
            problems.append(f"data.{name} {before!r} != {now!r}")
    return problems
