"""Prefect task for the train stage: ``train_model(TrainRequest(...), mlflow_run_id) -> TrainResult``.

The work is the launcher ``train.launcher`` names (ddpflow/launch/stage.py: one
``TrainRequest`` in, a ``TrainResult`` out: the data checks, the job file, the
ranks, their whole process tree, the root cause of a failure); this task names
the step, retries it, logs every rank's line to the Prefect run logger, mirrors
epoch metrics into MLflow from this process (EpochMetricsFollower), and stops
training when its flow run is cancelled.

Retries: one. A retry resumes from checkpoints/last.pt, so it helps with a
transient failure (a rank killed by the OOM killer, a stalled collective). It is
skipped for errors that would happen again: bad configuration (ValueError,
raised by the preflight before any process starts), the wall-clock timeout,
an interruption (signal, cancellation), a NaN or inf in training
(training/loop/nonfinite.py: the resumed run would diverge at the same step), and a user's training script
that raised (``ScriptFailed``: its torchrun restarts, ``train.max_restarts``, are its retries).

Cancellation (tasks/cancellation.py): the task polls its flow run's state; when someone cancels the
flow run (UI, API, ``prefect flow-run cancel``) it kills torchrun's tree (or scancels the Slurm job) within a
few seconds, even for a flow run in a plain Python process that no worker watches.

``train.launcher: slurm``: the same task runs the stage as one Slurm job instead
(ddpflow/launch/slurm/, the same request, result and errors; docs/slurm.md) and
tags the MLflow run with the job's id as soon as it is submitted or found.
"""

from __future__ import annotations

from dataclasses import replace

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from ddpflow.console import LOG_ONLY
from ddpflow.launch.failure import LaunchInterrupted, LaunchTimeout, ScriptFailed
from ddpflow.launch.stage import TrainRequest, TrainResult, run_train_stage
from ddpflow.launch.supervisor import OutputLine
from ddpflow.tracking.metrics import EpochMetricsFollower
from ddpflow.tracking.runs import SLURM_JOB_TAG, tag_run
from tasks.cancellation import CANCEL_POLL_S, flow_run_cancelled_check
from training.core.layout import METRICS, run_file
from training.core.topology import RankLayout
from training.loop.nonfinite import is_non_finite_failure

__all__ = ["KILL_GRACE_S", "TrainRequest", "TrainResult", "train_model"]

# SIGTERM -> SIGKILL for TrainRequest.grace_s under Prefect: below the 30 s a worker waits before its own SIGKILL.
KILL_GRACE_S = 10.0


def _worth_retrying(task, task_run, state) -> bool:
    """Retry only failures that a second launch (resuming from last.pt) might not repeat."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is not None and is_non_finite_failure(str(error)):
        return False  # a diverged step diverges again after a resume (training/loop/nonfinite.py)
    return not isinstance(error, (ValueError, LaunchTimeout, LaunchInterrupted, ScriptFailed))


@task(name="train-model", retries=1, retry_condition_fn=_worth_retrying, cache_policy=NO_CACHE)
def train_model(request: TrainRequest, mlflow_run_id: str | None = None) -> TrainResult:
    """Run the train stage ``request`` describes; its events (lines, start, job, cancellation) are this task's.

    ``mlflow_run_id``: the pipeline's run, which this process (never a rank) mirrors the epochs into.
    """
    logger = get_run_logger()
    tracking_uri, run_dir = request.tracking_uri, request.run_dir
    follower = (
        EpochMetricsFollower(run_file(run_dir, METRICS), mlflow_run_id, tracking_uri).start()
        if mlflow_run_id and tracking_uri
        else None
    )

    def on_line(line: OutputLine) -> None:
        # After a stop, torchrun's shutdown (its SignalException traceback) goes to the log file and the UI only.
        extra = {LOG_ONLY: True} if line.after_stop else None
        (logger.warning if line.is_torchrun_warning else logger.info)(str(line), extra=extra)
        if follower is not None:
            follower.poke()

    def on_start(ranks: RankLayout, argv: list[str]) -> None:
        logger.info(
            "Launching %d rank(s) x %d node(s) (%s) in %s: %s",
            ranks.nproc_per_node, ranks.nnodes, ranks.backend, run_dir, " ".join(argv),
        )  # fmt: skip

    def on_job(job_id: str) -> None:
        if not (mlflow_run_id and tracking_uri):
            return
        try:
            tag_run(tracking_uri, mlflow_run_id, {SLURM_JOB_TAG: job_id})
        except Exception as error:  # a tracking hiccup must not cancel the job
            logger.warning("could not tag MLflow run %s with %s=%s: %s", mlflow_run_id, SLURM_JOB_TAG, job_id, error)

    cancel_check = flow_run_cancelled_check()
    events = {"on_line": on_line, "on_start": on_start, "on_job": on_job}
    request = replace(request, **events, should_cancel=cancel_check, cancel_check_s=CANCEL_POLL_S)
    try:
        result = run_train_stage(request)
    except LaunchInterrupted as error:
        if cancel_check is not None:
            cancel_check.abort_if_fired(error)  # Abort: the runs stay Cancelled
        raise
    finally:
        if follower is not None:
            follower.close()  # the epochs of a failed attempt are in MLflow too
    logger.info("Training finished after %d restart(s): %s -> %s", result.restarts, result.metrics, result.model_path)
    return result
