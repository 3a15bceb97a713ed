"""Re-run the registration gate for a finished pipeline run (``ddpflow register --run-id``).

For when registration failed after training succeeded (the MLflow server was
down, the registry refused), or to re-gate a run with another registry config.
Everything comes from the MLflow run itself: the config it logged, the run
directory it was tagged with (``model.pt``), the data fingerprint and the test
metrics the evaluate stage logged. Nothing is retrained or re-evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from prefect import flow

from tasks.register import register_model
from tasks.tracking import check_tracking_reachable, read_run_config, resolve_tracking_uri
from training.config import PipelineConfig
from training.layout import FINAL_MODEL

RUN_DIR_TAG = "ddpflow.run_dir"
DATASET_DIR_TAG = "ddpflow.dataset_dir"


@flow(name="register-run", flow_run_name="register-{run_id}", log_prints=True)
def register_finished_run(run_id: str, config: PipelineConfig | None = None) -> dict[str, Any]:
    """Gate and register the model of MLflow run ``run_id``; ``config`` overrides the run's own (e.g. registry.min_delta)."""
    tracking_uri = resolve_tracking_uri(config or PipelineConfig())
    check_tracking_reachable(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    run = client.get_run(run_id)
    config = config or read_run_config(client, run_id)

    tags = run.data.tags
    if RUN_DIR_TAG not in tags:
        raise ValueError(f"MLflow run {run_id} has no {RUN_DIR_TAG} tag: it was not made by the ddpflow pipeline")
    model_path = Path(tags[RUN_DIR_TAG]) / FINAL_MODEL
    if not model_path.is_file():
        raise FileNotFoundError(f"MLflow run {run_id}: {model_path} does not exist (training did not finish, or the run dir was moved)")
    dataset_dir = tags.get(DATASET_DIR_TAG) or str(Path(config.data.root) / tags["data.fingerprint"])
    test_metrics = {key: value for key, value in run.data.metrics.items() if key.startswith("test_")}
    if not test_metrics:
        raise ValueError(f"MLflow run {run_id} has no test_* metrics: its evaluate stage did not finish; run the pipeline again")

    decision = register_model(config, run_id, str(model_path), dataset_dir, test_metrics, tracking_uri)
    return {
        "model_name": config.registry.model_name,
        "model_version": decision.get("version"),
        "decision": decision.get("decision"),
        "reason": decision.get("reason"),
        "test_metrics": test_metrics,
        "mlflow_run_id": run_id,
        "run_dir": tags[RUN_DIR_TAG],
    }
