"""The one mirror of epoch metrics into MLflow: rank 0's RUN_DIR/metrics.jsonl -> the pipeline's run.

Rank 0 only appends to metrics.jsonl (training/metrics_sink.py); no rank imports
MLflow. The process that launched torchrun follows the file and logs each epoch
into the run, once (step = epoch), whether the epoch came from this attempt, an
earlier one, or a torchrun restart.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric

from training.metrics_sink import read_metrics_lines

STEP_PROBE_METRIC = "train_loss"  # every epoch line has it: its history says which epochs the run holds

logger = logging.getLogger(__name__)


class EpochMetricsFollower:
    """Mirrors rank 0's RUN_DIR/metrics.jsonl into the pipeline's MLflow run, from the launching process.

    Why here and not in rank 0: this process already has MLflow loaded, while
    importing it in rank 0 costs seconds of CPU on rank 0's core, and every
    rank waits for rank 0 at the next collective. Why on a thread: a tracking
    server that is down makes MLflow retry for minutes, and the launcher's
    loop (timeouts, cancellation) must not wait for that. The train task
    calls ``poke()`` on every streamed line (it only sets an event) and
    ``close()`` once torchrun has exited, failed or not; ``close()`` catches up
    one last time. Each epoch lands once: epochs the run already holds (an
    earlier attempt's) are skipped.
    """

    def __init__(self, metrics_path: str | Path, run_id: str, tracking_uri: str):
        self.path = Path(metrics_path)
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._size_seen = -1
        self._logger: EpochLogger | None = None  # created on the first epoch: no MLflow call before then
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> EpochMetricsFollower:
        self._thread = threading.Thread(target=self._follow, name="metrics-to-mlflow", daemon=True)
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float = 60.0) -> None:
        """Log what is left, waiting at most ``timeout_s`` (metrics.jsonl has every epoch either way)."""
        if self._thread is None:
            self.catch_up()
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "MLflow run %s: epoch metrics not all logged within %.0f s; %s has them",
                self.run_id,
                timeout_s,
                self.path,
            )

    def _follow(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            last = self._closing  # read before catching up: a close() during it wakes us for one more pass
            self.catch_up()
            if last:
                return

    def catch_up(self) -> None:
        """Log every complete epoch line the run does not hold yet; never raises."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._size_seen:
            return
        self._size_seen = size
        try:
            for record in read_metrics_lines(self.path):  # a torn last line is skipped now, read on the next change
                epoch = record.pop("epoch", None)
                if isinstance(epoch, int):
                    if self._logger is None:
                        self._logger = EpochLogger(self.run_id, self.tracking_uri)
                    if not self._logger.log(epoch, record):
                        self._size_seen = -1  # the next pass tries that epoch again, even if the file is unchanged
        except Exception as error:
            self._size_seen = -1
            logger.warning("could not mirror %s into MLflow run %s: %s", self.path, self.run_id, error)


class EpochLogger:
    """Logs epochs into an existing run, each at most once (step = epoch); a failure is logged, never raised."""

    def __init__(self, run_id: str, tracking_uri: str):
        self.run_id = run_id
        self.client = MlflowClient(tracking_uri)
        self.logged_steps = self._steps_already_logged()

    def _steps_already_logged(self) -> set[int]:
        try:
            return {metric.step for metric in self.client.get_metric_history(self.run_id, STEP_PROBE_METRIC)}
        except Exception as error:
            logger.warning("could not read MLflow run %s: %s", self.run_id, error)
            return set()

    def log(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """True when the run holds the epoch (now or before)."""
        if epoch in self.logged_steps:
            return True
        now = int(time.time() * 1000)
        batch = [
            Metric(key=key, value=float(value), timestamp=now, step=epoch)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(float(value))
        ]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as error:
            logger.warning("MLflow logging failed for epoch %d (run %s): %s", epoch, self.run_id, error)
            return False
        self.logged_steps.add(epoch)
        return True
