"""Which epoch's weights a run registers (``train.select``), and when training stops after an epoch: early stopping
(``train.early_stopping_patience``) or a sweep's pruner (a stop request).

Every epoch is judged by ``train.monitor`` (a validation metric, default ``val_loss``),
better lower or higher by ``train.monitor_mode`` or, on ``auto``, by the gate's rule on
the metric's name (``training/core/directions.py``). An epoch improves when it beats the best
so far by more than ``train.min_delta`` (a NaN never improves): ``is_better``, the one rule of improvement,
which the champion gate applies to its metric too (ddpflow/tracking/gate.py, ``registry.min_delta``).

- ``select: best`` (default): model.pt holds the weights of the best epoch; ``last``:
  those of the last epoch trained.
- Early stopping (on by default: ``train.early_stopping_patience: auto`` is ``DEFAULT_PATIENCE`` epochs where
  there is a val split): after ``patience`` epochs in a row without improvement, training ends normally
  (model.pt, with the best epoch's weights under ``select: best``, metrics, registration).

Every rank runs the same ``Selection`` on the same metrics: validation is summed over
all ranks (``Trainer.run_epoch``), so each rank computes the same numbers bit for bit and
takes the same decision, with no collective of its own; no rank waits in a collective
the others have left. What it has decided so far is in last.pt (``state_dict``), so a
resume keeps the best epoch and the patience count.

A stop request: a stop that every rank obeys at the same epoch boundary, asked for from outside the ranks (a
sweep's pruner). The process that launched the ranks (``ddpflow/sweep/pruning.py``) reads each epoch's line of
metrics.jsonl, asks its pruner, and answers with a verdict file, ``RUN_DIR/verdicts/epoch-<n>`` holding ``stop``
or ``continue``. The directory exists only when such a process follows the run (it creates it before the
launch), and every rank sees it (RUN_DIR is shared, as checkpoints need): without it nothing is waited for and no
collective runs. With it, rank 0 waits for the epoch's verdict (up to ``VERDICT_WAIT_S``; no verdict by then
means continue) and the flag is all-reduced (``stop_requested``), so every rank leaves after the same epoch and
none runs ahead into a collective the others have left. The Trainer then ends as after early stopping: model.pt
holds the selected epoch's weights. A training script's trial has no epochs of ddpflow's own: its stop is one
file its ``ddpflow.should_stop()`` reads (``write_stop``, ``stop_written``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.core.fileio import atomic_write_text

if TYPE_CHECKING:
    from training.core.config import TrainConfig
    from training.distributed.context import DistContext

SELECTED_PREFIX = "selected_"  # the selected epoch's validation metrics, on every metrics.jsonl line


@dataclass
class Selection:
    select: str
    monitor: str
    higher_is_better: bool
    min_delta: float = 0.0
    patience: int | None = None
    best_epoch: int | None = None
    best_value: float | None = None
    epochs_without_improvement: int = 0
    stopped: bool = False

    @classmethod
    def from_config(cls, train: TrainConfig) -> Selection:
        # patience auto: DEFAULT_PATIENCE, whatever the val split (without one, no epoch is judged, none stops it).
        return cls(
            train.select, train.monitor, train.monitor_higher_is_better(), train.min_delta, train.patience(1),
        )  # fmt: skip

    @property
    def keeps_best_weights(self) -> bool:
        return self.select == "best"

    def observe(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """Judge ``epoch`` by its validation ``metrics``; True when it is the new best. Without a val split
        nothing is judged: the last epoch is selected (the preflight refuses early stopping then)."""
        if metrics.get("val_samples") == 0:
            return False
        if self.monitor not in metrics:
            available = sorted(name for name in metrics if name.startswith("val_"))
            raise ValueError(
                f"train.monitor={self.monitor!r} is not a validation metric of this run; it has {available}"
            )
        value = float(metrics[self.monitor])
        improved = (self.best_value is None and math.isfinite(value)) or (
            self.best_value is not None and is_better(value, self.best_value, self.higher_is_better, self.min_delta)
        )
        if improved:
            self.best_epoch, self.best_value, self.epochs_without_improvement = epoch, value, 0
        else:
            self.epochs_without_improvement += 1
        if self.patience is not None and self.epochs_without_improvement >= self.patience:
            self.stopped = True
        return improved

    def selected_epoch(self, last_epoch: int) -> int:
        """The epoch model.pt holds: the best one (the last when none had a finite monitor), or the last."""
        if self.select == "best" and self.best_epoch is not None:
            return self.best_epoch
        return last_epoch

    def selected_metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """``selected_epoch`` and the selected epoch's validation metrics (``selected_val_loss``...), for
        metrics.jsonl: the mirror puts them in the MLflow run as every epoch lands."""
        last = history[-1]["epoch"]
        selected = self.selected_epoch(last)
        record = next(line for line in history if line["epoch"] == selected)
        values = {SELECTED_PREFIX + name: value for name, value in record.items() if name.startswith("val_")}
        return {"selected_epoch": selected, **values}

    def describe(self, epochs_trained: int, epochs: int) -> dict[str, Any]:
        """What model.pt says about its choice."""
        return {
            **self.state_dict(),
            "selected_epoch": self.selected_epoch(epochs_trained - 1),
            "epochs_trained": epochs_trained,
            "epochs": epochs,
            "stopped_early": self.stopped and epochs_trained < epochs,
        }

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The decisions so far (last.pt); the settings stay this run's (the resume rule made them equal)."""
        if not state:
            return
        self.best_epoch, self.best_value = state["best_epoch"], state["best_value"]
        self.epochs_without_improvement, self.stopped = state["epochs_without_improvement"], state["stopped"]


def selection_summary(last_line: dict[str, Any], train: TrainConfig) -> dict[str, Any] | None:
    """What the run's summary says about the selection, from metrics.jsonl's last line (the train stage's
    result); None for a run without one."""
    if "selected_epoch" not in last_line or "epoch" not in last_line:
        return None
    return {
        "select": train.select,
        "monitor": train.monitor,
        "selected_epoch": last_line["selected_epoch"],
        "value": last_line.get(SELECTED_PREFIX + train.monitor),
        "epochs_trained": last_line["epoch"] + 1,
        "epochs": train.epochs,
    }


def describe_selection(summary: dict[str, Any]) -> str:
    """One line for people, epochs counted from 1 as the progress lines do: "epoch 4 of 14 (best val_loss
    0.2315); stopped early, 60 planned"."""
    value = summary.get("value")
    shown = f" {value:.4g}" if isinstance(value, (int, float)) else ""
    line = (
        f"epoch {summary['selected_epoch'] + 1} of {summary['epochs_trained']} "
        f"({summary['select']} {summary['monitor']}{shown})"
    )
    if summary["epochs_trained"] < summary["epochs"]:
        line += f"; stopped early, {summary['epochs']} planned"
    return line


def is_better(candidate: float, reference: float, higher_is_better: bool, min_delta: float) -> bool:
    """``candidate`` beats ``reference`` by more than ``min_delta``; a NaN never beats anything."""
    if not math.isfinite(candidate):
        return False
    return candidate > reference + min_delta if higher_is_better else candidate < reference - min_delta


VERDICTS = "verdicts"
STOP, CONTINUE = "stop", "continue"
VERDICT_WAIT_S = 120.0
POLL_S = 0.05


def verdicts_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / VERDICTS


def verdict_path(run_dir: str | os.PathLike, epoch: int) -> Path:
    return verdicts_dir(run_dir) / f"epoch-{epoch}"


def write_verdict(run_dir: str | os.PathLike, epoch: int, stop: bool) -> Path:
    """The launching process's answer for ``epoch`` (0-based), written atomically."""
    return atomic_write_text(verdict_path(run_dir, epoch), STOP if stop else CONTINUE, durable=False)


def read_verdict(run_dir: str | os.PathLike, epoch: int, wait_s: float) -> bool | None:
    """True: stop, False: continue, None: no verdict within ``wait_s``."""
    path, deadline = verdict_path(run_dir, epoch), time.monotonic() + wait_s
    while True:
        try:
            return path.read_text().strip() == STOP
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)


TRIAL_STOP = "stop"  # a training script's trial: stop at the script's next should_stop() (ddpflow/script/)


def write_stop(run_dir: str | os.PathLike) -> Path:
    """Stop a training script's trial at its next ``ddpflow.should_stop()``: it has no epochs of ddpflow's own."""
    return atomic_write_text(verdicts_dir(run_dir) / TRIAL_STOP, STOP, durable=False)


def stop_written(run_dir: str | os.PathLike) -> bool:
    """Whether ``write_stop`` stopped this run."""
    return (verdicts_dir(run_dir) / TRIAL_STOP).is_file()


def stop_requested(run_dir: str | os.PathLike, epoch: int, ctx: DistContext, wait_s: float = VERDICT_WAIT_S) -> bool:
    """After ``epoch``'s metrics line: whether every rank stops here (the same answer on every rank)."""
    if not verdicts_dir(run_dir).is_dir():
        return False
    local = int(bool(read_verdict(run_dir, epoch, wait_s))) if ctx.is_main else 0
    return ctx.all_reduce_int_sum([local])[0] > 0
