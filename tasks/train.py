"""Prefect task for the train stage: ``train_model(...) -> TrainResult``.

It writes RUN_DIR/config.json and RUN_DIR/train_config.json (the TrainJob every
rank reads), then runs torchrun through tasks/torchrun.py, which owns the whole
process tree, and streams every rank's lines to the Prefect run logger.
Per-epoch metrics reach the MLflow run from this process, not from rank 0:
it follows RUN_DIR/metrics.jsonl as the ranks write it (EpochMetricsFollower).

Retries: one. A retry resumes from checkpoints/last.pt, so it helps with a
transient failure (a rank killed by the OOM killer, a stalled collective). It is
skipped for errors that would happen again: bad configuration (ValueError,
raised by the preflight before any process starts), the wall-clock timeout,
and an interruption (signal, cancellation).

Cancellation: the task polls its flow run's state; when someone cancels the
flow run (UI, API, ``prefect flow-run cancel``) it kills torchrun's tree within a
few seconds, even for a flow run in a plain Python process that no worker watches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.exceptions import Abort
from prefect.logging import get_run_logger

from tasks.torchrun import (
    LaunchInterrupted,
    LaunchTimeout,
    OutputLine,
    detect_cuda_devices,
    launch,
    launch_env,
    preflight,
    torchrun_command,
)
from tasks.tracking import EpochMetricsFollower
from training.config import PipelineConfig
from training.job import TrainJob
from training.layout import CONFIG, FINAL_MODEL, METRICS, TRAIN_JOB, run_file

KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL; below the 30 s a Prefect worker waits before its own SIGKILL
CANCEL_POLL_S = 2.0


@dataclass
class TrainResult:
    run_dir: str
    model_path: str
    metrics: dict[str, Any] = field(default_factory=dict)  # the last line of RUN_DIR/metrics.jsonl
    restarts: int = 0  # torchrun worker-group restarts used by this launch


def _worth_retrying(task, task_run, state) -> bool:
    """Retry only failures that a second launch (resuming from last.pt) might not repeat."""
    error = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(error, (ValueError, LaunchTimeout, LaunchInterrupted))


@task(name="train-model", retries=1, retry_condition_fn=_worth_retrying, cache_policy=NO_CACHE)
def train_model(
    config: PipelineConfig,
    dataset_dir: str,
    run_dir: str,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
    init_weights: str | None = None,
    kill_grace_s: float = KILL_GRACE_S,
) -> TrainResult:
    logger = get_run_logger()
    gpus = detect_cuda_devices()
    nproc = preflight(config, dataset_dir, gpus=gpus)  # ValueError naming the field; nothing started yet

    run_path = Path(run_dir)
    config.write_json(run_file(run_path, CONFIG))
    job_path = TrainJob(
        config=config, dataset_dir=str(dataset_dir), run_dir=str(run_path), init_weights=init_weights
    ).write(run_file(run_path, TRAIN_JOB))
    argv = torchrun_command(config, job_path, gpus=gpus)
    # No MLflow run id for the ranks: this process mirrors metrics.jsonl into the run (see EpochMetricsFollower).
    env = launch_env(config, run_path, tracking_uri=tracking_uri, gpus=gpus, grace_s=kill_grace_s)
    metrics_follower = (
        EpochMetricsFollower(run_file(run_path, METRICS), mlflow_run_id, tracking_uri).start()
        if mlflow_run_id and tracking_uri
        else None
    )
    logger.info("Launching %d rank(s) x %d node(s) in %s: %s", nproc, config.train.nnodes, run_path, " ".join(argv))

    def on_line(line: OutputLine) -> None:
        _log_line(logger, line)
        if metrics_follower is not None:
            metrics_follower.poke()

    cancel_check = _flow_run_cancelled_check()
    try:
        result = launch(
            argv,
            run_path,
            env=env,
            on_line=on_line,
            timeout_s=config.train.timeout_s,
            stall_timeout_s=config.train.stall_timeout_s,
            grace_s=kill_grace_s,
            should_cancel=cancel_check,
            cancel_check_s=CANCEL_POLL_S,
        )
    except LaunchInterrupted as error:
        if cancel_check is not None and cancel_check.fired:
            cancel_check.finish_cancellation(str(error))
            # Abort, not an ordinary exception: the engines then propose no Failed state
            # that would overwrite Cancelled; the flow process just stops.
            raise Abort(str(error)) from error
        raise
    finally:
        if metrics_follower is not None:
            metrics_follower.close()  # the epochs of a failed attempt are in MLflow too
    model_path = run_file(run_path, FINAL_MODEL)
    if not model_path.is_file():
        raise RuntimeError(f"torchrun exited 0 but wrote no {model_path}: training did not finish")
    metrics = last_metrics(run_file(run_path, METRICS))
    logger.info("Training finished after %d restart(s): %s -> %s", result.restarts, metrics, model_path)
    return TrainResult(run_dir=str(run_path), model_path=str(model_path), metrics=metrics, restarts=result.restarts)


def _log_line(logger, line: OutputLine) -> None:
    # torchrun's own warnings/errors start "W1129 ..." / "E1129 ..." (glog style).
    if line.rank is None and line.text[:1] in ("W", "E") and line.text[1:5].isdigit():
        logger.warning(str(line))
    else:
        logger.info(str(line))


def last_metrics(path: Path) -> dict[str, Any]:
    """The last JSON line of metrics.jsonl ({} when there is none)."""
    try:
        lines = [text for text in path.read_text().splitlines() if text.strip()]
    except FileNotFoundError:
        return {}
    return json.loads(lines[-1]) if lines else {}


class _FlowRunCancelled:
    """For launch(): a reason string once this task's flow run is being cancelled.

    Polled every CANCEL_POLL_S. A flow run in a plain process has no worker to
    act on "Cancelling", so this is what stops torchrun there; under a worker
    it merely gets there first (the worker's SIGTERM then finds no tree).
    """

    def __init__(self, flow_run_id: UUID, task_run_id: UUID):
        self.flow_run_id = flow_run_id
        self.task_run_id = task_run_id
        self.fired = False

    def __call__(self) -> str | None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception:  # the API being briefly unreachable must not stop training
            return None
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self.fired = True
            return f"flow run {self.flow_run_id} was cancelled ({state.name})"
        return None

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


def _flow_run_cancelled_check() -> _FlowRunCancelled | None:
    context = TaskRunContext.get()
    if context is None or context.task_run.flow_run_id is None:
        return None
    return _FlowRunCancelled(context.task_run.flow_run_id, context.task_run.id)
