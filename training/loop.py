"""The step arithmetic of one rank: ``TrainStep`` (one micro-batch of the exact update) and
``evaluate`` (one exact validation pass). The epoch loop that calls them is ``Trainer.run_epoch``
(training/train.py).

Written for a DDP-wrapped model but never calling collectives itself: DDP
all-reduces gradients in ``backward``; the caller sums the returned
statistics over ranks.

The exact update: every optimizer step's gradient is the mean of the
per-row loss gradients over the real rows of the WHOLE global batch (all
ranks, all ``grad_accum`` micro-batches of the step; sampler padding
excluded), whatever the split size. Each rank backpropagates its loss SUM
times ``W / N``, N being those real rows (``TrainBatches.global_rows``, the
same number on every rank); DDP then averages over the W ranks:
``(1/W) * sum_r (W/N) * sum_{rows of r} grad = (1/N) * sum_{all rows} grad``.
So W ranks x batch b, one rank x batch W*b and grad_accum k x batch b/k take
the same steps, also when the last step of an epoch is short.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.loading import Batch, SplitTensors, TrainBatches
from training.nonfinite import NonFiniteStep


@dataclass(frozen=True)
class StepSettings:
    task: str  # "classification" | "regression"
    device: torch.device
    grad_accum: int = 1
    grad_clip: float | None = None
    bf16: bool = False  # autocast; only takes effect on CUDA

    def autocast(self):
        if self.bf16 and self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return nullcontext()


@dataclass(frozen=True)
class Sums:
    """Per-rank sums; the caller all-reduces them."""

    loss: float
    samples: int
    correct: float = 0.0


def per_sample_loss(outputs: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    outputs = outputs.float()  # the loss in fp32 also under bf16 autocast
    if task == "classification":
        return F.cross_entropy(outputs, labels, reduction="none")
    return F.mse_loss(outputs.reshape(labels.shape), labels, reduction="none")


def loss_sum(per_sample: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Sum over the batch's real rows (sampler padding has weight 0)."""
    if weights is None:
        return per_sample.sum()
    return (per_sample * weights).sum()


class TrainStep:
    """One micro-batch of the exact update (module docstring), called for micro-batches 0, 1, ... of an epoch.

    Micro-batches ``[k * grad_accum, (k + 1) * grad_accum)`` form optimizer step k (the epoch's last may be
    short); only the last of a step all-reduces (the others run under ``no_sync``), then the step clips,
    updates, zeroes the gradients and advances the schedule.
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
        self.on_update = on_update  # after each optimizer step (the per-step curves: training/metrics_sink.py)
        self._step_loss, self._step_rows = None, 0  # this rank's loss sum and rows of the optimizer step so far

    def __call__(self, index: int, batch: Batch) -> torch.Tensor:
        """Train micro-batch ``index``; returns its loss summed over real rows (float64, detached, on the device)."""
        group = self._optimizer_step_of(index)
        last_in_group = index == group[-1]
        # DDP averages over W ranks: W / (real rows of this optimizer step on all ranks) makes the
        # step's gradient the mean over its global batch (module docstring).
        scale = self.batches.world_size / self.batches.global_rows(group.start, group.stop)
        # Only the last micro-batch of a group all-reduces; the others accumulate locally.
        with nullcontext() if last_in_group else self.model.no_sync():
            with self.settings.autocast():
                outputs = self.model(batch.features)
            losses = per_sample_loss(outputs, batch.labels, self.settings.task)
            (loss_sum(losses, batch.weights) * scale).backward()
        weighted = losses.detach() if batch.weights is None else losses.detach() * batch.weights
        summed = weighted.sum(dtype=torch.float64)
        first = index == group.start
        self._step_loss = summed if first else self._step_loss + summed
        self._step_rows = batch.samples + (0 if first else self._step_rows)
        if last_in_group:
            self._update(group)
        return summed

    def _optimizer_step_of(self, index: int) -> range:
        """The micro-batches ``[first, stop)`` of micro-batch ``index``'s optimizer step."""
        accum = self.settings.grad_accum
        first = (index // accum) * accum
        return range(first, min(first + accum, len(self.batches)))

    def _update(self, group: range) -> None:
        """Check, clip, step. Raises ``NonFiniteStep`` (training/nonfinite.py) before a NaN or inf update."""
        if self.settings.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        else:
            norm = gradient_norm(self.model.parameters())
        # The step's one device->host copy: its loss sum and the (all-reduced) gradient norm together.
        loss, grad_norm = torch.stack([self._step_loss, norm.to(torch.float64)]).tolist()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteStep(group, loss, grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.on_update(StepReport(group.start // self.settings.grad_accum, loss, self._step_rows, grad_norm, lr))


@dataclass(frozen=True)
class StepReport:
    """One optimizer step on this rank: its index in the epoch, loss sum and real rows, gradient norm, lr."""

    index: int
    loss_sum: float
    rows: int
    grad_norm: float
    lr: float


def gradient_norm(parameters) -> torch.Tensor:
    """The global 2-norm of the gradients (what ``clip_grad_norm_`` computes), without clipping."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: clip_grad_norm_'s own (foreach) computation
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)


@torch.no_grad()
def evaluate(
    model: nn.Module, split: SplitTensors, start: int, stop: int, batch_size: int, settings: StepSettings
) -> Sums:
    """Sums over rows [start, stop) of ``split``: the caller gives each rank a disjoint, unpadded slice.

    ``model`` is the plain module (not DDP): ranks may run different numbers of
    batches here, and DDP's forward could enter a collective.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=settings.device)
    correct = torch.zeros((), dtype=torch.float64, device=settings.device)
    for first in range(start, stop, batch_size):
        last = min(stop, first + batch_size)
        features = split.features[first:last].to(settings.device, non_blocking=True)
        labels = split.labels[first:last].to(settings.device, non_blocking=True)
        with settings.autocast():
            outputs = model(features)
        loss_sum += per_sample_loss(outputs, labels, settings.task).sum(dtype=torch.float64)
        if settings.task == "classification":
            correct += (outputs.argmax(dim=-1) == labels).sum()
    model.train(was_training)
    return Sums(loss=loss_sum.item(), samples=stop - start, correct=correct.item())


def validation_metrics(loss_sum: float, correct: float, count: float, task: str) -> dict[str, float]:
    if count == 0:
        return {"val_samples": 0}
    metrics = {"val_loss": loss_sum / count, "val_samples": int(count)}
    if task == "classification":
        metrics["val_accuracy"] = correct / count
    else:
        metrics["val_rmse"] = math.sqrt(loss_sum / count)
    return metrics
