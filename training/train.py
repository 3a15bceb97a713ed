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
and writes is in ``training/core/layout.py``; the resume rule in ``training/checkpoint/identity.py``;
test hooks (``DDPFLOW_FAULT``, ``DDPFLOW_RECORD_INDICES``) in ``training/loop/hooks.py``.

The file reads in the order a rank runs: ``main`` joins the process group and
runs ``Trainer(job, ctx, hooks).train()``; the Trainer's constructor builds
the rank's parts in named steps (the process, the data, the model, the data's
place and batches, the optimizer and the resumable state, then resume or per-rank seeds); ``train``
and ``run_epoch`` are the loop. What last.pt and a step checkpoint hold is
``training/checkpoint/files.py: TrainState``'s (``self.state``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from training.checkpoint.files import Checkpointer, TrainState, on_cpu
from training.core.fileio import DATA, log_main, log_rank
from training.core.job import TrainJob
from training.core.manifest import read_manifest
from training.core.rng import seed_process
from training.distributed.context import DistContext, GradientAllReduce, distributed, shard_range, wrap_model
from training.distributed.process import (
    configure_process,
    decode_workers,
    die_with_parent,
    exit_without_teardown,
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
from training.loading.stream import open_stream
from training.loop.counting import Certificate, MetricsSink, OptimizerSteps, Progress, StepMetricsSink
from training.loop.hooks import TrainHooks, hooks_from_env
from training.loop.nonfinite import NonFiniteStep, non_finite_error
from training.loop.optim import build_optimizer, build_schedule, optimizer_states_per_parameter
from training.loop.preemption import Preempted, PreemptionWatch
from training.loop.selection import stop_requested
from training.loop.step import (
    EpochPass,
    StepSchedule,
    StepSettings,
    StopFlags,
    TrainStep,
    validate_pieces,
    validation_metrics,
)
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
        self,
        job: TrainJob,
        ctx: DistContext,
        hooks: TrainHooks | None = None,
        preemption: PreemptionWatch | None = None,
    ):
        self.job, self.ctx, self.hooks = job, ctx, hooks  # hooks: a test's (loop/hooks.py), None in a user's run
        self.preemption = preemption or PreemptionWatch()  # none installed: never preempted
        self.config = job.config.train
        writes = (hooks.before_checkpoint_write, hooks.after_checkpoint_write) if hooks else ()
        self.checkpointer = Checkpointer(job.run_dir, ctx, *writes, keep_steps=self.config.keep_checkpoints)
        self.sink = MetricsSink(job.run_dir, enabled=ctx.is_main)
        self._configure_process()
        train_split = self._load_data()
        saved = self._build_model()
        if hooks:
            hooks.on_model(self.model)
        self._place_data(train_split)
        self._build_optimizer()
        self.state.resume_or_seed(saved)

    # --- the constructor's steps, in order ---------------------------------------------------------------

    def _configure_process(self) -> None:
        """Threads and cores, CUDA math modes, the all-reduce's wait (``distributed/process.py: configure_process``)."""
        ctx = self.ctx
        self.process = configure_process(self.config, ctx)
        log_main(
            ctx.is_main,
            f"{ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device.type}, {self.process.describe()}",
        )

    def _load_data(self) -> Any:
        """The manifest, then train and val from the node cache (built once per node, mapped by every local rank),
        or, with ``data.stream``, their shards streamed through the node's bounded cache (loading/stream.py)."""
        self.manifest = read_manifest(self.job.dataset_dir)
        self.normaliser = Normaliser.from_manifest(self.manifest)  # reports losses on the target's own scale
        self.stream = open_stream(self.job.dataset_dir, self.manifest, self.job.config.data, self.ctx)
        if self.stream is not None:
            self.val = self.stream.val
            return None
        loaded_at = time.monotonic()
        cached = open_splits(self.job.dataset_dir, self.manifest, ("train", "val"), self.job.config.data.cache_dir)
        for split in cached.values():
            log_rank(f"rank {self.ctx.rank}: {split.describe()}", DATA)  # each rank says how it got its splits
        train_split, self.val = cached["train"].tensors, cached["val"].tensors
        log_main(
            self.ctx.is_main,
            f"loaded {len(train_split)} train / {len(self.val)} val rows of "
            f"{describe_inputs(inputs_from_manifest(self.manifest))} inputs "
            f"in {time.monotonic() - loaded_at:.1f}s",
        )
        return train_split

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
        self.allreduce = GradientAllReduce(self.process.poll_allreduce, self.preemption)  # the flags ride on it
        self.ddp = wrap_model(self.model, self.ctx, self.allreduce, train.sync_batchnorm)  # trains
        return saved

    def _place_data(self, train_split) -> None:
        """Each split on the device or the host (``train.data_on_device``), then this rank's batches.

        After the model: ``auto`` places a split on a GPU by the memory free once the model is there."""
        train, ctx = self.config, self.ctx
        rows, self.val_rows = self.manifest.rows("train"), self.manifest.rows("val")
        self.batch_size = train.rank_batch_size(ctx.world_size, rows)  # train.batch_size, or the global one / W
        self.val_batch_size = train.rank_val_batch_size(ctx.world_size, rows)  # bounds validation's memory
        if self.stream is not None:  # windows on the host, each batch copied over; decoded in the rank
            self.batches = self.stream.batches(
                ctx, self.batch_size, train.seed, self.objective.split_row_weights, self._reorder()
            )
            self.expected_coverage = Certificate.expected(rows)
            return
        placed, where = place_splits(
            {"train": train_split, "val": self.val},
            train.data_on_device,
            ctx.device,
            self.model,
            optimizer_states_per_parameter(train),
        )
        train_split, self.val = placed["train"], placed["val"]  # a host copy placed elsewhere is let go
        log_main(ctx.is_main, "data: " + "; ".join(where) + f"; validation in batches of {self.val_batch_size} rows")
        self.batches = TrainBatches(
            train_split, ctx.rank, ctx.world_size, self.batch_size, train.seed, ctx.device, train.pin_memory,
            row_weights=self.objective.split_row_weights(train_split), num_workers=self._decode_workers(),
            reorder=self._reorder(),
        )  # fmt: skip
        self.expected_coverage = Certificate.expected(rows)  # each row once per epoch

    def _reorder(self):
        """A test hook's view of the rank's epoch order (``TrainHooks.epoch_rows``); None: the sampler's."""
        return self.hooks.epoch_rows if self.hooks else None

    def _decode_workers(self) -> int:
        """train.num_workers resolved for this rank, its threads shrunk to make room (distributed/process.py)."""
        decodes = any(CODECS[info.kind].decodes_in_workers for info in inputs_from_manifest(self.manifest).values())
        workers = decode_workers(self.config.num_workers, self.process.cpu, self.ctx.device.type == "cuda", decodes)
        self.process = self.process.with_workers(workers, self.config)
        log_main(self.ctx.is_main, f"{workers} decode worker(s) per rank; {self.process.cpu.describe()}")
        return workers

    def _build_optimizer(self) -> None:
        """The optimizer and its schedule over every optimizer step of the run (training/loop/optim.py), the
        step, the epoch's pass that runs it (training/loop/step.py) and its records, and the resumable state."""
        train, ctx = self.config, self.ctx
        optimizer = build_optimizer(self.model, train)
        steps = OptimizerSteps(train.grad_accum, len(self.batches))
        scheduler = build_schedule(optimizer, train, train.epochs * steps.optimizer_steps)
        self.state = TrainState(
            self.job.config, self.manifest.fingerprint, ctx, self.checkpointer, self.model, optimizer, scheduler,
            self.batch_size,
        )  # fmt: skip
        self.progress = Progress(
            ctx.is_main, train.progress_interval_s, train.epochs, steps.micro_batches, ctx.world_size,
            self._loss_scale(),
        )  # fmt: skip
        curves = StepMetricsSink(
            self.job.run_dir, ctx.is_main, train.log_every_steps, steps.optimizer_steps, self._loss_scale()
        )
        settings = StepSettings(
            self.manifest.task, ctx.device, train.grad_accum, train.grad_clip, train.bf16, self.objective
        )
        self.train_step = TrainStep(self.ddp, optimizer, scheduler, self.batches, settings, curves.add_step)
        self.stops = StopFlags(self.preemption, ctx, steps, self.allreduce)
        schedule = StepSchedule(train.checkpoint_every_steps, train.checkpoint_every_s, steps, ctx.rank0_flag)
        self.epoch_pass = EpochPass(
            self.train_step, schedule, self.stops, (self.progress, curves), self.state.save_step, self._stopped,
            self.hooks,
        )  # fmt: skip

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
        position, selection = self.state.position, self.state.selection
        for epoch in range(position.epochs_done, self.config.epochs):
            if selection.stopped:  # a resume after the stop: nothing left to train
                break
            metrics = self.run_epoch(epoch)
            self._judge(epoch, metrics)
            record = position.end_epoch(epoch, metrics)
            record.update(selection.selected_metrics(position.history))  # selected_epoch, selected_val_*
            self.sink.log_epoch(epoch, record)
            self.state.save_last()
            self.progress.end_epoch(record)
            if epoch + 1 < self.config.epochs and self.stops.requested():  # last.pt is the checkpoint
                raise self._stopped(epoch + 1, 0)
            if epoch + 1 < self.config.epochs and stop_requested(self.job.run_dir, epoch, self.ctx):
                log_main(self.ctx.is_main, f"stopped after epoch {epoch + 1}: the sweep's pruner asked for it")
                break
        self.checkpointer.save_final(self.final_model() if self.ctx.is_main else {})
        log_main(self.ctx.is_main, f"wrote {self.checkpointer.final_path} ({self._selection_line()})")

    def _judge(self, epoch: int, metrics: dict[str, Any]) -> None:
        """train.monitor decides (the same on every rank: training/loop/selection.py); rank 0 keeps the best weights."""
        selection = self.state.selection
        if selection.observe(epoch, metrics) and selection.keeps_best_weights:
            self.state.best.keep(self.model)
        if selection.stopped:
            log_rank(
                f"rank {self.ctx.rank}: early stopping after epoch {epoch + 1}/{self.config.epochs}: "
                f"{selection.monitor} has not improved for {selection.epochs_without_improvement} epoch(s) "
                f"(best {selection.best_value} in epoch {_counted_from_1(selection.best_epoch)})"
            )

    def _selection_line(self) -> str:
        """Which epoch model.pt holds, counted from 1 as the progress lines count epochs."""
        selection, done = self.state.selection, self.state.position.epochs_done
        selected = selection.selected_epoch(done - 1)
        stopped = ", stopped early" if selection.stopped and done < self.config.epochs else ""
        return (
            f"the weights of epoch {selected + 1} of {done} trained (select {selection.select} by "
            f"{selection.monitor}{stopped})"
        )

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        """Train this rank's share of ``epoch``, then validate; every figure returned is over all ranks."""
        started = time.monotonic()
        sums = self._train_pass(epoch)
        train_seconds = time.monotonic() - started
        if self.hooks:
            self.hooks.end_epoch(epoch)
        weight = self.batches.global_weight(0, len(self.batches))  # the epoch's Σ w, all ranks (train_loss)
        trained = sums.all_reduced(self.ctx)
        coverage = self._check_coverage(epoch, trained)
        val = self._validate(epoch)
        return {
            "train_loss": self._loss_scale() * trained["loss"] / weight,
            "train_samples": trained["rows"],
            "train_samples_per_s": trained["rows"] / max(train_seconds, 1e-9),
            **val,
            "epoch_seconds": time.monotonic() - started,
            "lr": self.train_step.optimizer.param_groups[0]["lr"],
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "world_size": self.ctx.world_size,
            "weights_in_sync": self.ctx.weights_agree(self.model),
            **coverage.metrics(),
        }

    def _train_pass(self, epoch: int):
        """This rank's micro-batches of ``epoch`` (training/loop/step.py: ``EpochPass``), from the resumed one on
        (0 unless a step checkpoint; the sums of the micro-batches before it come from the checkpoint)."""
        start, carried = self.state.position.take_start()
        try:
            return self.epoch_pass.run(epoch, start, carried)
        except NonFiniteStep as bad:
            raise self._non_finite(epoch, bad) from None

    def _stopped(self, epoch: int, micro_batches: int) -> Preempted:
        """The stop once every rank saved after ``micro_batches`` of ``epoch`` (training/loop/preemption.py)."""
        return self.preemption.stopped(self.checkpointer, self.ctx, epoch, micro_batches, self.job.run_dir)

    def _loss_scale(self) -> float:
        """Losses on the target's original scale (mse: times std², exact; other objectives: as trained)."""
        return self.normaliser.target_std**self.objective.loss_scale_power

    def _check_coverage(self, epoch: int, trained: dict[str, Any]) -> Certificate:
        """The ranks trained every row of the train split exactly once (``CoverageError`` naming the epoch)."""
        rows = self.expected_coverage.rows  # the train split's
        if trained["rows"] != rows:
            raise RuntimeError(f"epoch {epoch}: ranks trained on {trained['rows']} rows, the train split has {rows}")
        coverage = Certificate.from_lanes(*trained["coverage"])
        coverage.check(self.expected_coverage, epoch)
        return coverage

    def _validate(self, epoch: int) -> dict[str, Any]:
        """One exact validation pass: each rank its shard of the val split, the sums all-reduced once."""
        ctx, rows, settings = self.ctx, self.val_rows, self.train_step.settings
        start, stop = shard_range(rows, ctx.rank, ctx.world_size)
        val_pass = validate_pieces(self.model, self.val.pieces(start, stop), self.val_batch_size, settings)
        scored = ctx.gather_objects(val_pass.scored) if val_pass.scored is not None else None  # 2 classes: AUCs
        sums = ctx.all_reduce_sum(val_pass.sums.unbind())
        val = validation_metrics(sums, settings, self.normaliser.target_std, scored)
        if val["val_samples"] != rows:
            raise RuntimeError(f"epoch {epoch}: validation covered {val['val_samples']} rows, the val split has {rows}")
        return val

    def _non_finite(self, epoch: int, bad: NonFiniteStep) -> Exception:
        """The error for a NaN or inf step (training/loop/nonfinite.py). When the gradient norm is non-finite every
        rank is here at the same step, so they can gather whose loss was non-finite and name the same ranks."""
        losses_ok = self.ctx.gather_objects(math.isfinite(bad.loss)) if bad.everywhere else None
        loss_ranks = None if losses_ok is None else [rank for rank, ok in enumerate(losses_ok) if not ok]
        return non_finite_error(bad, self.ctx.rank, epoch, loss_ranks)

    def final_model(self) -> dict[str, Any]:
        """model.pt: the selected epoch's weights and what evaluation and serving need (``inference_checkpoint``)."""
        done, history = self.state.position.epochs_done, self.state.position.history
        selection = self.state.selection.describe(done, self.config.epochs)
        selected = selection["selected_epoch"]
        metrics = next((line for line in history if line["epoch"] == selected), {})
        kept = self.state.best.weights if selected != done - 1 else None
        weights = kept if kept is not None else on_cpu(self.model.state_dict())
        encoders = read_encoders(self.job.dataset_dir, self.manifest)  # served with the model: raw rows in
        checkpoint = inference_checkpoint(
            weights, self.spec, self.manifest, done, metrics, encoders=encoders, selection=selection
        )
        return {**checkpoint, "objective": self.objective.describe()}


def _counted_from_1(epoch: int | None) -> str:
    return "none" if epoch is None else str(epoch + 1)


if __name__ == "__main__":
    main()  # an error propagates from here: @record and the normal exit path report it
    exit_without_teardown()  # success: every file is closed and the group destroyed
