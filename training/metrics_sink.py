"""Rank 0's per-epoch metrics: ``RUN_DIR/metrics.jsonl`` and, when asked, an MLflow run.

MLflow is used only when ``DDPFLOW_MLFLOW_RUN_ID`` is set: for a plain
``torchrun`` launch that should log into a run someone created. Ranks never
create runs. ``mlflow`` is imported lazily, in rank 0 only, on a background
thread. The Prefect train task does not set it: its own process already has
MLflow loaded and mirrors metrics.jsonl itself (``tasks/tracking.py:
EpochMetricsFollower``), so no rank pays MLflow's import.

A resumed run (torchrun restart, task retry) does not log an epoch twice:
each destination remembers which epochs it already holds.
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from training.layout import METRICS

MLFLOW_RUN_ENV = "DDPFLOW_MLFLOW_RUN_ID"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"


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
    """metrics.jsonl is the record; MLflow is a mirror, fed from a background thread.

    Importing mlflow and opening its store costs rank 0 a few seconds; on the
    training thread that would stall every rank at the next collective. So the
    thread starts at once (overlapping data loading), logs epochs from a queue,
    and first backfills any epoch that metrics.jsonl has and the run lacks (a
    rank killed before its queue drained). ``close()`` drains it.
    """

    def __init__(self, run_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.logged = {record.get("epoch") for record in read_metrics_lines(self.path)} if enabled else set()
        run_id = os.environ.get(MLFLOW_RUN_ENV) if enabled else None
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self._mirror = None
        if run_id:
            self._mirror = threading.Thread(
                target=self._mirror_to_mlflow, args=(run_id,), name="mlflow-mirror", daemon=True
            )
            self._mirror.start()

    def log_epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if epoch not in self.logged:
            self._append({"epoch": epoch, **metrics})
            self.logged.add(epoch)
        if self._mirror is not None:
            self._queue.put((epoch, metrics))

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait until MLflow holds every epoch logged so far (the flow reads them right after)."""
        if self._mirror is not None and self._mirror.is_alive():
            self._queue.put(None)
            self._mirror.join(timeout_s)
            if self._mirror.is_alive():
                print(
                    f"[train] warning: MLflow logging did not finish within {timeout_s:.0f}s; metrics.jsonl has every epoch",
                    file=sys.stderr,
                    flush=True,
                )

    def _mirror_to_mlflow(self, run_id: str) -> None:
        run = MlflowEpochLogger(run_id, os.environ.get(TRACKING_URI_ENV))
        for record in read_metrics_lines(self.path):
            epoch = record.pop("epoch", None)
            if isinstance(epoch, int):
                run.log(epoch, record)
        while (item := self._queue.get()) is not None:
            run.log(*item)

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


class MlflowEpochLogger:
    """Logs epochs into an existing run, each at most once (step = epoch); a tracking failure is reported, never fatal."""

    def __init__(self, run_id: str, tracking_uri: str | None):
        from mlflow.tracking import MlflowClient  # lazily: only rank 0 of a tracked run pays the import

        self.run_id = run_id
        self.client = MlflowClient(tracking_uri)
        self.logged_steps = self._steps_already_logged()

    def _steps_already_logged(self) -> set[int]:
        try:
            return {metric.step for metric in self.client.get_metric_history(self.run_id, "train_loss")}
        except Exception as error:
            print(f"[train] warning: could not read MLflow run {self.run_id}: {error}", file=sys.stderr, flush=True)
            return set()

    def log(self, epoch: int, metrics: dict[str, Any]) -> None:
        if epoch in self.logged_steps:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key=key, value=float(value), timestamp=now, step=epoch)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(float(value))
        ]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
            self.logged_steps.add(epoch)
        except Exception as error:
            print(
                f"[train] warning: MLflow logging failed for epoch {epoch} (run {self.run_id}): {error}",
                file=sys.stderr,
                flush=True,
            )
