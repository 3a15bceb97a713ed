"""A sweep in MLflow: one parent run, a child run per trial, and the parent's summary of them all.

- The parent (``start_sweep_run``): the base config's params and ``sweep.*`` (the section), tags
  ``ddpflow.sweep`` (the study's name) and ``ddpflow.sweep_dir``. A resumed sweep continues the same
  parent run (its id is kept in the study).
- A child per trial (``start_trial_run``): a pipeline run of the trial's config (params, inputs,
  config.json), tagged ``mlflow.parentRunId`` (the MLflow UI nests it), ``ddpflow.sweep`` and
  ``ddpflow.sweep_trial``; its per-epoch curves come from the same mirror as a pipeline run's
  (ddpflow/tracking/metrics.py). ``finish_trial_run``: metric ``sweep_objective`` (the value it was judged by;
  a pruned trial's last reported one), tags ``sweep.state`` (complete, pruned, failed),
  ``sweep.fail_reason``, ``sweep.pruned_at_epoch``.
- The parent's summary (``log_sweep_summary``): ``sweep/trials.json`` (an MLflow table of every trial) and
  ``sweep/trials.csv``, ``sweep/objective_vs_params.png``, ``sweep/best.json``, tags ``sweep.best_trial``,
  ``sweep.best_run_id``, ``sweep.best.<key>`` and metrics ``sweep_best_objective``, ``sweep_trials_complete``,
  ``sweep_trials_pruned``, ``sweep_trials_failed``. Tags and metrics, not params: a resumed sweep may find a
  new best, and an MLflow param cannot change.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from ddpflow.tracking.runs import RUN_DIR_TAG, start_pipeline_run
from training.core.config import PipelineConfig

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the child under its parent
SWEEP_TAG = "ddpflow.sweep"
SWEEP_DIR_TAG = "ddpflow.sweep_dir"
TRIAL_TAG = "ddpflow.sweep_trial"
TRIAL_RUN_TAG = "ddpflow.trial_run_id"  # on the model version the best trial registered
OBJECTIVE_METRIC = "sweep_objective"
TABLE_ARTIFACT, CSV_ARTIFACT = "sweep/trials.json", "sweep/trials.csv"
PLOT_ARTIFACT, BEST_ARTIFACT = "sweep/objective_vs_params.png", "sweep/best.json"


def start_sweep_run(
    config: PipelineConfig,
    study_name: str,
    section: dict[str, Any],
    sweep_dir: Path,
    run_context: dict[str, Any],
    earlier_run_id: str | None = None,
) -> str:
    """The sweep's parent run: the earlier one again (RUNNING) when it still exists, else a new one.

    ``run_context``: ``start_pipeline_run``'s keywords (prefect_context, fingerprint, manifest, ddp, dataset_dir).
    """
    client = MlflowClient(tracking_uri=run_context["tracking_uri"])
    if earlier_run_id is not None:
        try:
            client.update_run(earlier_run_id, status="RUNNING")
            return earlier_run_id
        except Exception:  # deleted, or another store: a new parent
            pass
    run_id = start_pipeline_run(config, run_name=f"sweep-{study_name}", **_pipeline_keywords(run_context))
    params = [Param(f"sweep.{key}", json.dumps(value)[:6000]) for key, value in section.items()]
    client.log_batch(run_id, params=params)
    client.set_tag(run_id, SWEEP_TAG, study_name)
    client.set_tag(run_id, SWEEP_DIR_TAG, str(sweep_dir))
    return run_id


def start_trial_run(
    config: PipelineConfig,
    parent_run_id: str,
    study_name: str,
    trial: int,
    run_dir: Path,
    run_context: dict[str, Any],
) -> str:
    """A child run for one trial: a pipeline run of its config, nested under the sweep's parent."""
    run_id = start_pipeline_run(config, run_name=f"trial-{trial:03d}", **_pipeline_keywords(run_context))
    client = MlflowClient(tracking_uri=run_context["tracking_uri"])
    tags = {PARENT_TAG: parent_run_id, SWEEP_TAG: study_name, TRIAL_TAG: str(trial), RUN_DIR_TAG: str(run_dir)}
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return run_id


def _pipeline_keywords(run_context: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run_context.items() if key != "tracking_uri"}


def finish_trial_run(
    tracking_uri: str,
    run_id: str,
    state: str,
    value: float | None,
    reason: str | None = None,
    pruned_at: int | None = None,
) -> None:
    """The value it was judged by, how it ended, and the run ended (FAILED for a failed trial)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    if value is not None and math.isfinite(value):
        client.log_metric(run_id, OBJECTIVE_METRIC, value)
    client.set_tag(run_id, "sweep.state", state)
    if reason:
        client.set_tag(run_id, "sweep.fail_reason", reason[:5000])
    if pruned_at is not None:
        client.set_tag(run_id, "sweep.pruned_at_epoch", str(pruned_at))
    client.set_terminated(run_id, status="FAILED" if state == "failed" else "FINISHED")


def log_sweep_summary(
    tracking_uri: str,
    run_id: str,
    rows: list[dict[str, Any]],
    keys: list[str],
    objective: str,
    log_keys: tuple[str, ...] = (),
) -> None:
    """The parent's table of every trial, the plot, the best trial (``rows``: one per trial, ``best`` on one)."""
    import pandas as pd

    from ddpflow.tracking.plots import sweep_figure

    client = MlflowClient(tracking_uri=tracking_uri)
    table = [{name: cell(value) for name, value in row.items()} for row in rows]
    client.log_table(run_id, data=pd.DataFrame(table), artifact_file=TABLE_ARTIFACT)
    client.log_text(run_id, _csv(table), CSV_ARTIFACT)
    client.log_figure(run_id, sweep_figure(rows, keys, objective, log_keys), PLOT_ARTIFACT)
    now = int(time.time() * 1000)
    states = [row["state"] for row in rows]
    metrics = {f"sweep_trials_{state}": float(states.count(state)) for state in ("complete", "pruned", "failed")}
    best = next((row for row in rows if row.get("best")), None)
    if best is not None:
        metrics["sweep_best_objective"] = best["value"]
        client.log_dict(run_id, {name: cell(value) for name, value in best.items()}, BEST_ARTIFACT)
        client.set_tag(run_id, "sweep.best_trial", str(best["trial"]))
        client.set_tag(run_id, "sweep.best_run_id", str(best["run_id"]))
        for key in keys:
            client.set_tag(run_id, f"sweep.best.{key}", json.dumps(best[key]))
    client.log_batch(run_id, metrics=[Metric(name, value, now, 0) for name, value in metrics.items()])


def tag_best_version(tracking_uri: str, model_name: str, version: str, study_name: str, trial_run_id: str) -> None:
    """The model version the best trial registered says which sweep and which trial made it."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    client.set_model_version_tag(model_name, version, SWEEP_TAG, study_name)
    client.set_model_version_tag(model_name, version, TRIAL_RUN_TAG, trial_run_id)


def cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, a list choice as its JSON text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def _csv(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(name for row in rows for name in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=names)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
