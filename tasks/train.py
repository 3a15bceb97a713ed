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

Cancellation (``flow_run_cancelled_check``, which the score task hands its launcher too): the task polls its
flow run's state; when someone cancels the flow run (UI, API, ``prefect flow-run cancel``) it kills torchrun's
tree (or scancels the Slurm job) within a few seconds, even for a flow run in a plain Python process that no
worker watches (there is no worker to act on "Cancelling"; under a worker the check merely gets there first and
the worker's SIGTERM finds no tree). When the check stopped the launch, ``abort_if_fired`` marks the task run
and its flow run Cancelled and raises Prefect's ``Abort``.

``train.launcher: slurm``: the same task runs the stage as one Slurm job instead
(ddpflow/launch/slurm/, the same request, result and errors; docs/slurm.md) and
tags the MLflow run with the job's id as soon as it is submitted or found.
"""

from __future__ import annotations

from dataclasses import replace
from uuid import UUID

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.exceptions import Abort
from prefect.logging import get_run_logger

from ddpflow.console import LOG_ONLY
from ddpflow.launch.failure import LaunchInterrupted, LaunchTimeout, ScriptFailed
from ddpflow.launch.stage import TrainRequest, TrainResult, run_train_stage
from ddpflow.launch.supervisor import OutputLine
from ddpflow.tracking.metrics import EpochMetricsFollower
from ddpflow.tracking.runs import SLURM_JOB_TAG, tag_run
from training.core.layout import METRICS, run_file
from training.core.topology import RankLayout
from training.loop.nonfinite import is_non_finite_failure

__all__ = [
    "CANCEL_POLL_S",
    "KILL_GRACE_S",
    "FlowRunCancelled",
    "TrainRequest",
    "TrainResult",
    "flow_run_cancelled_check",
    "train_model",
]

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


CANCEL_POLL_S = 2.0  # how often a launcher asks


class FlowRunCancelled:
    """For the launcher: a reason string once this task's flow run is being cancelled (polled every CANCEL_POLL_S)."""

    def __init__(self, flow_run_id: UUID, task_run_id: UUID):
        self.flow_run_id = flow_run_id
        self.task_run_id = task_run_id
        self.fired = False

    def __call__(self) -> str | None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception:  # the API being briefly unreachable must not stop the ranks
            return None
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self.fired = True
            return f"flow run {self.flow_run_id} was cancelled ({state.name})"
        return None

    def abort_if_fired(self, error: BaseException) -> None:
        """When this check stopped the launch: mark the runs Cancelled and raise Abort (not an ordinary exception:
        the engines then propose no Failed state that would overwrite Cancelled; the flow process just stops)."""
        if self.fired:
            self.finish_cancellation(str(error))
            raise Abort(str(error)) from error

    def finish_cancellation(self, message: str) -> None:
        """Mark this task run and its flow run Cancelled, as a worker would after killing the run.

        In a plain process nobody else would: the flow run would stay "Cancelling" forever.
        """
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        with get_client(sync_client=True) as client:
            client.set_task_run_state(self.task_run_id, Cancelled(message=message), force=True)
            state = client.read_flow_run(self.flow_run_id).state
            if state is not None and state.is_cancelling():
                client.set_flow_run_state(
                    self.flow_run_id, Cancelled(message=f"Flow run was cancelled: {message}"), force=True
                )


def flow_run_cancelled_check() -> FlowRunCancelled | None:
    """The check for the task run in progress; None outside one (a plain call: nothing to cancel it)."""
    context = TaskRunContext.get()
    if context is None or context.task_run.flow_run_id is None:
        return None
    return FlowRunCancelled(context.task_run.flow_run_id, context.task_run.id)
