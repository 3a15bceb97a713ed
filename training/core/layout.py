"""Where each stage reads and writes: the on-disk contract between stages.

A prepared dataset:   <data.root>/<fingerprint>/manifest.json
                      <data.root>/<fingerprint>/{train,val,test}/part-NNNNN.parquet
A training run:       <train.run_root>/<run name>/
                          config.json          the PipelineConfig of the run
                          train_config.json    the job every rank reads (TrainJob)
                          metrics.jsonl        one line per epoch, from rank 0
                          steps.jsonl          train loss, lr, gradient norm every train.log_every_steps
                          checkpoints/last.pt  resumable state, after every epoch
                          checkpoints/step-e{E}-s{S}.pt  the same, S steps into epoch E (train.checkpoint_every_*)
                          model.pt             the selected epoch's weights + what inference needs
                          preempted.json       a preempted run's stop: signal, epoch, step, checkpoint (from rank 0)
                          eval/metrics.json    the evaluate stage's metrics
"""

from __future__ import annotations

from pathlib import Path

SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
CONFIG = "config.json"
TRAIN_JOB = "train_config.json"
METRICS = "metrics.jsonl"
STEP_METRICS = "steps.jsonl"
LAST_CHECKPOINT = "checkpoints/last.pt"
FINAL_MODEL = "model.pt"
PREEMPTED = "preempted.json"
EVAL_METRICS = "eval/metrics.json"


def manifest_path(dataset_dir: str | Path) -> Path:
    return Path(dataset_dir) / MANIFEST


def run_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / name
