"""The evaluate and register tasks run as Prefect tasks, in a flow, under a real Prefect test server."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from ddpflow.tracking.runs import start_pipeline_run
from tasks.evaluate import evaluate_model
from tasks.register import gate_lock_name, register_model
from training.core.config import PipelineConfig
from training.core.manifest import read_manifest


def test_evaluate_then_register_under_prefect(prefect_harness, mlflow_store, dataset_factory, model_factory, tmp_path):
    uri, artifacts = mlflow_store
    config = PipelineConfig.model_validate(
        {"mlflow": {"tracking_uri": uri, "artifact_location": artifacts}, "registry": {"model_name": "prefect-test"}}
    )
    no_such_metric = config.model_copy(update={"registry": config.registry.model_copy(update={"metric": "test_nope"})})
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    manifest = read_manifest(dataset)

    @flow
    def after_training():
        run_id = start_pipeline_run(
            config,
            "prefect-run",
            {"flow_run_name": "prefect-run"},
            manifest.fingerprint,
            manifest,
            {"nproc_per_node": 1, "nnodes": 1},
            dataset,
        )
        metrics = evaluate_model(str(model_path), str(dataset), run_id, uri, config)
        decision = register_model(config, run_id, str(model_path), str(dataset), metrics, uri)
        # A deterministic error: the retry condition must not spend the 3 retries on it.
        failed = register_model(no_such_metric, run_id, str(model_path), str(dataset), metrics, uri, return_state=True)
        return run_id, metrics, decision, failed.is_failed(), str(failed.state_details.task_run_id)

    run_id, metrics, decision, failed, failed_task_run = after_training()

    assert decision["decision"] == "promoted" and decision["version"] == "1"
    written = json.loads((model_path.parent / "eval" / "metrics.json").read_text())
    assert (
        written["samples"] == manifest.rows("test") and written["metrics"]["test_accuracy"] == metrics["test_accuracy"]
    )
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.metrics["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    # The baselines, scored on the same test rows, beside the model's metrics: returned, in MLflow, in the file.
    for which in ("baseline_trivial", "baseline_reference"):
        assert run.data.metrics[f"{which}/test_samples"] == manifest.rows("test")
        assert run.data.metrics[f"{which}/test_accuracy"] == pytest.approx(metrics[f"{which}/test_accuracy"])
        assert written["baselines"][f"{which}/test_accuracy"] == metrics[f"{which}/test_accuracy"]
    assert metrics["baseline_trivial/test_accuracy"] < metrics["test_accuracy"]
    assert {item.path for item in client.list_artifacts(run_id, "eval")} == {
        "eval/metrics.json",
        "eval/confusion_matrix.png",
    }
    assert run.data.tags["ddpflow.model_path"] == str(model_path.resolve())

    with get_client(sync_client=True) as prefect:
        markdown = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["model-evaluation"]))
        )
        assert any(run_id in str(artifact.data) and "test_accuracy" in str(artifact.data) for artifact in markdown)
        ours = next(str(artifact.data) for artifact in markdown if run_id in str(artifact.data))
        assert "reference (HistGradientBoosting)" in ours and "trivial (train prior or mean)" in ours
        assert failed and prefect.read_task_run(failed_task_run).run_count == 1
        # The gate ran under the model's lock: a global concurrency limit created on first use, now released.
        lock = prefect.read_global_concurrency_limit_by_name(gate_lock_name("prefect-test"))
        assert lock.limit == 1 and lock.active_slots == 0
