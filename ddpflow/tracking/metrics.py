"""The one mirror of training metrics into MLflow: rank 0's RUN_DIR/metrics.jsonl and steps.jsonl (a training
script's: RUN_DIR/script/reports.jsonl) -> the pipeline's run.

Rank 0 only appends to the files (training/loop/counting.py: MetricsSink, StepMetricsSink); no rank imports
MLflow. The process that launched torchrun follows them and logs each epoch
into the run, once (step = epoch), whether the epoch came from this attempt, an
earlier one, or a torchrun restart; and each per-step line of steps.jsonl
(``step/train_loss``, ``step/lr``, ``step/grad_norm``, every
``train.log_every_steps`` optimizer steps) once, at step = the optimizer steps done,
so a long epoch shows a curve in the MLflow UI. Each epoch line also carries
``selected_epoch`` and that epoch's validation metrics (``selected_val_loss``...):
the run's latest values are the selection model.pt holds (training/loop/selection.py).

A training script's reports (``ddpflow.report``: ddpflow/script/reporting.py) land as they were made, each metric
at the report's step; several reports may share a step, so they are counted by line, not by step: the run's tag
``ddpflow.reports_mirrored`` holds how many lines it has, so a retried task does not log them twice.
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

from training.core.fileio import read_metrics_lines
from training.core.layout import SCRIPT_REPORTS, STEP_CURVES, STEP_KEY, STEP_METRICS

STEP_LR = STEP_CURVES[1]  # every step line has it (a line whose rank-0 rows were all padding has no loss)

STEP_PROBE_METRIC = "train_loss"  # every epoch line has it: its history says which epochs the run holds
REPORTS_MIRRORED_TAG = "ddpflow.reports_mirrored"  # a training script's report lines the run holds
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limit


class _Followed:
    """One file the follower mirrors: its lines' x axis (``key``) and the metric whose history says which
    points the run holds already (``probe``)."""

    def __init__(self, path: Path, key: str, probe: str, drop: tuple[str, ...] = ()):
        self.path, self.key, self.probe, self.drop = path, key, probe, drop
        self.size_seen = -1
        self.logger: EpochLogger | None = None  # created on the first line: no MLflow call before then


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
        self._files = [
            _Followed(self.path, "epoch", STEP_PROBE_METRIC),
            _Followed(self.path.with_name(STEP_METRICS), STEP_KEY, STEP_LR, drop=("epoch",)),
        ]
        self._reports = _Reports(self.path.parent / SCRIPT_REPORTS, run_id, tracking_uri)
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
        """Log every complete line (epoch, step, report) the run does not hold yet; never raises."""
        for followed in self._files:
            self._catch_up(followed)
        self._reports.catch_up()

    def _catch_up(self, followed: _Followed) -> None:
        try:
            size = followed.path.stat().st_size
        except FileNotFoundError:
            return
        if size == followed.size_seen:
            return
        followed.size_seen = size
        try:
            for record in read_metrics_lines(followed.path):  # a torn last line is skipped now, read on the next change
                point = record.pop(followed.key, None)
                for name in followed.drop:
                    record.pop(name, None)
                if isinstance(point, int):
                    if followed.logger is None:
                        followed.logger = EpochLogger(self.run_id, self.tracking_uri, followed.probe)
                    if not followed.logger.log(point, record):
                        followed.size_seen = -1  # the next pass tries that point again, even if the file is unchanged
        except Exception as error:
            followed.size_seen = -1
            logger.warning("could not mirror %s into MLflow run %s: %s", followed.path, self.run_id, error)


class _Reports:
    """A training script's RUN_DIR/script/reports.jsonl, mirrored line by line (module doc)."""

    def __init__(self, path: Path, run_id: str, tracking_uri: str):
        self.path, self.run_id, self.tracking_uri = path, run_id, tracking_uri
        self.size_seen = -1
        self.mirrored: int | None = None  # lines the run holds; read from its tag on the first line

    def catch_up(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self.size_seen:
            return
        try:
            client = MlflowClient(self.tracking_uri)
            if self.mirrored is None:
                self.mirrored = int(client.get_run(self.run_id).data.tags.get(REPORTS_MIRRORED_TAG, 0))
            lines = read_metrics_lines(self.path)  # a torn last line is skipped now, read on the next change
            metrics = [
                Metric(name, float(value), int(float(line.get("time", 0)) * 1000), int(line.get("step", 0)))
                for line in lines[self.mirrored :]
                for name, value in (line.get("metrics") or {}).items()
            ]
            for start in range(0, len(metrics), MAX_BATCH_METRICS):
                client.log_batch(self.run_id, metrics=metrics[start : start + MAX_BATCH_METRICS])
            if len(lines) > self.mirrored:
                client.set_tag(self.run_id, REPORTS_MIRRORED_TAG, str(len(lines)))
                self.mirrored = len(lines)
            self.size_seen = size
        except Exception as error:
            logger.warning("could not mirror %s into MLflow run %s: %s", self.path, self.run_id, error)


class EpochLogger:
    """Logs epochs (or steps) into an existing run, each at most once (step = epoch, or the optimizer step);
    a failure is logged, never raised. ``probe``: a metric every line has (its history: the points logged)."""

    def __init__(self, run_id: str, tracking_uri: str, probe: str = STEP_PROBE_METRIC):
        self.run_id, self.probe = run_id, probe
        self.client = MlflowClient(tracking_uri)
        self.logged_steps = self._steps_already_logged()

    def _steps_already_logged(self) -> set[int]:
        try:
            return {metric.step for metric in self.client.get_metric_history(self.run_id, self.probe)}
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
