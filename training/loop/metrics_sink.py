"""Rank 0's per-epoch metrics: ``RUN_DIR/metrics.jsonl``, one JSON object per epoch; and the format of its
per-step curves, ``RUN_DIR/steps.jsonl`` (written by training/loop/counting.py: ``StepMetricsSink``).

The file is the record. Ranks never talk to MLflow: the process that launched
torchrun follows this file and mirrors each epoch into the pipeline's MLflow
run (``ddpflow/tracking/metrics.py: EpochMetricsFollower``), using
``read_metrics_lines`` below, so the rank and the mirror read the file one way.

A resumed run (torchrun restart, task retry) does not write an epoch twice:
the sink remembers which ones the file already holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from training.core.layout import METRICS

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


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, flushed and fsynced: a crash leaves at most a torn last line (``read_metrics_lines``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
