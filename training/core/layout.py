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
A training script's run (train.script, docs/scripts.md), besides config.json, train_config.json and logs/:
                          checkpoints/         ddpflow.checkpoint_dir(): the script's own snapshots
                          script/reports.jsonl ddpflow.report()'s lines, from rank 0
                          script/model.pt2     ddpflow.log_model()'s torch.export program (+ example.pt)
                          script/model_refused.json  why ddpflow.log_model() could not export the model
                          script/done.json     the launch ended well (the run is finished, not resumable)
A scoring's output:   <score.output>/part-NNNNN.parquet   the scores (training/inference/batch_scoring.py)
                          manifest.json        written last: every row scored once
                          rejects/             the rows score.on_invalid skipped
                          .score/              what the ranks read (plan.json, model.pt, job.json), the lock, logs/
"""

from __future__ import annotations

from pathlib import Path

SPLITS = ("train", "val", "test")
# A user's training script (train.script) takes its own arguments, so its ranks find their job (TRAIN_JOB's path)
# through this environment variable.
JOB_ENV = "DDPFLOW_JOB"
MANIFEST = "manifest.json"
CONFIG = "config.json"
TRAIN_JOB = "train_config.json"
METRICS = "metrics.jsonl"
STEP_METRICS = "steps.jsonl"
STEP_KEY = "step"  # a steps.jsonl line's x axis: optimizer steps done in the run (1-based)
STEP_CURVES = ("step/train_loss", "step/lr", "step/grad_norm")  # its metrics (distinct from the epoch ones)
LAST_CHECKPOINT = "checkpoints/last.pt"
FINAL_MODEL = "model.pt"
PREEMPTED = "preempted.json"
EVAL_METRICS = "eval/metrics.json"
CHECKPOINTS = "checkpoints"
SCRIPT_REPORTS = "script/reports.jsonl"
SCRIPT_PROGRAM = "script/model.pt2"
SCRIPT_EXAMPLE = "script/example.pt"
SCRIPT_REFUSED = "script/model_refused.json"
SCRIPT_DONE = "script/done.json"
SCORE_DIR = ".score"
SCORE_JOB = "job.json"  # OUTPUT/.score/job.json: written last, what each scoring rank waits for
SCORE_PLAN = "plan.json"
REJECTS = "rejects"


def manifest_path(dataset_dir: str | Path) -> Path:
    return Path(dataset_dir) / MANIFEST


def run_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / name
