"""Retraining that notices the data, through the real flow.

A CSV source in a temp dir, one rank, one epoch, the session's Prefect test harness and
SQLite MLflow store. In order, on one model:
1. the first run is promoted; with no champion, drift says so and logs nothing;
2. the same config again, with train.skip_if_unchanged: skipped (no torchrun, no run
   directory, no version), in the flow's result, its state message, a Prefect artifact,
   an MLflow run tagged ddpflow.skipped=true, and `ddpflow run --json`;
3. one appended row trains again, and its drift from the champion's data is logged;
4. another lr trains again;
5. a source whose f0 moved by 3 std, with registry.max_drift_psi set: the figure and the
   metric are logged and the candidate waits as @challenger with the drift as its reason.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

from tests.flows.cli_runs import cli_env

pytestmark = pytest.mark.torchrun

FEATURES = ["f0", "f1", "f2", "f3"]


def write_source(path: Path, rows: int = 3000, seed: int = 0, shift: float = 0.0) -> Path:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({name: rng.normal(size=rows) for name in FEATURES})
    frame["label"] = (frame["f0"] + frame["f1"] > 0).astype(int)  # learnable from the features
    frame["f0"] += shift
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


def artifact_markdown(flow_run_id: str, key: str) -> str:
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    assert len(artifacts) == 1, f"{key} artifacts of flow run {flow_run_id}: {artifacts}"
    return str(artifacts[0].data)


@pytest.fixture(scope="module")
def story(prefect_harness, make_config, tmp_path_factory):
    from flows.pipeline import train_pipeline

    tmp = tmp_path_factory.mktemp("skip-drift")
    source = write_source(tmp / "src" / "sales.csv")
    config = make_config(
        **{
            "data.source": str(source),
            "train.epochs": 1,
            "train.nproc_per_node": 1,
            "train.skip_if_unchanged": True,
        }
    )
    runs = {"first": train_pipeline(config=config)}
    skipped_state = train_pipeline(config=config, return_state=True)
    runs["skipped"] = skipped_state.result()
    runs["skipped_message"] = skipped_state.message
    runs["cli"] = cli_run_json(config, tmp)
    runs["run_dirs_after_skips"] = sorted(d.name for d in Path(config["train"]["run_root"]).iterdir())
    with source.open("a") as handle:
        handle.write("0.1,0.2,0.3,0.4,1\n")
    runs["appended"] = train_pipeline(config=config)
    other_lr = copy.deepcopy(config)
    other_lr["train"]["lr"] = config["train"]["lr"] / 2
    runs["other_lr"] = train_pipeline(config=other_lr)
    drifted = copy.deepcopy(config)
    drifted["data"]["source"] = str(write_source(tmp / "drifted" / "sales.csv", seed=1, shift=3.0))
    drifted["registry"]["max_drift_psi"] = 0.25
    drifted["registry"]["min_delta"] = 0.0
    runs["drifted"] = train_pipeline(config=drifted)
    return config, runs, MlflowClient(config["mlflow"]["tracking_uri"])


def cli_run_json(config: dict, tmp: Path) -> dict:
    """`ddpflow run --config ... --json` in a subprocess, on the session harness's Prefect server (PREFECT_API_URL:
    a temporary server of its own would cost 10-20 s to create its database; tests/flows/test_run_cli.py covers it)."""
    from prefect.settings import get_current_settings

    config_file = tmp / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", str(config_file), "--json"],
        cwd=tmp,
        env=cli_env(str(get_current_settings().api.url), tmp / "prefect-home"),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def versions(client: MlflowClient, name: str) -> list[str]:
    return sorted((str(v.version) for v in client.search_model_versions(f"name='{name}'")), key=int)


def test_an_unchanged_night_is_skipped_without_training_and_says_why(story):
    config, runs, client = story
    first, skipped = runs["first"], runs["skipped"]
    name = config["registry"]["model_name"]
    assert first["decision"] == "promoted" and str(first["model_version"]) == "1"
    assert skipped["decision"] == "skipped"
    assert skipped["model_version"] == "1" and skipped["run_dir"] is None
    fingerprint = Path(first["dataset_dir"]).name
    assert skipped["fingerprint"] == fingerprint and skipped["cache_hit"] is True
    assert f"champion v1 was trained on the same data (fingerprint {fingerprint})" in skipped["reason"]
    assert runs["skipped_message"] == f"skipped: {skipped['reason']}"  # the Prefect run's state says it
    assert skipped["reason"] in artifact_markdown(skipped["flow_run_id"], "training-skipped")
    # No torchrun, no run directory, no model version: only the first run's directory exists.
    assert runs["run_dirs_after_skips"] == [Path(first["run_dir"]).name]
    run = client.get_run(skipped["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddpflow.skipped"] == "true" and run.data.tags["registry.decision"] == "skipped"
    assert run.data.tags["registry.reason"] == skipped["reason"]
    assert run.data.tags["data.fingerprint"] == fingerprint
    # The champion's version (v1, then) carries the training identity the skip compared.
    assert client.get_model_version(name, "1").tags["ddpflow.training_identity"] == skipped["training_identity"]
    assert run.data.tags["ddpflow.training_identity"] == skipped["training_identity"]


def test_the_cli_json_says_skipped_with_the_reason(story):
    _, runs, client = story
    cli = runs["cli"]
    assert cli["decision"] == "skipped" and cli["model_version"] == "1"
    assert "champion v1 was trained on the same data" in cli["reason"]
    assert client.get_run(cli["mlflow_run_id"]).data.tags["ddpflow.skipped"] == "true"


def test_an_appended_row_or_another_lr_trains_again(story):
    config, runs, client = story
    name = config["registry"]["model_name"]
    appended, other_lr = runs["appended"], runs["other_lr"]
    assert appended["decision"] in ("promoted", "challenger") and appended["model_version"] == "2"
    assert Path(appended["dataset_dir"]).name != Path(runs["first"]["dataset_dir"]).name  # a new fingerprint
    assert other_lr["decision"] in ("promoted", "challenger") and other_lr["model_version"] == "3"
    assert other_lr["dataset_dir"] == appended["dataset_dir"]  # same data, other weights: trained anyway
    assert all((Path(run["run_dir"]) / "model.pt").is_file() for run in (appended, other_lr))
    assert versions(client, name)[:3] == ["1", "2", "3"]  # the skipped nights made none


def test_without_a_champion_drift_says_so_and_logs_nothing(story):
    _, runs, client = story
    first = runs["first"]
    assert first["data_drift"]["status"] == "no champion"
    run = client.get_run(first["mlflow_run_id"])
    assert "data_drift_max_psi" not in run.data.metrics
    assert [a.path for a in client.list_artifacts(first["mlflow_run_id"]) if a.path == "drift"] == []
    assert "no champion yet" in artifact_markdown(first["flow_run_id"], "data-drift")


def test_each_training_logs_its_drift_from_the_champions_data(story):
    _, runs, client = story
    appended = runs["appended"]
    drift = appended["data_drift"]
    assert drift["status"] == "measured" and drift["champion_version"] == "1"
    assert 0.0 <= drift["max_psi"] < 0.05  # one row more: nearly the same data
    run = client.get_run(appended["mlflow_run_id"])
    assert run.data.metrics["data_drift_max_psi"] == pytest.approx(drift["max_psi"])
    assert {a.path for a in client.list_artifacts(appended["mlflow_run_id"], "drift")} == {
        "drift/data_drift.png",
        "drift/data_drift.json",
    }


def test_a_drifted_source_is_shown_and_held_as_challenger_by_max_drift_psi(story):
    config, runs, client = story
    name = config["registry"]["model_name"]
    drifted = runs["drifted"]
    drift = drifted["data_drift"]
    assert drift["status"] == "measured" and drift["worst_feature"] == "f0" and drift["max_psi"] > 1.0
    assert drift["top"][0]["mean_shift"] == pytest.approx(3.0, abs=0.3)
    run = client.get_run(drifted["mlflow_run_id"])
    assert run.data.metrics["data_drift_max_psi"] == pytest.approx(drift["max_psi"])
    png = client.download_artifacts(drifted["mlflow_run_id"], "drift/data_drift.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = artifact_markdown(drifted["flow_run_id"], "data-drift")
    rows = [line for line in markdown.splitlines() if line.startswith("| f") and not line.startswith("| feature")]
    assert len(rows) == 4 and rows[0].startswith("| f0 |")  # the most drifted feature first (5 max; 4 exist)
    # The gate: whatever its metric, the candidate waits.
    assert drifted["decision"] == "challenger"
    assert "feature 'f0' drifted from champion v" in drifted["reason"]
    assert "> registry.max_drift_psi 0.25" in drifted["reason"]
    assert str(client.get_model_version_by_alias(name, "challenger").version) == drifted["model_version"]
    assert str(client.get_model_version_by_alias(name, "champion").version) != drifted["model_version"]
    version = client.get_model_version(name, drifted["model_version"])
    assert version.tags["gate.drift_feature"] == "f0" and float(version.tags["gate.drift_psi"]) > 0.25


def task_spans(flow_run_id: str) -> dict:
    """Each task run of the flow run, by task name: (start time, end time), through the Prefect API."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {task.name.rsplit("-", 1)[0]: (task.start_time, task.end_time) for task in tasks}


def test_the_drift_is_measured_beside_the_training(story):
    """The drift task reads the prepared data and the champion's profile only: the flow submits it before the train
    task and waits for it after, so the two task runs overlap (the drift's seconds are off the run's critical path)."""
    _, runs, _ = story
    spans = task_spans(runs["appended"]["flow_run_id"])
    (drift_start, drift_end), (train_start, train_end) = spans["measure-data-drift"], spans["train-model"]
    assert drift_start < train_end and train_start < drift_end, spans


def test_the_reference_is_fitted_beside_the_training_and_scored_after_it(story):
    """The reference model's fit reads the prepared data only: its task runs beside the train task, and the evaluate
    task scores what it fitted once both are done."""
    _, runs, client = story
    spans = task_spans(runs["appended"]["flow_run_id"])
    (fit_start, fit_end), (train_start, train_end) = spans["fit-reference"], spans["train-model"]
    evaluate_start = next(start for name, (start, _) in spans.items() if name.startswith("evaluate"))
    assert fit_start < train_end and train_start < fit_end and fit_end <= evaluate_start, spans
    metrics = client.get_run(runs["appended"]["mlflow_run_id"]).data.metrics
    assert any(name.startswith("baseline_reference/") for name in metrics), sorted(metrics)
