"""Re-run the registration gate for a finished pipeline run (``ddpflow register --run-id``).

For when registration failed after training and evaluation succeeded (the
MLflow server was down, the champion's files were unreadable), or to re-gate a
run with another registry config. Everything comes from the MLflow run: the
config it logged, ``model.pt`` and the dataset (tags the evaluate stage set)
and its test metrics. Nothing is retrained or re-evaluated; a run already
registered keeps its recorded decision (ddpflow/tracking/registration.py is
idempotent per run). The gate holds the same per-model lock as the pipeline's
register task, so it never races a scheduled run, and a promotion emits the same
``ddpflow.champion.moved`` event, so the new champion re-scores as after a pipeline run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from ddpflow.tracking.gate import PROMOTED
from ddpflow.tracking.registration import register_run
from ddpflow.tracking.runs import check_tracking_reachable
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from tasks.register import announce_new_champion, gate_lock
from training.core.config import PipelineConfig


@flow(name="register-run", flow_run_name="register-{run_id}", log_prints=True)
def register_finished_run(
    run_id: str, config: PipelineConfig | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Gate and register the model of MLflow run ``run_id``.

    ``config`` replaces the run's own config; ``overrides`` (``section.key=value``) apply on top of
    whichever is used, e.g. ``registry.replace_unreadable_champion=true``.
    """
    tracking_uri = resolve_tracking_uri(config or PipelineConfig())
    check_tracking_reachable(tracking_uri)
    outcome = register_run(run_id, config, overrides, tracking_uri, logger=get_run_logger(), gate_lock=gate_lock)
    if outcome.decision == PROMOTED and not outcome.already_registered:
        announce_new_champion(outcome)
    decision = outcome.to_dict()
    return {
        "model_name": decision["model_name"],
        "model_version": decision["version"],
        "decision": decision["decision"],
        "reason": decision["reason"],
        "model_uri": decision["model_uri"],
        "already_registered": decision["already_registered"],
        "mlflow_run_id": run_id,
    }
