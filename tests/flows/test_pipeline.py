"""The real pipeline under a Prefect test harness: 2 gloo ranks, tiny data, a real SQLite MLflow store."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.flow_logs import flow_run_logs
from training.core.layout import EVAL_METRICS, FINAL_MODEL, METRICS, TRAIN_JOB

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def two_runs(prefect_harness, make_config, tmp_path_factory):
    """The same data twice: the second run hits the shard cache, starts from the
    first's weights (train.init_from: champion) and meets it at the gate, which it
    cannot pass: no accuracy beats another by more than registry.min_delta=1.
    Shards of their own: the first run's cache miss holds whatever ran before."""
    from flows.pipeline import train_pipeline

    config = make_config(**{"data.root": str(tmp_path_factory.mktemp("pipeline-shards"))})
    first = train_pipeline(config=config)
    warm = copy.deepcopy(config)
    warm["train"]["init_from"] = "champion"
    warm["registry"]["min_delta"] = 1.0
    second = train_pipeline(config=warm)
    return config, first, second


def per_epoch_keys(run_dir: str) -> set[str]:
    lines = [json.loads(line) for line in (Path(run_dir) / METRICS).read_text().splitlines() if line.strip()]
    return {key for line in lines for key, value in line.items() if isinstance(value, (int, float)) and key != "epoch"}


def test_first_run_trains_evaluates_and_is_promoted_to_champion(two_runs):
    config, first, _ = two_runs
    name = config["registry"]["model_name"]
    assert first["model_name"] == name
    assert first["decision"] == "promoted"
    assert str(first["model_version"]) == "1"
    assert first["cache_hit"] is False
    assert 0.0 <= first["test_metrics"]["test_accuracy"] <= 1.0
    assert first["test_metrics"]["test_accuracy"] > 0.5, "3 learnable classes: a trained model beats chance clearly"
    # The baselines, in the summary and beside the model's metrics in MLflow: the same test rows, guessing beaten.
    baselines, test_rows = first["baselines"], first["test_metrics"]["test_samples"]
    assert baselines["trivial"]["test_samples"] == baselines["reference"]["test_samples"] == test_rows
    assert baselines["trivial"]["test_accuracy"] < first["test_metrics"]["test_accuracy"]
    assert baselines["comparison"].startswith("test_accuracy ") and " · guessing " in baselines["comparison"]
    logged = MlflowClient(config["mlflow"]["tracking_uri"]).get_run(first["mlflow_run_id"]).data.metrics
    assert logged["baseline_trivial/test_accuracy"] == baselines["trivial"]["test_accuracy"]
    assert logged["baseline_reference/test_accuracy"] == baselines["reference"]["test_accuracy"]

    run_dir = Path(first["run_dir"])
    assert run_dir.parent == Path(config["train"]["run_root"]).resolve()
    assert run_dir.name.endswith("-synthetic-classification"), "run dir is <time>-<flow run name>"
    for name_on_disk in (FINAL_MODEL, METRICS, EVAL_METRICS, TRAIN_JOB):
        assert (run_dir / name_on_disk).is_file(), name_on_disk

    version = MlflowClient(config["mlflow"]["tracking_uri"]).get_model_version(name, "1")
    assert version.run_id == first["mlflow_run_id"]


def test_mlflow_run_records_params_tags_and_one_point_per_epoch(two_runs):
    config, first, _ = two_runs
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    run = client.get_run(first["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.epochs"] == str(config["train"]["epochs"])
    assert run.data.params["data.source"] == config["data"]["source"]
    assert run.data.tags["data.fingerprint"] == Path(first["dataset_dir"]).name
    assert run.data.tags["ddp.world_size"] == "2" and run.data.tags["ddp.backend"] == "gloo"
    assert run.data.tags["prefect.flow_run_id"] == first["flow_run_id"]
    assert run.data.tags["ddpflow.run_dir"] == first["run_dir"]
    assert first["mlflow_run_id"] in first["mlflow_run_url"]

    keys = per_epoch_keys(first["run_dir"]) & set(run.data.metrics)
    assert keys, "rank 0 logs its per-epoch metrics into the pipeline's MLflow run"
    for key in keys:
        history = client.get_metric_history(first["mlflow_run_id"], key)
        # Exactly one point per epoch: rank 1 never logged, nothing was logged twice.
        assert len(history) == config["train"]["epochs"], (key, history)


def test_second_run_hits_the_cache_and_stays_challenger_behind_the_champion(two_runs):
    config, first, second = two_runs
    name = config["registry"]["model_name"]
    assert second["cache_hit"] is True
    assert second["dataset_dir"] == first["dataset_dir"]
    assert second["run_dir"] != first["run_dir"]
    assert second["mlflow_run_id"] != first["mlflow_run_id"]

    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2, "one MLflow run per pipeline run, none from the ranks"

    # The gate, whose outcome the setup fixes: min_delta=1 cannot be beaten, so the second is a challenger.
    assert second["decision"] == "challenger" and str(second["model_version"]) == "2"
    assert "does not beat champion v1" in second["reason"]
    assert client.get_model_version_by_alias(name, "champion").run_id == first["mlflow_run_id"]
    assert client.get_model_version_by_alias(name, "challenger").run_id == second["mlflow_run_id"]
    gated = client.get_run(second["mlflow_run_id"])
    assert gated.info.status == "FINISHED" and gated.data.tags["registry.champion_version"] == "1"
    # The champion was re-scored on the same test shards: its number is the first run's own.
    assert gated.data.metrics["gate_champion_test_accuracy"] == pytest.approx(first["test_metrics"]["test_accuracy"])


def test_second_run_warm_starts_from_the_champion(two_runs):
    _, _, second = two_runs
    job = json.loads((Path(second["run_dir"]) / TRAIN_JOB).read_text())
    assert job["init_weights"], "the champion's weights were handed to the ranks"
    assert Path(job["init_weights"]).is_file()
    assert Path(job["init_weights"]).is_relative_to(second["run_dir"]), "the run keeps what it started from"
    needle = f"warm start: weights from {job['init_weights']}"
    assert needle in flow_run_logs(second["flow_run_id"], needle)


def test_warm_start_with_another_architecture_starts_fresh_with_a_message(two_runs):
    from flows.pipeline import train_pipeline

    config, _, _ = two_runs
    other = copy.deepcopy(config)
    other["train"]["init_from"] = "champion"
    other["train"]["model_kwargs"] = {"hidden": [16, 16]}
    summary = train_pipeline(config=other)
    assert (Path(summary["run_dir"]) / FINAL_MODEL).is_file(), "a mismatch is not fatal: training starts fresh"
    logs = flow_run_logs(summary["flow_run_id"], "training from scratch")
    assert "warm start:" in logs and "training from scratch" in logs, logs[-3000:]


def test_register_again_for_a_finished_run_keeps_its_recorded_decision(two_runs):
    """`ddpflow register --run-id`: everything comes from the MLflow run; no second version."""
    from flows.registration import register_finished_run

    config, first, _ = two_runs
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    versions_before = len(client.search_model_versions(f"name='{config['registry']['model_name']}'"))
    again = register_finished_run(run_id=first["mlflow_run_id"], config=config)
    assert again["already_registered"] is True
    assert again["decision"] == first["decision"]
    assert str(again["model_version"]) == str(first["model_version"])
    assert len(client.search_model_versions(f"name='{config['registry']['model_name']}'")) == versions_before
