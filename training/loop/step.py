"""One rank's pass over its micro-batches of an epoch, in one place: ``EpochPass`` (the micro-batch loop: the
batch, forward and backward, the optimizer step, what is due between two optimizer steps: a step checkpoint,
``StepSchedule``, or a stop, ``StopFlags``), ``TrainStep`` (one micro-batch of the exact update: forward,
backward and, on the last micro-batch of an optimizer step, the optimizer step), and ``validate`` (one exact
validation pass). ``Trainer.run_epoch`` (training/train.py) runs an ``EpochPass``, then validates; what the pass
counts and records (the rule of which micro-batches form an optimizer step, the epoch's sums, the progress lines
and the step curves) is training/loop/counting.py's.

Written for a DDP-wrapped model; the step never calls a collective itself: DDP all-reduces gradients in
``backward`` (the ranks' stop flags ride on it: ``StopFlags``); the caller sums the returned statistics over
ranks. The pass's only collective of its own is rank 0's clock, with ``train.checkpoint_every_s`` (``StepSchedule``).

The exact update: every optimizer step minimises the one loss contract
(training/objectives/registry.py)

    L = Σ_i w_i · ℓ_i / Σ_i w_i

over the real rows i of the WHOLE global batch (all ranks, all ``grad_accum``
micro-batches of the step; sampler padding has w = 0), ℓ_i the objective's
per-row loss and w_i the row's weight (its class weight, ``train.class_weights``;
1 without). Each rank backpropagates its weighted loss SUM times ``W / Σw``, Σw
being the weight of the step's real rows on ALL ranks
(``TrainBatches.global_weight``, the same number on every rank, computed
without a collective; ``global_rows`` when every row weighs 1); DDP then
averages over the W ranks:
``(1/W) * sum_r (W/Σw) * sum_{rows of r} w_i grad_i = (1/Σw) * sum_{all rows} w_i grad_i = grad L``.
So W ranks x batch b, one rank x batch W*b and grad_accum k x batch b/k take
the same steps, for every objective and weighting, also when the last step of
an epoch is short.

Step checkpoints (when, ``StepSchedule``): after an optimizer step (never between the micro-batches of one),
every ``train.checkpoint_every_steps`` optimizer steps of the run, and/or once ``train.checkpoint_every_s``
seconds passed since the last checkpoint by rank 0's clock (rank 0 decides and every rank learns it through a
one-number all-reduce per optimizer step, so all ranks enter the checkpoint's collectives together; the step
count needs no collective). Not after the epoch's last optimizer step: last.pt covers that. How one is
written is training/checkpoint/files.py's (``TrainState.save_step``).

A stop (``StopFlags``): every rank's preemption flag (training/loop/preemption.py: ``PreemptionWatch``) is
appended to the first gradient bucket of the step's all-reduce (training/distributed/context.py: GradientAllReduce), so
after each boundary every rank knows how many ranks were told (> 0: stop) without a collective of its own. Where
it is due, the pass writes that step's checkpoint whatever ``train.checkpoint_every_*`` says, and raises what
``on_stop`` returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from training.loading.batches import Batch, SplitTensors, TrainBatches, combined_row_weights
from training.loop.counting import EpochSums, OptimizerSteps, Progress, StepMetricsSink, StepReport
from training.loop.hooks import TrainHooks
from training.loop.nonfinite import NonFiniteStep
from training.loop.preemption import PreemptionWatch
from training.objectives.base import Objective, output_members
from training.objectives.registry import auto_objective, make_objective

if TYPE_CHECKING:
    from training.distributed.context import GradientAllReduce


@dataclass(frozen=True)
class StepSettings:
    task: str  # "classification" | "regression"
    device: torch.device
    grad_accum: int = 1
    grad_clip: float | None = None
    bf16: bool = False  # autocast; only takes effect on CUDA
    objective: Objective | None = None  # None: the default objective of ``task`` (auto)

    def loss(self) -> Objective:
        if self.objective is not None:
            return self.objective
        return make_objective(auto_objective(self.task), self.task, None)

    def autocast(self):
        if self.bf16 and self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return nullcontext()


class EpochPass:
    """This rank's micro-batches of an epoch, from the resumed one on (module docstring): each trained by ``step``
    and counted; between two optimizer steps, a step checkpoint (``save_step``, with the micro-batches done and
    the sums so far) when ``schedule`` says so, or a stop when ``stops`` says some rank was told (then the
    checkpoint, then ``on_stop``'s exception). ``hooks``: the test hooks' view of the micro-batches (None: they
    pass through untouched)."""

    def __init__(
        self,
        step: TrainStep,
        schedule: StepSchedule,
        stops: StopFlags,
        records: tuple[Progress, StepMetricsSink],
        save_step: Callable[[int, int, EpochSums], None],
        on_stop: Callable[[int, int], Exception],
        hooks: TrainHooks | None,
    ):
        self.step, self.schedule, self.stops, self.hooks = step, schedule, stops, hooks
        self.progress, self.curves = records
        self.save_step, self.on_stop = save_step, on_stop

    def run(self, epoch: int, start: int, carried: dict | None) -> EpochSums:
        """Micro-batches ``start`` .. of ``epoch`` (``carried``: the sums of those before ``start``)."""
        step = self.step
        sums = EpochSums(step.settings.device, carried)
        self.progress.start_epoch(epoch)
        self.curves.start_epoch(epoch)
        step.model.train()
        batches = step.batches.epoch(epoch, start)
        numbered = self.hooks.micro_batches(epoch, batches, start) if self.hooks else enumerate(batches, start)
        for index, batch in numbered:
            sums.add(batch, step(index, batch))  # forward, backward; on a step's last micro-batch, the update
            self.progress.step(index + 1, sums)
            stop = self.stops.due(index)  # the same answer on every rank: the flags came with the gradients
            if stop or self.schedule.due(epoch, index):
                self.save_step(epoch, index + 1, sums)
                self.schedule.written()
            if stop:
                raise self.on_stop(epoch, index + 1)
        return sums


class TrainStep:
    """One micro-batch of the exact update (module docstring), called for micro-batches 0, 1, ... of an epoch.

    Micro-batches ``[k * grad_accum, (k + 1) * grad_accum)`` form optimizer step k (the epoch's last may be
    short: ``steps``, training/loop/counting.py, the rule the pass reads too); only the last of a step
    all-reduces (the others run under ``no_sync``), then the step clips, updates, zeroes the gradients and
    advances the schedule.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        batches: TrainBatches,
        settings: StepSettings,
        on_update: Callable[[StepReport], None] = lambda _: None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.batches, self.settings = batches, settings
        self.steps = OptimizerSteps(settings.grad_accum, len(batches))  # which micro-batches step the optimizer
        self.on_update = on_update  # after each optimizer step (the per-step curves: training/loop/counting.py)
        # This rank's loss sum Σ w·ℓ, weight Σ w (device tensors) and real rows of the optimizer step so far.
        self._step_loss, self._step_weight, self._step_rows = None, None, 0
        self.objective = settings.loss()
        self.members = output_members(model)  # an ensemble's k: each member trains on its own loss
        # The parameters whose gradient norm each optimizer step checks, listed once: walking the module tree for
        # them every step cost more than the norm itself on a small model.
        self.parameters = list(model.parameters())

    def __call__(self, index: int, batch: Batch) -> torch.Tensor:
        """Train micro-batch ``index``; returns its weighted loss sum Σ w_i ℓ_i (float64, detached, on the device)."""
        group = self.steps.group(index)
        last_in_group = self.steps.steps_optimizer(index)
        # DDP averages over W ranks: W / (weight of this optimizer step's real rows on all ranks) makes
        # the step's gradient that of Σ w·ℓ / Σ w over its global batch (module docstring).
        scale = self.batches.world_size / self.batches.global_weight(group.start, group.stop)
        # Only the last micro-batch of a group all-reduces; the others accumulate locally.
        with nullcontext() if last_in_group else self.model.no_sync():
            with self.settings.autocast():
                outputs = self.model(batch.inputs)
            labels = self.objective.targets(batch.inputs, batch.labels)  # next_token: the rows' own tokens
            weighted = weighted_losses(self.objective.loss_of(outputs, labels, self.members), batch.weights)
            (weighted.sum() * scale).backward()
        summed = weighted.detach().sum(dtype=torch.float64)
        first = index == group.start
        self._step_loss = summed if first else self._step_loss + summed
        weight = (
            batch.weights.sum(dtype=torch.float64) if batch.weights is not None else summed.new_tensor(batch.samples)
        )
        self._step_weight = weight if first else self._step_weight + weight
        self._step_rows = batch.samples + (0 if first else self._step_rows)
        if last_in_group:
            self._update(group)
        return summed

    def _update(self, group: range) -> None:
        """Check, clip, step. Raises ``NonFiniteStep`` (training/loop/nonfinite.py) before a NaN or inf update."""
        if self.settings.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.settings.grad_clip)
        else:
            norm = gradient_norm(self.parameters)
        # The step's one device->host copy: its loss sum and the (all-reduced) gradient norm together.
        loss, weight, grad_norm = torch.stack([self._step_loss, self._step_weight, norm.to(torch.float64)]).tolist()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteStep(group, loss, grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        index = self.steps.step_of(group.start)
        self.on_update(StepReport(index, loss, self._step_rows, grad_norm, lr, weight))


class StepSchedule:
    """Whether a step checkpoint is due after micro-batch ``index`` (0-based) of an epoch: the same answer on
    every rank (module docstring). ``rank0_flag``: rank 0's bool on every rank (a collective)."""

    def __init__(
        self,
        every_steps: int | None,
        every_s: float | None,
        steps: OptimizerSteps,
        rank0_flag: Callable[[bool], bool],
    ):
        self.every_steps, self.every_s, self.steps, self.rank0_flag = every_steps, every_s, steps, rank0_flag
        self.last_at = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    def due(self, epoch: int, index: int) -> bool:
        if not self.enabled or not self.steps.boundary(index):
            return False
        due = self.every_steps is not None and self.steps.run_steps(epoch, index) % self.every_steps == 0
        if self.every_s is not None:
            due = self.rank0_flag(due or time.monotonic() - self.last_at >= self.every_s)
        return due

    def written(self) -> None:
        self.last_at = time.monotonic()


class StopFlags:
    """Whether some rank was told to stop: every rank's ``PreemptionWatch`` flag summed over the ranks. At each
    boundary the sum comes with the step's gradient all-reduce (``gradients``: training/distributed/
    context.py: ``GradientAllReduce``, the flags ride on bucket 0), so the step makes no collective for it; at an
    epoch's end ``requested`` sums the flags by a collective of its own."""

    def __init__(self, watch: PreemptionWatch, ctx, steps: OptimizerSteps, gradients: GradientAllReduce):
        self.watch, self.ctx, self.steps, self.gradients = watch, ctx, steps, gradients

    def due(self, index: int) -> bool:
        """After micro-batch ``index``: whether some rank was told to stop, the same answer on every rank. At a
        boundary, the flags the step's all-reduce carried (a collective of their own only where none ran)."""
        if not self.steps.boundary(index):
            return False
        carried = self.gradients.take_flags()
        return self.requested() if carried is None else carried > 0

    def requested(self) -> bool:
        """Any rank's flag, on every rank (every rank must call it at the same point)."""
        return self.ctx.all_reduce_int_sum([int(self.watch.signum is not None)])[0] > 0


def gradient_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of the gradients (what ``clip_grad_norm_`` computes, to the bit), without clipping: each
    gradient's norm, then the norm of those. On a GPU in one fused call (``get_total_norm``, foreach); on a CPU,
    where torch has no foreach kernel and takes the same per-gradient path, the norms directly: its grouping of
    the gradients by device and dtype first doubled the cost on a CPU step of a small model (117 µs against 57)."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if grads[0].device.type != "cpu" and hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)


def weighted_losses(per_row: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """w_i · ℓ_i per row (``Batch.weights``: the row's weight, 0 for sampler padding; None: every row 1)."""
    return per_row if weights is None else per_row * weights


@dataclass(frozen=True)
class ValidationPass:
    """One rank's share of validation: the tally's sums (all-reduced by the caller) and, where a metric ranks
    rows (two classes: ROC AUC, PR AUC), every row's score (gathered by the caller)."""

    sums: torch.Tensor  # float64, on the device
    scored: tuple | None = None  # (scores, is positive) numpy arrays; None: sums only


@torch.no_grad()
def validate(
    model: nn.Module, split: SplitTensors, start: int, stop: int, batch_size: int, settings: StepSettings
) -> ValidationPass:
    """The objective's tally (training/objectives/metrics.py) over rows [start, stop) of ``split``: the caller
    gives each rank a disjoint, unpadded slice, all-reduces the sums and gathers the scored rows.

    ``model`` is the plain module (not DDP): ranks may run different numbers of
    batches here, and DDP's forward could enter a collective.
    """
    objective = settings.loss()
    tally = objective.tally(objective.n_classes)
    members = output_members(model)  # an ensemble is scored by its one prediction, the mean of its members'
    was_training = model.training
    model.eval()
    for first in range(start, stop, batch_size):
        last = min(stop, first + batch_size)
        inputs = {
            name: tensor.to(settings.device, non_blocking=True) for name, tensor in split.rows(first, last).items()
        }
        labels = objective.targets(inputs, split.labels[first:last].to(settings.device, non_blocking=True))
        with settings.autocast():
            outputs = objective.prediction(model(inputs), members)
        tally.add(outputs.float(), labels, validation_weights(split, first, last, labels, objective))
    model.train(was_training)
    return ValidationPass(tally.sums().to(settings.device), tally.scored_rows())


def validate_pieces(model: nn.Module, pieces, batch_size: int, settings: StepSettings) -> ValidationPass:
    """``validate`` over (split, start, stop) pieces of one rank's slice (``SplitArrays.pieces``: the split whole;
    a streamed split: shard by shard), their sums added and their scored rows joined in order."""
    passes = [validate(model, split, start, stop, batch_size, settings) for split, start, stop in pieces]
    sums = torch.stack([one.sums for one in passes]).sum(dim=0)
    scored = [one.scored for one in passes if one.scored is not None]
    return ValidationPass(sums, tuple(np.concatenate(parts) for parts in zip(*scored)) if scored else None)


def validation_weights(
    split: SplitTensors, first: int, last: int, labels: torch.Tensor, objective: Objective
) -> torch.Tensor | None:
    """Rows [first, last)'s weights in val_loss: data.weight x class weight, as in training (``combined_row_weights``),
    so val_loss is Σ w·ℓ / Σ w over the val split; the other val metrics count rows (docs/models.md)."""
    data_weights = split.weights[first:last] if split.weights is not None else None
    class_weights = objective.row_weights(labels)
    weights = combined_row_weights(data_weights, None if class_weights is None else class_weights.cpu())
    return None if weights is None else weights.to(labels.device, non_blocking=True)


def validation_metrics(
    sums: list[float], settings: StepSettings, target_std: float = 1.0, scored: list[tuple] | None = None
) -> dict[str, float]:
    """``val_*`` from the all-reduced ``validate`` sums (and every rank's scored rows, in rank order, where the
    objective ranks them); losses on the target's original scale (``target_std``)."""
    objective = settings.loss()
    tally = objective.tally(objective.n_classes)
    total = torch.tensor(sums, dtype=torch.float64)
    count = tally.rows(total)
    if count == 0:
        return {"val_samples": 0}
    extra = {}
    if scored is not None:  # every rank's rows: the rank metrics (ROC AUC, PR AUC) see the whole val split
        extra["scored"] = tuple(np.concatenate(parts) for parts in zip(*scored))
    return {**tally.metrics(total, "val", target_std, **extra), "val_samples": count}
