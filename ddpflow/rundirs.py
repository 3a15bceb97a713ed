"""Run directories: one fresh, confined directory per run, and finding a run to resume.

``new_run_dir(run_root, name)`` -> ``<run_root>/<UTC YYYYmmdd-HHMMSS>-<sanitised name>``,
created atomically (``mkdir`` without ``exist_ok``), so two runs never share one;
a clash (same second, same name) gets a ``-2``, ``-3``... suffix.
Names come from flow parameters: anything but letters, digits, ``.``, ``_`` and ``-``
becomes ``-``, leading dots and dashes are dropped, so ``../x`` or ``/etc`` cannot leave run_root.

``find_resumable_run(run_root, fingerprint, config)``: the most recent run directory under run_root
  * that holds the same training: ``training_identity`` (training/checkpoint/identity.py, the one
    resume rule, which the checkpointer applies to last.pt too) of its config.json and
    dataset equals this config's and fingerprint's (a training script's: its file's sha256 among them),
  * whose training did not finish: ``checkpoints/last.pt`` or a step checkpoint exists (a training script's:
    anything it saved in ``checkpoints/``, ddpflow.checkpoint_dir()), or a Slurm job it recorded may
    still run (ddpflow/launch/slurm/launcher.py: ``has_unfinished_job``; the launch then reattaches to it),
    and neither ``model.pt`` nor a training script's ``script/done.json`` does,
  * and that no live launch holds (its ``.launch.lock`` flock is free).

``record_mlflow_run(run_dir, run_id)``: RUN_DIR/mlflow_run.json names the MLflow run that trains there
now, and returns the one before it (the run a resume continues), for the pipeline to link the two.
``resume_epoch(run_dir)``: the epoch (1-based) a re-run of the same config continues from.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddpflow.launch.slurm.launcher import has_unfinished_job
from ddpflow.launch.supervisor import is_locked
from training.checkpoint.files import step_checkpoints, step_position
from training.checkpoint.identity import training_identity
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write_json, read_metrics_lines
from training.core.layout import CONFIG, FINAL_MODEL, LAST_CHECKPOINT, METRICS, SCRIPT_DONE, TRAIN_JOB

MLFLOW_RUN_FILE = "mlflow_run.json"  # {"run_id": ...}: the MLflow run training in this directory
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 80


def sanitise_run_name(name: str) -> str:
    cleaned = _UNSAFE.sub("-", name).lstrip(".-")[:_MAX_NAME].rstrip(".-")
    return cleaned or "run"


def new_run_dir(run_root: str | os.PathLike, run_name: str) -> Path:
    """Create and return a new, unique directory for one run, inside run_root."""
    root = Path(run_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{sanitise_run_name(run_name)}"
    for attempt in range(1, 1000):
        candidate = root / (stem if attempt == 1 else f"{stem}-{attempt}")
        if candidate.parent != root:  # belt and braces: sanitising already prevents this
            raise ValueError(f"run name {run_name!r} would leave run_root {root}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise RuntimeError(f"could not create a unique run directory for {stem!r} under {root}")


def find_resumable_run(run_root: str | os.PathLike, fingerprint: str, config: PipelineConfig) -> Path | None:
    """The run directory a new launch of this config should resume, or None (see module doc)."""
    root = Path(run_root)
    if not root.is_dir():
        return None
    wanted = training_identity(config, fingerprint)
    for run_dir in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True):
        if not _started(run_dir, bool(config.train.script)) or _finished(run_dir):
            continue
        if run_identity(run_dir) == wanted and not is_locked(run_dir):
            return run_dir
    return None


def _started(run_dir: Path, script: bool) -> bool:
    """A checkpoint exists (a training script's: anything in checkpoints/, where it saves itself), or a Slurm job
    that may still run."""
    checkpoints = (run_dir / LAST_CHECKPOINT).parent
    if script:
        saved = checkpoints.is_dir() and any(checkpoints.iterdir())
    else:
        saved = (run_dir / LAST_CHECKPOINT).is_file() or bool(step_checkpoints(checkpoints))
    return saved or has_unfinished_job(run_dir)


def _finished(run_dir: Path) -> bool:
    """model.pt was written, or a training script's launch ended well (RUN_DIR/script/done.json)."""
    return (run_dir / FINAL_MODEL).exists() or (run_dir / SCRIPT_DONE).exists()


def record_mlflow_run(run_dir: str | os.PathLike, run_id: str) -> str | None:
    """Name ``run_id`` as the MLflow run training in RUN_DIR; returns the run named before it, if another."""
    path = Path(run_dir) / MLFLOW_RUN_FILE
    earlier = (_read_json(path) or {}).get("run_id")
    atomic_write_json(path, {"run_id": run_id})
    return str(earlier) if earlier and earlier != run_id else None


def resume_epoch(run_dir: str | os.PathLike) -> int | None:
    """The epoch (1-based) a re-run of the same config resumes RUN_DIR from; None when it would start over
    (no checkpoint yet) or has nothing left to train (model.pt written)."""
    run_dir = Path(run_dir)
    checkpoints = (run_dir / LAST_CHECKPOINT).parent
    steps = step_checkpoints(checkpoints)
    if (run_dir / FINAL_MODEL).exists() or not ((run_dir / LAST_CHECKPOINT).is_file() or steps):
        return None
    try:
        done = len({line["epoch"] for line in read_metrics_lines(run_dir / METRICS) if "epoch" in line})
    except (OSError, ValueError):
        done = 0
    positions = [position for position in map(step_position, steps) if position is not None]
    mid_epoch = max((epoch for epoch, _ in positions), default=-1)  # 0-based epoch of the newest step checkpoint
    return max(done, mid_epoch) + 1


def run_identity(run_dir: Path) -> dict[str, Any] | None:
    """``training_identity`` of the training a run directory holds; None when its files are unreadable."""
    job = _read_json(run_dir / TRAIN_JOB)
    saved = _read_json(run_dir / CONFIG)
    if job is None or saved is None:
        return None
    # The dataset directory is <data.root>/<fingerprint> (training/core/layout.py); none: a script without data.
    dataset_dir = job.get("dataset_dir")
    return training_identity(saved, Path(str(dataset_dir)).name if dataset_dir else None)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
