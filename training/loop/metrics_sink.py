"""Rank 0's per-epoch metrics: ``RUN_DIR/metrics.jsonl``, one JSON object per epoch; and its per-step
curves: ``RUN_DIR/steps.jsonl``, one line every ``train.log_every_steps`` optimizer steps.

The file is the record. Ranks never talk to MLflow: the process that launched
torchrun follows this file and mirrors each epoch into the pipeline's MLflow
run (``ddpflow/tracking/metrics.py: EpochMetricsFollower``), using
``read_metrics_lines`` below, so the rank and the mirror read the file one way.

A resumed run (torchrun restart, task retry) does not write an epoch (or a
step) twice: the sink remembers which ones the file already holds.

The step lines cost no collective and no device sync of their own: they use
the loss sum and gradient norm ``TrainStep`` copies to the host anyway
(``training/loop/step.py: StepReport``). The loss is rank 0's own (its rows of the
steps since the last line, like the progress lines); the gradient norm is
over all ranks (after the all-reduce), the mean of those steps; the lr is the
logged step's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.core.layout import METRICS, STEP_METRICS

if TYPE_CHECKING:  # the mirror reads these files without importing torch
    from training.loop.step import StepReport

STEP_KEY = "step"  # a step line's x axis: optimizer steps done in the run (1-based)
STEP_CURVES = ("step/train_loss", "step/lr", "step/grad_norm")  # its metrics (distinct from the epoch ones)


def read_metrics_lines(path: str | Path) -> list[dict[str, Any]]:
    """The epochs in a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsSink:
    """Appends each epoch to metrics.jsonl (rank 0 only: ``enabled``), fsynced, at most once per epoch."""

    def __init__(self, run_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.logged = {record.get("epoch") for record in read_metrics_lines(self.path)} if enabled else set()

    def log_epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        if not self.enabled or epoch in self.logged:
            return
        self._append({"epoch": epoch, **metrics})
        self.logged.add(epoch)

    def _append(self, record: dict[str, Any]) -> None:
        append_line(self.path, record)


class StepMetricsSink:
    """Appends a line to steps.jsonl every ``every`` optimizer steps (rank 0 only; ``every`` None: never)."""

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool,
        every: int | None,
        steps_per_epoch: int,
        loss_scale: Callable[[float], float] = lambda loss: loss,
    ):
        self.enabled = enabled and every is not None
        self.every, self.steps_per_epoch, self.loss_scale = every, steps_per_epoch, loss_scale
        self.path = Path(run_dir) / STEP_METRICS
        lines = read_metrics_lines(self.path) if self.enabled else []
        self.logged_through = max((line.get(STEP_KEY, 0) for line in lines), default=0)
        self.epoch = 0  # the epoch being trained: the loop sets it, ``add_step`` reports in it
        self._window()

    def _window(self) -> None:
        self.loss_sum, self.weight, self.norm_sum, self.count = 0.0, 0.0, 0.0, 0

    def add_step(self, report: StepReport) -> None:
        """``TrainStep``'s report of an optimizer step of the current ``epoch``."""
        self.add(self.epoch, report)

    def add(self, epoch: int, report: StepReport) -> None:
        if not self.enabled:
            return
        step = epoch * self.steps_per_epoch + report.index + 1
        # Σ w·ℓ / Σ w, the weighted mean the step optimises (a report without a weight: its rows weigh 1).
        weight = report.rows if report.weight is None else report.weight
        self.loss_sum, self.weight = self.loss_sum + report.loss_sum, self.weight + weight
        self.norm_sum, self.count = self.norm_sum + report.grad_norm, self.count + 1
        if step % self.every or step <= self.logged_through:
            return
        loss, lr, norm = STEP_CURVES
        record = {STEP_KEY: step, "epoch": epoch, lr: report.lr, norm: self.norm_sum / self.count}
        if self.weight:
            record[loss] = self.loss_scale(self.loss_sum / self.weight)
        append_line(self.path, record)
        self.logged_through = step
        self._window()


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, flushed and fsynced: a crash leaves at most a torn last line (``read_metrics_lines``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
