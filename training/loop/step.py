"""The step arithmetic of one rank: ``TrainStep`` (one micro-batch of the exact update) and
``evaluate`` (one exact validation pass). The epoch loop that calls them is ``Trainer.run_epoch``
(training/train.py).

Written for a DDP-wrapped model but never calling collectives itself: DDP
all-reduces gradients in ``backward``; the caller sums the returned
statistics over ranks.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from training.loading.batches import Batch, SplitTensors, TrainBatches, combined_row_weights
from training.loop.accumulation import OptimizerSteps
from training.loop.nonfinite import NonFiniteStep
from training.objectives.base import Objective, output_members
from training.objectives.registry import auto_objective, make_objective


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


class TrainStep:
    """One micro-batch of the exact update (module docstring), called for micro-batches 0, 1, ... of an epoch.

    Micro-batches ``[k * grad_accum, (k + 1) * grad_accum)`` form optimizer step k (the epoch's last may be
    short: ``steps``, training/loop/accumulation.py, the rule the loop reads too); only the last of a step
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
        self.on_update = on_update  # after each optimizer step (the per-step curves: training/loop/metrics_sink.py)
        # This rank's loss sum Σ w·ℓ, weight Σ w (device tensors) and real rows of the optimizer step so far.
        self._step_loss, self._step_weight, self._step_rows = None, None, 0
        self.objective = settings.loss()
        self.members = output_members(model)  # an ensemble's k: each member trains on its own loss

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
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        else:
            norm = gradient_norm(self.model.parameters())
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


@dataclass(frozen=True)
class StepReport:
    """One optimizer step on this rank: its index in the epoch, loss sum Σ w·ℓ and real rows, gradient norm, lr,
    and the weight Σ w of its real rows (the rows without data.weight or class weights; None: the rows)."""

    index: int
    loss_sum: float
    rows: int
    grad_norm: float
    lr: float
    weight: float | None = None


def gradient_norm(parameters) -> torch.Tensor:
    """The global 2-norm of the gradients (what ``clip_grad_norm_`` computes), without clipping."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: clip_grad_norm_'s own (foreach) computation
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
def evaluate(
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


def evaluate_pieces(model: nn.Module, pieces, batch_size: int, settings: StepSettings) -> ValidationPass:
    """``evaluate`` over (split, start, stop) pieces of one rank's slice (``SplitArrays.pieces``: the split whole;
    a streamed split: shard by shard), their sums added and their scored rows joined in order."""
    passes = [evaluate(model, split, start, stop, batch_size, settings) for split, start, stop in pieces]
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
    """``val_*`` from the all-reduced ``evaluate`` sums (and every rank's scored rows, in rank order, where the
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
