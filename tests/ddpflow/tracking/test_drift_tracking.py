"""Where drift finds the champion's training data, on a real SQLite MLflow store: the run's
data/manifest.json, else the manifest in its ddpflow.dataset_dir; an old manifest (no histograms)
or a profile that is gone makes drift "not available" with the reason, never an error, and nothing
is logged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from ddpflow.tracking.drift import MEASURED, NO_CHAMPION, UNAVAILABLE, drift_from_version, log_drift, measure_drift
from ddpflow.tracking.runs import DATASET_DIR_TAG, TRAINING_DATA_ARTIFACT
from training.core.config import DataConfig
from training.prepare.dataset import prepare_dataset

MODEL = "drift-model"


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("drift", artifact_location=(tmp_path / "artifacts").as_uri())
    return client, experiment


@pytest.fixture
def datasets(tmp_path):
    """Two prepared datasets: the champion's, and one whose x moved by one std."""
    rng = np.random.default_rng(0)
    prepared = []
    for name, shift in (("old.parquet", 0.0), ("new.parquet", 1.0)):
        path = tmp_path / "src" / name
        path.parent.mkdir(exist_ok=True)
        rows = 4000
        table = pa.table(
            {"x": rng.normal(shift, 1.0, rows), "y": rng.normal(size=rows), "label": rng.integers(0, 2, rows)}
        )
        pq.write_table(table, path)
        prepared.append(prepare_dataset(DataConfig(source=str(path), root=str(tmp_path / "shards"))))
    return prepared


def champion_with(client: MlflowClient, experiment: str, manifest=None, dataset_dir: str | None = None):
    """A registered @champion whose run logged ``manifest`` (if any) and tagged ``dataset_dir`` (if any)."""
    run_id = client.create_run(experiment).info.run_id
    if manifest is not None:
        client.log_dict(run_id, manifest.to_dict(), TRAINING_DATA_ARTIFACT)
    if dataset_dir is not None:
        client.set_tag(run_id, DATASET_DIR_TAG, dataset_dir)
    client.create_registered_model(MODEL)
    version = client.create_model_version(MODEL, source=f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias(MODEL, "champion", version.version)
    return client.get_model_version(MODEL, version.version)


def test_no_champion_says_so(store, datasets):
    client, _ = store
    outcome = measure_drift(client, MODEL, datasets[1].manifest)
    assert outcome.status == NO_CHAMPION and "no champion yet" in outcome.message


def test_the_champions_logged_manifest_is_the_reference_and_drift_is_logged(store, datasets):
    client, experiment = store
    champion_with(client, experiment, manifest=datasets[0].manifest)
    outcome = measure_drift(client, MODEL, datasets[1].manifest)
    assert outcome.status == MEASURED and outcome.champion_version == "1"
    assert outcome.report.worst.feature == "x" and outcome.report.worst.psi > 0.5
    run_id = client.create_run(experiment).info.run_id
    log_drift(client, run_id, outcome, max_psi=0.25)
    run = client.get_run(run_id)
    assert run.data.metrics["data_drift_max_psi"] == pytest.approx(outcome.report.max_psi)
    per_feature = {key: value for key, value in run.data.metrics.items() if key.startswith("drift_psi/")}
    assert per_feature == {f"drift_psi/{d.feature}": pytest.approx(d.psi) for d in outcome.report.features}
    assert run.data.tags["drift.worst_feature"] == "x" and run.data.tags["drift.champion_version"] == "1"
    assert {a.path for a in client.list_artifacts(run_id, "drift")} == {"drift/data_drift.png", "drift/data_drift.json"}


def test_a_features_psi_metric_is_named_as_mlflow_takes_it():
    from ddpflow.tracking.drift import psi_metric

    assert psi_metric("emb[3]") == "drift_psi/emb_3_" and psi_metric("photo:width") == "drift_psi/photo:width"
    assert psi_metric("a/b") == "drift_psi/a_b" and psi_metric("..") == "drift_psi/__"


def test_without_the_artifact_the_champions_dataset_directory_is_read(store, datasets):
    client, experiment = store
    version = champion_with(client, experiment, dataset_dir=str(datasets[0].dataset_dir))
    outcome = drift_from_version(client, version, datasets[1].manifest)
    assert outcome.status == MEASURED and outcome.report.reference_fingerprint == datasets[0].fingerprint


def test_an_old_manifest_makes_drift_unavailable_and_logs_nothing(store, datasets):
    client, experiment = store
    old = dataclasses.replace(datasets[0].manifest, feature_histograms=None)
    champion_with(client, experiment, manifest=old)
    outcome = measure_drift(client, MODEL, datasets[1].manifest)
    assert outcome.status == UNAVAILABLE and outcome.report is None
    assert "drift from champion v1's training data is not available" in outcome.message
    assert "prepared without feature histograms" in outcome.message
    run_id = client.create_run(experiment).info.run_id
    log_drift(client, run_id, outcome, max_psi=0.25)
    assert client.get_run(run_id).data.metrics == {} and client.list_artifacts(run_id) == []


def test_a_champion_whose_profile_is_gone_makes_drift_unavailable_with_the_reason(store, datasets, tmp_path):
    client, experiment = store
    champion_with(client, experiment, dataset_dir=str(tmp_path / "deleted-shards"))
    outcome = measure_drift(client, MODEL, datasets[1].manifest)
    assert outcome.status == UNAVAILABLE
    assert f"has no {TRAINING_DATA_ARTIFACT}" in outcome.message and "deleted-shards is gone" in outcome.message
