"""The program every rank runs: ``python -m training.train --config RUN_DIR/train_config.json``.

One node, N ranks (one per GPU, or N CPU processes)::

    python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 1 \\
        -m training.train --config RUN_DIR/train_config.json

Several nodes (run on every node, NODE_RANK = 0..NNODES-1, the same
rendezvous endpoint and id; RUN_DIR and the dataset on a shared filesystem)::

    python -m torch.distributed.run --nnodes NNODES --node-rank NODE_RANK --nproc-per-node N \\
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN_ID --max-restarts 1 \\
        -m training.train --config RUN_DIR/train_config.json

Without torchrun the same command trains in one process. What a rank reads
and writes is in ``training/layout.py``; resume rules in ``training/checkpoint.py``;
test hooks (``DDPFLOW_FAULT``, ``DDPFLOW_RECORD_INDICES``) in ``training/faults.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from training.allreduce_poll import wants_polling
from training.checkpoint import Checkpointer, capture_rng, inference_checkpoint, restore_rng
from training.data.manifest import Manifest, read_manifest
from training.data.node_cache import open_splits
from training.data.placement import place_splits
from training.distributed import DistContext, distributed, shard_range, wrap_model
from training.faults import FaultInjector, IndexRecorder
from training.job import TrainJob
from training.loading import SplitTensors, TrainBatches
from training.loop import StepSettings, evaluate, train_epoch, validation_metrics
from training.metrics_sink import MetricsSink
from training.models import ModelSpec, build_model
from training.normalisation import Normaliser
from training.progress import Progress
from training.runtime import (
    configure_cpu,
    configure_cuda,
    die_with_parent,
    exit_without_teardown,
    preload_in_background,
)


def log(ctx: DistContext, message: str) -> None:
    if ctx.is_main:
        print(f"[train] {message}", flush=True)


@dataclass
class Trainer:
    """The state of one rank's training: what ``run_epoch`` advances and checkpoints save."""

    job: TrainJob
    ctx: DistContext
    manifest: Manifest
    spec: ModelSpec
    model: torch.nn.Module  # plain module
    ddp: torch.nn.Module  # the DDP wrapper of ``model``
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    batches: TrainBatches
    val: SplitTensors
    settings: StepSettings
    checkpointer: Checkpointer
    normaliser: Normaliser  # reports losses on the target's original scale
    start_epoch: int = 0
    history: list[dict[str, Any]] | None = None


def node_splits(job: TrainJob, manifest: Manifest, ctx: DistContext) -> tuple[SplitTensors, SplitTensors]:
    """Train and val from the node cache: built once per node, mapped by every local rank (each says how)."""
    cached = open_splits(job.dataset_dir, manifest, ("train", "val"), job.config.data.cache_dir)
    for split in cached.values():
        print(f"[data] rank {ctx.rank}: {split.describe()}", flush=True)
    return cached["train"].tensors, cached["val"].tensors


def build_trainer(job: TrainJob, ctx: DistContext, faults: FaultInjector) -> Trainer:
    train = job.config.train
    on_gpu = ctx.device.type == "cuda"
    cpu = configure_cpu(train, ctx.local_rank, ctx.local_world_size, pin=not on_gpu)
    poll_allreduce = wants_polling(train.cpu_poll_allreduce, ctx.device, ctx.world_size, cpu.pinned)
    setup = cpu.describe() + (", " + configure_cuda(train) if on_gpu else "")
    setup += ", polling for the gradient all-reduce" if poll_allreduce else ""
    log(ctx, f"{ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device.type}, {setup}")
    manifest = read_manifest(job.dataset_dir)
    loaded_at = time.monotonic()
    train_split, val = node_splits(job, manifest, ctx)
    seconds = time.monotonic() - loaded_at
    log(
        ctx, f"loaded {len(train_split)} train / {len(val)} val rows x {manifest.n_features} features in {seconds:.1f}s"
    )

    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(train.seed)
    random.seed(train.seed)
    spec = ModelSpec(train.model, manifest.n_features, manifest.n_outputs, dict(train.model_kwargs))
    model = build_model(spec)
    checkpointer = Checkpointer(job.run_dir, ctx, before_write=faults.before_checkpoint_write)
    resumed = checkpointer.load_resumable(job.config, manifest.fingerprint)
    if resumed is None:
        warm = checkpointer.load_warm_start(job.init_weights, spec.to_dict(), manifest.features)
        if warm is not None:
            model.load_state_dict(warm)
    else:
        model.load_state_dict(resumed["model"])
    model.to(ctx.device)
    ddp = wrap_model(model, ctx, poll_allreduce)
    placed, where = place_splits({"train": train_split, "val": val}, train.data_on_device, ctx.device, model)
    train_split, val = placed["train"], placed["val"]
    log(ctx, "data: " + "; ".join(where))

    batches = TrainBatches(
        train_split, ctx.rank, ctx.world_size, train.batch_size, train.seed, ctx.device, train.pin_memory
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    scheduler = None
    if train.lr_schedule == "cosine":
        optimizer_steps = train.epochs * -(-len(batches) // train.grad_accum)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=optimizer_steps)
    settings = StepSettings(manifest.task, ctx.device, train.grad_accum, train.grad_clip, train.bf16)
    normaliser = Normaliser.from_manifest(manifest)
    trainer = Trainer(
        job, ctx, manifest, spec, model, ddp, optimizer, scheduler, batches, val, settings, checkpointer, normaliser,
        history=[],
    )  # fmt: skip
    if resumed is not None:
        restore_training_state(trainer, resumed)
    else:
        # Different streams per rank from here on (e.g. dropout masks), still reproducible.
        torch.manual_seed(train.seed + 1000 * (ctx.rank + 1))
        random.seed(train.seed + 1000 * (ctx.rank + 1))
    return trainer


def restore_training_state(trainer: Trainer, saved: dict[str, Any]) -> None:
    trainer.optimizer.load_state_dict(saved["optimizer"])
    if trainer.scheduler is not None and saved.get("scheduler") is not None:
        trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.start_epoch = int(saved["epoch"])
    trainer.history = list(saved.get("metrics") or [])
    per_rank = saved["rng"]["per_rank"]
    ctx = trainer.ctx
    if len(per_rank) == ctx.world_size:
        restore_rng(per_rank[ctx.rank])
        log(ctx, f"resumed from {trainer.checkpointer.last_path} after {trainer.start_epoch} epoch(s)")
    else:
        seed = trainer.job.config.train.seed + 1000 * (ctx.rank + 1) + trainer.start_epoch
        torch.manual_seed(seed)
        random.seed(seed)
        log(
            ctx,
            f"resumed from {trainer.checkpointer.last_path} after {trainer.start_epoch} epoch(s); "
            f"world size {len(per_rank)} -> {ctx.world_size}: RNG streams reseeded, data order per rank differs",
        )


def run_epoch(
    trainer: Trainer, epoch: int, progress: Progress, faults: FaultInjector, indices: IndexRecorder
) -> dict[str, Any]:
    ctx, manifest, original_scale = trainer.ctx, trainer.manifest, trainer.normaliser.target_loss_inverse
    started = time.monotonic()
    progress.start_epoch(epoch)
    local = train_epoch(
        trainer.ddp,
        trainer.optimizer,
        trainer.scheduler,
        trainer.batches,
        epoch,
        trainer.settings,
        on_step=lambda done, samples, loss: progress.step(done, samples, lambda: original_scale(loss())),
        before_step=faults.at_step,
        on_batch=lambda batch: indices.add(batch.indices),
    )
    train_seconds = time.monotonic() - started
    indices.write(epoch)
    loss_sum, samples = ctx.all_reduce_sum([local.loss, local.samples])
    if int(samples) != manifest.rows("train"):
        raise RuntimeError(
            f"epoch {epoch}: ranks trained on {int(samples)} rows, the train split has {manifest.rows('train')}"
        )

    start, stop = shard_range(manifest.rows("val"), ctx.rank, ctx.world_size)
    val = evaluate(trainer.model, trainer.val, start, stop, trainer.job.config.eval.batch_size, trainer.settings)
    val_loss, val_correct, val_count = ctx.all_reduce_sum([val.loss, val.correct, val.samples])
    if int(val_count) != manifest.rows("val"):
        raise RuntimeError(
            f"epoch {epoch}: validation covered {int(val_count)} rows, the val split has {manifest.rows('val')}"
        )

    # Losses on the target's original scale (regression trains on the standardised one).
    return {
        "train_loss": original_scale(loss_sum / samples),
        "train_samples": int(samples),
        "train_samples_per_s": samples / max(train_seconds, 1e-9),
        **validation_metrics(original_scale(val_loss), val_correct, val_count, manifest.task),
        "epoch_seconds": time.monotonic() - started,
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "world_size": ctx.world_size,
        "weights_in_sync": ctx.weights_agree(trainer.model),
    }


def on_cpu(tree: Any) -> Any:
    """Tensors moved to the CPU, so a checkpoint written on a GPU loads anywhere."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {key: on_cpu(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(value) for value in tree)
    return tree


def last_checkpoint(trainer: Trainer, completed_epochs: int) -> dict[str, Any]:
    """All ranks call this (it gathers every rank's RNG state); only rank 0, the writer, builds the rest."""
    rng = trainer.ctx.gather_objects(capture_rng())
    if not trainer.ctx.is_main:
        return {}
    return {
        "model": on_cpu(trainer.model.state_dict()),
        "optimizer": on_cpu(trainer.optimizer.state_dict()),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "epoch": completed_epochs,
        "rng": {"per_rank": rng},
        "config": trainer.job.config.model_dump(mode="json"),
        "fingerprint": trainer.manifest.fingerprint,
        "world_size": trainer.ctx.world_size,
        "metrics": trainer.history,
    }


def final_model(trainer: Trainer) -> dict[str, Any]:
    metrics = trainer.history[-1] if trainer.history else {}
    return inference_checkpoint(
        on_cpu(trainer.model.state_dict()), trainer.spec, trainer.manifest, trainer.job.config.train.epochs, metrics
    )


def run(job: TrainJob, ctx: DistContext) -> None:
    train_and_save(job, ctx, MetricsSink(job.run_dir, enabled=ctx.is_main))


def train_and_save(job: TrainJob, ctx: DistContext, sink: MetricsSink) -> None:
    faults = FaultInjector.from_env(ctx.rank, job.run_dir)
    trainer = build_trainer(job, ctx, faults)
    train = job.config.train
    progress = Progress(ctx.is_main, train.progress_interval_s, train.epochs, len(trainer.batches), ctx.world_size)
    indices = IndexRecorder.from_env(ctx.rank, job.run_dir)
    for epoch in range(trainer.start_epoch, train.epochs):
        metrics = run_epoch(trainer, epoch, progress, faults, indices)
        trainer.history.append({"epoch": epoch, **metrics})
        sink.log_epoch(epoch, metrics)
        trainer.checkpointer.save_last(last_checkpoint(trainer, epoch + 1))
        progress.end_epoch(metrics)
    trainer.checkpointer.save_final(final_model(trainer) if ctx.is_main else {})
    log(ctx, f"wrote {trainer.checkpointer.final_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m training.train", description="One DDP rank of a ddpflow training run."
    )
    parser.add_argument("--config", required=True, help="RUN_DIR/train_config.json (a training.job.TrainJob)")
    return parser.parse_args(argv)


@record  # a failing rank writes its traceback to TORCHELASTIC_ERROR_FILE: torchrun reports the root cause
def main(argv: list[str] | None = None) -> None:
    preload_in_background()  # first: DDP's lazy imports overlap the rendezvous and data loading
    job = TrainJob.read(parse_args(argv).config)
    die_with_parent()
    with distributed(job.config.train) as ctx:
        run(job, ctx)


if __name__ == "__main__":
    main()  # an error propagates from here: @record and the normal exit path report it
    exit_without_teardown()  # success: every file is closed and the group destroyed
