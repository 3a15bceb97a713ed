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
and writes is in ``training/core/layout.py``; resume rules in ``training/checkpoint/files.py``;
test hooks (``DDPFLOW_FAULT``, ``DDPFLOW_RECORD_INDICES``) in ``training/loop/hooks.py``.

The file reads in the order a rank runs: ``main`` joins the process group and
runs ``Trainer(job, ctx, hooks).train()``; the Trainer's constructor builds
the rank's parts in named steps (the process, the data, the model, the data's
place and batches, the optimizer, then resume or per-rank seeds); ``train``
and ``run_epoch`` are the loop; ``state_dict``/``load_state_dict`` are the
only place that knows what last.pt holds.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import replace
from typing import Any

import torch

from training.checkpoint.files import Checkpointer, check_global_batch, identity_entries
from training.checkpoint.steps import StepSchedule
from training.core.job import TrainJob
from training.core.log import DATA, log_main, log_rank
from training.core.manifest import read_manifest
from training.core.rng import capture_rng, rank_seed, restore_rng, seed_process
from training.distributed.context import DistContext, distributed, shard_range, wrap_model
from training.distributed.process import (
    configure_process,
    decode_workers,
    die_with_parent,
    exit_without_teardown,
    make_room_for_workers,
    preload_in_background,
    record_root_cause,
)
from training.inference.model_file import inference_checkpoint
from training.kinds.inputs import describe_inputs, inputs_from_manifest
from training.kinds.normalisation import Normaliser
from training.kinds.registry import CODECS, read_encoders
from training.loading.batches import TrainBatches
from training.loading.node_cache import open_splits
from training.loading.placement import place_splits
from training.loop.coverage import Certificate, CoverageTally
from training.loop.hooks import NO_HOOKS, TrainHooks, hooks_from_env
from training.loop.metrics_sink import MetricsSink, StepMetricsSink
from training.loop.nonfinite import NonFiniteStep, non_finite_error
from training.loop.optim import build_optimizer, build_schedule, optimizer_states_per_parameter
from training.loop.preemption import Preempted, PreemptionWatch
from training.loop.progress import Progress
from training.loop.selection import Selection
from training.loop.step import StepSettings, TrainStep, evaluate, validation_metrics
from training.models.registry import ModelSpec, build_model
from training.objectives.registry import build_objective


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m training.train", description="One DDP rank of a ddpflow training run."
    )
    parser.add_argument("--config", required=True, help="RUN_DIR/train_config.json (a training.core.job.TrainJob)")
    return parser.parse_args(argv)


@record_root_cause  # a failing rank's traceback, in TORCHELASTIC_ERROR_FILE, is torchrun's root cause
def main(argv: list[str] | None = None) -> None:
    preload_in_background()  # first: DDP's lazy imports overlap the rendezvous and data loading
    job = TrainJob.read(parse_args(argv).config)
    preemption = PreemptionWatch.install(job.config.train)  # a stop signal saves and exits (loop/preemption.py)
    die_with_parent()
    with distributed(job.config.train) as ctx:
        try:
            Trainer(job, ctx, hooks_from_env(ctx.rank, job.run_dir), preemption).train()
        except Preempted:
            return  # saved, recorded in RUN_DIR/preempted.json: exit 0, resumable


class Trainer:
    """One rank's training: the constructor builds it, step by step, in the order it happens; ``train()`` runs it."""

    def __init__(
        self, job: TrainJob, ctx: DistContext, hooks: TrainHooks = NO_HOOKS, preemption: PreemptionWatch | None = None
    ):
        self.job, self.ctx, self.hooks = job, ctx, hooks
        self.preemption = preemption or PreemptionWatch()  # none installed: never preempted
        self.config = job.config.train
        self.checkpointer = Checkpointer(
            job.run_dir, ctx, hooks.before_checkpoint_write, hooks.after_checkpoint_write, self.config.keep_checkpoints
        )
        self.sink = MetricsSink(job.run_dir, enabled=ctx.is_main)
        self.epochs_done, self.history = 0, []
        # Where in epoch ``epochs_done`` training continues (a step checkpoint's position), and that epoch's
        # all-reduced sums of the steps before it (loss, rows, coverage lanes), carried on rank 0.
        self.start_step, self.carried = 0, None
        self.coverage = CoverageTally()  # this rank's rows of the epoch (training/loop/coverage.py)
        self.selection = Selection.from_config(self.config)  # which epoch model.pt holds, when to stop
        self.best_weights: dict[str, torch.Tensor] | None = None  # rank 0: the best epoch's, on the CPU
        self._configure_process()
        self._load_data()
        saved = self._build_model()
        hooks.on_model(self.model)
        self._place_data()
        self._build_optimizer()
        self._resume_or_seed(saved)

    # --- the constructor's steps, in order ---------------------------------------------------------------

    def _configure_process(self) -> None:
        """Threads and cores, CUDA math modes, the all-reduce's wait (``distributed/process.py: configure_process``)."""
        ctx = self.ctx
        self.process = configure_process(self.config, ctx)
        log_main(
            ctx.is_main,
            f"{ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device.type}, {self.process.describe()}",
        )

    def _load_data(self) -> None:
        """The manifest, then train and val from the node cache: built once per node, mapped by every local rank."""
        self.manifest = read_manifest(self.job.dataset_dir)
        self.normaliser = Normaliser.from_manifest(self.manifest)  # reports losses on the target's own scale
        loaded_at = time.monotonic()
        cached = open_splits(self.job.dataset_dir, self.manifest, ("train", "val"), self.job.config.data.cache_dir)
        for split in cached.values():
            log_rank(f"rank {self.ctx.rank}: {split.describe()}", DATA)  # each rank says how it got its splits
        self.train_split, self.val = cached["train"].tensors, cached["val"].tensors
        log_main(
            self.ctx.is_main,
            f"loaded {len(self.train_split)} train / {len(self.val)} val rows of "
            f"{describe_inputs(inputs_from_manifest(self.manifest))} inputs "
            f"in {time.monotonic() - loaded_at:.1f}s",
        )

    def _build_model(self) -> dict[str, Any] | None:
        """spec -> module -> (a warm start unless last.pt continues) -> the device -> DDP; returns last.pt, if any."""
        train, manifest = self.config, self.manifest
        # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
        seed_process(train.seed)
        self.objective = build_objective(train, manifest)  # the loss contract (training/objectives/registry.py)
        n_outputs = self.objective.n_outputs(self.objective.n_classes)
        inputs = inputs_from_manifest(manifest)  # the model contract (training/kinds/inputs.py)
        model_kwargs = {**self.objective.model_kwargs(), **train.model_kwargs}  # next_token: the text it models
        self.spec = ModelSpec.for_inputs(train.model, inputs, n_outputs, model_kwargs)
        self.model = build_model(self.spec)  # the plain module: evaluation, checkpoints
        saved = self.checkpointer.load_resumable(self.job.config, manifest.fingerprint)
        if saved is None:
            warm = self.checkpointer.load_warm_start(self.job.init_weights, self.spec.to_dict(), manifest.features)
            if warm is not None:
                self.model.load_state_dict(warm)
        self.model.to(self.ctx.device)
        self.ddp = wrap_model(self.model, self.ctx, self.process.poll_allreduce, train.sync_batchnorm)  # trains
        return saved

    def _place_data(self) -> None:
        """Each split on the device or the host (``train.data_on_device``), then this rank's batches.

        After the model: ``auto`` places a split on a GPU by the memory free once the model is there."""
        train, ctx = self.config, self.ctx
        placed, where = place_splits(
            {"train": self.train_split, "val": self.val},
            train.data_on_device,
            ctx.device,
            self.model,
            optimizer_states_per_parameter(train),
        )
        self.train_split, self.val = placed["train"], placed["val"]  # a host copy placed elsewhere is let go
        self.batch_size = train.rank_batch_size(ctx.world_size)  # train.batch_size, or the global one / W
        self.val_batch_size = train.rank_val_batch_size(ctx.world_size)  # bounds validation's memory
        log_main(ctx.is_main, "data: " + "; ".join(where) + f"; validation in batches of {self.val_batch_size} rows")
        self.batches = TrainBatches(
            self.train_split, ctx.rank, ctx.world_size, self.batch_size, train.seed, ctx.device, train.pin_memory,
            row_weights=self.objective.split_row_weights(self.train_split), num_workers=self._decode_workers(),
            reorder=self.hooks.epoch_rows,
        )  # fmt: skip
        self.expected_coverage = Certificate.expected(self.manifest.rows("train"))

    def _decode_workers(self) -> int:
        """train.num_workers resolved for this rank, its threads shrunk to make room (distributed/process.py)."""
        decodes = any(CODECS[info.kind].decodes_in_workers for info in inputs_from_manifest(self.manifest).values())
        cpu = self.process.cpu
        workers = decode_workers(self.config.num_workers, cpu, self.ctx.device.type == "cuda", decodes)
        self.process = replace(self.process, cpu=make_room_for_workers(cpu, workers, self.config))
        log_main(self.ctx.is_main, f"{workers} decode worker(s) per rank; {self.process.cpu.describe()}")
        return workers

    def _build_optimizer(self) -> None:
        """The optimizer and its schedule over every optimizer step of the run (training/loop/optim.py), the step
        that uses them, and its per-step curves."""
        train = self.config
        steps_per_epoch = -(-len(self.batches) // train.grad_accum)
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = build_schedule(self.optimizer, train, train.epochs * steps_per_epoch)
        self.settings = StepSettings(
            self.manifest.task, self.ctx.device, train.grad_accum, train.grad_clip, train.bf16, self.objective
        )
        self.step_sink = StepMetricsSink(
            self.job.run_dir, self.ctx.is_main, train.log_every_steps, steps_per_epoch,
            lambda loss: loss * self.normaliser.target_std**self.objective.loss_scale_power,  # as run_epoch's
        )  # fmt: skip
        self.epoch = 0

        def on_update(report) -> None:
            self.step_sink.add(self.epoch, report)

        self.train_step = TrainStep(self.ddp, self.optimizer, self.scheduler, self.batches, self.settings, on_update)
        self.step_schedule = StepSchedule(
            train.checkpoint_every_steps, train.checkpoint_every_s, train.grad_accum, len(self.batches),
            lambda due: self.ctx.all_reduce_sum([due if self.ctx.is_main else False])[0] > 0,
        )  # fmt: skip
        self.progress = Progress(
            self.ctx.is_main, train.progress_interval_s, train.epochs, len(self.batches), self.ctx.world_size
        )
        self.preemption.attach(self.ctx, len(self.batches), train.grad_accum)

    def _resume_or_seed(self, saved: dict[str, Any] | None) -> None:
        if saved is not None:
            self.load_state_dict(saved)
        else:
            # Different streams per rank from here on (e.g. dropout masks), still reproducible.
            seed_process(rank_seed(self.config.seed, self.ctx.rank))

    # --- the loop ---------------------------------------------------------------------------------------------

    def train(self) -> None:
        """The epochs still to train (until early stopping), each validated, judged, logged and checkpointed;
        then model.pt with the selected epoch's weights."""
        try:
            self._train_epochs()
        except BaseException:
            self.checkpointer.wait_for_writes(raise_error=False)  # a step checkpoint under way completes first
            raise

    def _train_epochs(self) -> None:
        for epoch in range(self.epochs_done, self.config.epochs):
            if self.selection.stopped:  # a resume after the stop: nothing left to train
                break
            metrics = self.run_epoch(epoch)
            self.epochs_done = epoch + 1
            self._judge(epoch, metrics)
            record = {"epoch": epoch, **metrics}
            self.history.append(record)
            record.update(self.selection.selected_metrics(self.history))  # selected_epoch, selected_val_*
            self.sink.log_epoch(epoch, record)
            self.checkpointer.save_last(self.state_dict())
            self.progress.end_epoch(record)
            if self.epochs_done < self.config.epochs and self.preemption.requested():  # last.pt is the checkpoint
                raise self.preemption.stopped(self.checkpointer, self.epochs_done, 0, self.job.run_dir)
        self.checkpointer.save_final(self.final_model() if self.ctx.is_main else {})
        log_main(self.ctx.is_main, f"wrote {self.checkpointer.final_path} ({self._selection_line()})")

    def _judge(self, epoch: int, metrics: dict[str, Any]) -> None:
        """train.monitor decides (the same on every rank: training/loop/selection.py); rank 0 keeps the best weights."""
        improved = self.selection.observe(epoch, metrics)
        if improved and self.selection.keeps_best_weights and self.ctx.is_main:
            self.best_weights = {
                name: value.detach().to("cpu", copy=True) for name, value in self.model.state_dict().items()
            }
        if self.selection.stopped:
            selection = self.selection
            log_rank(
                f"rank {self.ctx.rank}: early stopping after epoch {epoch + 1}/{self.config.epochs}: "
                f"{selection.monitor} has not improved for {selection.epochs_without_improvement} epoch(s) "
                f"(best {selection.best_value} in epoch {_counted_from_1(selection.best_epoch)})"
            )

    def _selection_line(self) -> str:
        """Which epoch model.pt holds, counted from 1 as the progress lines count epochs."""
        selected = self.selection.selected_epoch(self.epochs_done - 1)
        stopped = ", stopped early" if self.selection.stopped and self.epochs_done < self.config.epochs else ""
        return (
            f"the weights of epoch {selected + 1} of {self.epochs_done} trained (select {self.selection.select} by "
            f"{self.selection.monitor}{stopped})"
        )

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        """Train this rank's share of ``epoch``, then validate; every figure returned is over all ranks."""
        ctx, manifest, target_std = self.ctx, self.manifest, self.normaliser.target_std
        # Losses on the target's original scale (mse: times std², exact; other objectives: as trained).
        scale = target_std**self.objective.loss_scale_power
        started = time.monotonic()
        self.progress.start_epoch(epoch)
        self.ddp.train()
        # A resumed pass: the steps before start_step are not read; their sums come from the checkpoint.
        start, carried = self.start_step, self.carried or {}
        self.start_step, self.carried = 0, None
        loss = torch.tensor(carried.get("loss", 0.0), dtype=torch.float64, device=ctx.device)  # no sync per step
        samples = int(carried.get("rows", 0))
        self.coverage.start(carried.get("coverage"))
        self.epoch = epoch
        for step, batch in enumerate(self.batches.epoch(epoch, start), start):
            self.hooks.at_step(epoch, step)
            self.hooks.on_batch(batch.indices)
            self.coverage.add(batch.indices)
            try:
                loss.add_(self.train_step(step, batch))
            except NonFiniteStep as bad:
                raise self._non_finite(epoch, bad) from None
            samples += batch.samples
            self.progress.step(step + 1, samples, lambda seen=samples: scale * loss.item() / max(1, seen))
            preempted = self.preemption.due(step)  # the same on every rank (training/loop/preemption.py)
            if preempted or self.step_schedule.due(epoch, step):
                self._save_step(epoch, step + 1, loss, samples)
            if preempted:
                raise self.preemption.stopped(self.checkpointer, epoch, step + 1, self.job.run_dir)
        train_seconds = time.monotonic() - started
        self.hooks.end_epoch(epoch)
        weight = self.batches.global_weight(0, len(self.batches))  # the epoch's Σ w, all ranks (train_loss)

        loss_sum, samples = ctx.all_reduce_sum([loss, samples])
        if int(samples) != manifest.rows("train"):
            raise RuntimeError(
                f"epoch {epoch}: ranks trained on {int(samples)} rows, the train split has {manifest.rows('train')}"
            )
        coverage = Certificate.from_lanes(*ctx.all_reduce_int_sum(self.coverage.totals()))
        coverage.check(self.expected_coverage, epoch)  # CoverageError naming the epoch
        start, stop = shard_range(manifest.rows("val"), ctx.rank, ctx.world_size)
        val_pass = evaluate(self.model, self.val, start, stop, self.val_batch_size, self.settings)
        scored = ctx.gather_objects(val_pass.scored) if val_pass.scored is not None else None  # 2 classes: AUCs
        val = validation_metrics(ctx.all_reduce_sum(val_pass.sums.unbind()), self.settings, target_std, scored)
        if val["val_samples"] != manifest.rows("val"):
            raise RuntimeError(
                f"epoch {epoch}: validation covered {val['val_samples']} rows, the val split has {manifest.rows('val')}"
            )

        return {
            "train_loss": scale * loss_sum / weight,
            "train_samples": int(samples),
            "train_samples_per_s": samples / max(train_seconds, 1e-9),
            **val,
            "epoch_seconds": time.monotonic() - started,
            "lr": self.optimizer.param_groups[0]["lr"],
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "world_size": ctx.world_size,
            "weights_in_sync": ctx.weights_agree(self.model),
            **coverage.metrics(),
        }

    def _save_step(self, epoch: int, step: int, loss: torch.Tensor, rows: int) -> None:
        """A step checkpoint before step ``step`` of ``epoch``: the epoch's sums so far over all ranks, then
        ``state_dict`` (copies, so training goes on while rank 0 writes them: training/checkpoint/steps.py)."""
        loss_sum, rows = self.ctx.all_reduce_sum([loss, rows])
        coverage = self.ctx.all_reduce_int_sum(self.coverage.totals())
        epoch_sums = {"loss": loss_sum, "rows": int(rows), "coverage": coverage}
        self.checkpointer.save_step(self.state_dict(step, epoch_sums), epoch, step)
        self.step_schedule.written()

    def _non_finite(self, epoch: int, bad: NonFiniteStep) -> Exception:
        """The error for a NaN or inf step (training/loop/nonfinite.py). When the gradient norm is non-finite every
        rank is here at the same step, so they can gather whose loss was non-finite and name the same ranks."""
        losses_ok = self.ctx.gather_objects(math.isfinite(bad.loss)) if bad.everywhere else None
        loss_ranks = None if losses_ok is None else [rank for rank, ok in enumerate(losses_ok) if not ok]
        return non_finite_error(bad, self.ctx.rank, epoch, loss_ranks)

    # --- what a checkpoint holds --------------------------------------------------------------------------------

    def state_dict(self, step: int = 0, epoch_sums: dict[str, Any] | None = None) -> dict[str, Any]:
        """last.pt (after an epoch) or a step checkpoint (``step`` steps into epoch ``epochs_done``, with the
        epoch's all-reduced sums so far): everything this training continues from, with what the resume rule
        checks. CPU copies throughout: a background write may read them while training goes on.

        Every rank calls it (it gathers every rank's RNG streams); rank 0, the writer, gets the
        contents, the others an empty dict."""
        rng = self.ctx.gather_objects(capture_rng())
        if not self.ctx.is_main:
            return {}
        return {
            "model": on_cpu(self.model.state_dict(), copy=True),
            "optimizer": on_cpu(self.optimizer.state_dict(), copy=True),
            "scheduler": on_cpu(self.scheduler.state_dict(), copy=True) if self.scheduler is not None else None,
            "epoch": self.epochs_done,
            "step": step,  # micro-batch steps of epoch ``epoch`` already trained (0: none)
            "epoch_sums": epoch_sums,
            "global_batch": self.batch_size * self.ctx.world_size,  # rows of one step over all ranks
            "rng": {"per_rank": rng},
            "world_size": self.ctx.world_size,
            "metrics": list(self.history),
            "selection": self.selection.state_dict(),
            "best_model": self.best_weights,
            **identity_entries(self.job.config, self.manifest.fingerprint),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s contents: weights, optimizer, schedule, epochs, metrics, RNG streams."""
        ctx = self.ctx
        self.model.load_state_dict(state["model"])  # every rank loads the same (broadcast) state
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epochs_done = int(state["epoch"])
        self._resume_position(state)
        self.history = list(state.get("metrics") or [])
        self.selection.load_state_dict(state.get("selection"))
        self.best_weights = state.get("best_model") if ctx.is_main else None
        per_rank = state["rng"]["per_rank"]
        at_step = f", at step {self.start_step} of epoch {self.epochs_done}" if self.start_step else ""
        resumed = f"resumed from {self.checkpointer.resumed_from} after {self.epochs_done} epoch(s){at_step}"
        if len(per_rank) == ctx.world_size:
            restore_rng(per_rank[ctx.rank])
            log_main(ctx.is_main, resumed)
        else:
            seed_process(rank_seed(self.config.seed, ctx.rank, self.epochs_done))
            log_main(
                ctx.is_main,
                f"{resumed}; world size {len(per_rank)} -> {ctx.world_size}: RNG streams reseeded, data order "
                "per rank differs",
            )

    def _resume_position(self, state: dict[str, Any]) -> None:
        """Mid-epoch: start at the checkpoint's step. Any resume keeps the global batch (one step covers the
        same rows at any world size: training/loading/batches.py ``global_positions_of_steps``)."""
        source = self.checkpointer.resumed_from or "the checkpoint"
        check_global_batch(state, self.batch_size, self.ctx.world_size, source)
        step = int(state.get("step") or 0)
        if step == 0:
            return
        sums = state["epoch_sums"]
        # Rank 0 alone carries the steps already trained, so the epoch's all-reduce counts them once.
        keep = self.ctx.is_main
        self.start_step = step
        self.carried = {
            "loss": sums["loss"] if keep else 0.0,
            "rows": sums["rows"] if keep else 0,
            "coverage": tuple(sums["coverage"]) if keep else None,
        }

    def final_model(self) -> dict[str, Any]:
        """model.pt: the selected epoch's weights and what evaluation and serving need (``inference_checkpoint``)."""
        selection = self.selection.describe(self.epochs_done, self.config.epochs)
        selected = selection["selected_epoch"]
        metrics = next((line for line in self.history if line["epoch"] == selected), {})
        kept = self.best_weights if selected != self.epochs_done - 1 else None
        weights = kept if kept is not None else on_cpu(self.model.state_dict())
        encoders = read_encoders(self.job.dataset_dir, self.manifest)  # served with the model: raw rows in
        checkpoint = inference_checkpoint(
            weights, self.spec, self.manifest, self.epochs_done, metrics, encoders=encoders, selection=selection
        )
        return {**checkpoint, "objective": self.objective.describe()}


def _counted_from_1(epoch: int | None) -> str:
    return "none" if epoch is None else str(epoch + 1)


def on_cpu(tree: Any, copy: bool = False) -> Any:
    """Tensors moved to the CPU, so a checkpoint written on a GPU loads anywhere; ``copy``: fresh tensors and
    containers even where they already are on the CPU (a snapshot that later steps do not change)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=copy)
    if isinstance(tree, dict):
        return {key: on_cpu(value, copy) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(value, copy) for value in tree)
    return tree


if __name__ == "__main__":
    main()  # an error propagates from here: @record and the normal exit path report it
    exit_without_teardown()  # success: every file is closed and the group destroyed
