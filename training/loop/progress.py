"""Rank 0's progress lines: at most one every ``train.progress_interval_s``, plus one per epoch.

The loss shown mid-epoch is rank 0's own running mean (no collective just to
print); samples/s is rank 0's rate times the world size. The epoch line shows
the exact, all-rank metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from training.core.log import log_rank

_EPOCH_KEYS = ("train_loss", "val_loss", "val_accuracy", "val_rmse")


def _eta(seconds: float) -> str:
    return str(timedelta(seconds=max(0, int(seconds))))


class Progress:
    def __init__(self, enabled: bool, interval_s: float, epochs: int, steps_per_epoch: int, world_size: int):
        self.enabled, self.interval_s = enabled, interval_s
        self.epochs, self.steps, self.world_size = epochs, steps_per_epoch, world_size
        self.epoch = 0
        self.started = self.last_print = time.monotonic()

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.started = self.last_print = time.monotonic()

    def step(self, done_steps: int, local_samples: int, loss: Callable[[], float]) -> None:
        """Call after each step; ``loss`` is only evaluated when a line is printed (it may sync the GPU)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last_print < self.interval_s:
            return
        self.last_print = now
        elapsed = now - self.started
        per_step = elapsed / max(1, done_steps)
        remaining = (self.steps - done_steps) + self.steps * (self.epochs - self.epoch - 1)
        rate = local_samples * self.world_size / max(elapsed, 1e-9)
        log_rank(
            f"epoch {self.epoch + 1}/{self.epochs} step {done_steps}/{self.steps} "
            f"loss {loss():.4f} {rate:,.0f} samples/s ETA {_eta(per_step * remaining)}"
        )

    def end_epoch(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        remaining_epochs = self.epochs - self.epoch - 1
        shown = " ".join(f"{key} {metrics[key]:.4f}" for key in _EPOCH_KEYS if key in metrics)
        if "selected_epoch" in metrics:  # counted from 1, as this line counts epochs (training/loop/selection.py)
            shown += f" selected epoch {metrics['selected_epoch'] + 1}"
        log_rank(
            f"epoch {self.epoch + 1}/{self.epochs} done: {shown} {metrics['train_samples_per_s']:,.0f} samples/s "
            f"{metrics['epoch_seconds']:.1f}s ETA {_eta(metrics['epoch_seconds'] * remaining_epochs)}"
        )
