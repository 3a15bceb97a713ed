"""Tracking and the champion gate against a real SQLite MLflow store (tests/conftest.py: mlflow_store)."""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

from ddpflow.tracking.registration import register_candidate, register_run
from ddpflow.tracking.registry import RegistrationError, champion_checkpoint, find_alias, is_transient
from ddpflow.tracking.runs import (
    TrackingUnreachableError,
    check_tracking_reachable,
    end_pipeline_run,
    log_evaluation,
    start_pipeline_run,
    use_tracking_uri,
)
from ddpflow.tracking.tracking_uri import resolve_tracking_uri, tracking_uri_note
from devtools.ports import free_port
from tests.manifest_datasets import train_typed_model
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write_json
from training.core.manifest import read_manifest
from training.inference.evaluate import evaluate_split
from training.inference.model_file import load_model_checkpoint

PREFECT = {"flow_run_id": "0000-flow-run", "flow_run_name": "brave-otter", "deployment_name": "nightly"}
DDP = {"nproc_per_node": 2, "nnodes": 1, "backend": "gloo"}


@pytest.fixture
def make_config(mlflow_store, tmp_path):
    uri, artifacts = mlflow_store

    def make(**registry) -> PipelineConfig:
        return PipelineConfig.model_validate(
            {
                "mlflow": {"tracking_uri": uri, "artifact_location": artifacts},
                "data": {"root": str(tmp_path / "shards")},
                "registry": {"model_name": "gate-test", **registry},
            }
        )

    return make


def start_run(config: PipelineConfig, dataset, name: str = "run"):
    """The pipeline's MLflow run on ``dataset``: (its manifest, the run id)."""
    manifest = read_manifest(dataset)
    return manifest, start_pipeline_run(config, name, PREFECT, manifest.fingerprint, manifest, DDP, dataset_dir=dataset)


def pipeline(config: PipelineConfig, dataset, model_path, metrics=None):
    """What the flow does after training, minus Prefect: run, evaluate, register."""
    _, run_id = start_run(config, dataset)
    metrics = metrics if metrics is not None else evaluate_split(model_path, dataset).metrics
    decision = register_candidate(config, run_id, str(model_path), str(dataset), metrics, config.mlflow.tracking_uri)
    return run_id, decision


def alias_version(client, alias: str) -> str:
    return str(find_alias(client, "gate-test", alias).version)  # the SQL store answers int, the REST API str


def versions(config) -> list:
    return MlflowClient(config.mlflow.tracking_uri).search_model_versions(f"name = '{config.registry.model_name}'")


def test_pipeline_run_records_lineage(make_config, dataset_factory):
    config = make_config()
    dataset = dataset_factory(rows={"train": 200, "val": 20, "test": 20})
    manifest, run_id = start_run(config, dataset, "brave-otter")
    client = MlflowClient(config.mlflow.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "brave-otter" and run.info.status == "RUNNING"
    assert run.data.params["train.epochs"] == str(config.train.epochs)
    assert run.data.params["registry.model_name"] == "gate-test"
    tags = run.data.tags
    assert tags["prefect.flow_run_id"] == "0000-flow-run" and tags["prefect.deployment"] == "nightly"
    assert tags["data.fingerprint"] == manifest.fingerprint and tags["data.source"] == manifest.source
    assert tags["ddp.world_size"] == "2" and tags["ddp.backend"] == "gloo" and tags["ddp.nnodes"] == "1"
    inputs = {
        tag.value: entry
        for entry in run.inputs.dataset_inputs
        for tag in entry.tags
        if tag.key == "mlflow.data.context"
    }
    assert sorted(inputs) == ["test", "train", "val"]
    assert inputs["train"].dataset.digest.startswith(manifest.fingerprint[:8])
    assert str(dataset / "train") in inputs["train"].dataset.source
    assert experiment_location(client, run) == config.mlflow.artifact_location
    end_pipeline_run(run_id, config.mlflow.tracking_uri, status="FAILED")
    assert client.get_run(run_id).info.status == "FAILED"


def experiment_location(client, run) -> str:
    return client.get_experiment(run.info.experiment_id).artifact_location


def test_better_model_promoted_worse_stays_challenger(make_config, dataset_factory, model_factory):
    config = make_config()
    dataset = dataset_factory()
    weak, strong = model_factory(dataset, "weak", steps=3), model_factory(dataset, "strong", steps=80)
    client = MlflowClient(config.mlflow.tracking_uri)

    _, first = pipeline(config, dataset, weak)
    assert first.decision == "promoted" and first.champion_status == "none"

    strong_run, second = pipeline(config, dataset, strong)
    assert second.decision == "promoted", second.reason
    assert second.champion_version == first.version
    # The gate re-scored the old champion on the same shards: its number is the weak model's own.
    assert second.champion_value == pytest.approx(first.candidate_value)
    assert second.candidate_value > second.champion_value
    assert alias_version(client, "champion") == second.version
    assert alias_version(client, "previous-champion") == first.version

    _, third = pipeline(config, dataset, weak)
    assert third.decision == "challenger"
    assert alias_version(client, "champion") == second.version  # untouched
    assert alias_version(client, "challenger") == third.version

    tags = client.get_model_version("gate-test", third.version).tags
    assert tags["gate.decision"] == "challenger" and tags["gate.champion_version"] == second.version
    assert float(tags["gate.champion_value"]) == pytest.approx(second.candidate_value)
    assert (
        tags["data.fingerprint"] == read_manifest(dataset).fingerprint
        and tags["prefect.flow_run_name"] == "brave-otter"
    )
    run = client.get_run(strong_run)
    assert run.data.tags["registry.decision"] == "promoted"
    assert run.data.metrics["gate_champion_test_accuracy"] == pytest.approx(first.candidate_value)
    assert "fingerprint" in client.get_model_version("gate-test", second.version).description


def test_min_delta_keeps_champion(make_config, dataset_factory, model_factory):
    config = make_config(min_delta=0.5)
    dataset = dataset_factory()
    pipeline(config, dataset, model_factory(dataset, "weak", steps=3))
    _, decision = pipeline(config, dataset, model_factory(dataset, "strong", steps=80))
    assert decision.decision == "challenger"  # better, but not by 0.5


def test_retry_creates_no_second_version(make_config, dataset_factory, model_factory):
    config = make_config()
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    run_id, first = pipeline(config, dataset, model_path)
    metrics = evaluate_split(model_path, dataset).metrics
    again = register_candidate(config, run_id, str(model_path), str(dataset), metrics, config.mlflow.tracking_uri)
    assert again.already_registered and again.version == first.version and again.decision == "promoted"
    assert len(versions(config)) == 1
    client = MlflowClient(config.mlflow.tracking_uri)
    experiment = client.get_run(run_id).info.experiment_id
    assert len(client.search_logged_models([experiment])) == 1
    # An attempt that moved @champion but died before marking the version applied: the retry finishes it.
    client.set_model_version_tag("gate-test", first.version, "gate.state", "recorded")
    finished = register_candidate(config, run_id, str(model_path), str(dataset), metrics, config.mlflow.tracking_uri)
    assert finished.decision == "promoted" and finished.version == first.version and not finished.already_registered
    tags = client.get_model_version("gate-test", first.version).tags
    assert tags["gate.decision"] == "promoted" and tags["gate.state"] == "applied"
    assert alias_version(client, "champion") == first.version
    assert len(versions(config)) == 1


def test_retry_after_a_crash_between_logging_and_registering(make_config, dataset_factory, model_factory):
    """An attempt that logged the model but died before create_model_version: the retry reuses that model."""
    from training.inference.serving import log_pyfunc_model

    config = make_config()
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    manifest, run_id = start_run(config, dataset)
    example = pq.read_table(manifest.split_files(dataset, "test")[0]).to_pandas().head(3)
    with use_tracking_uri(config.mlflow.tracking_uri):
        logged = log_pyfunc_model(model_path, example, run_id=run_id, tags={"ddpflow.run_id": run_id})
    decision = register_candidate(
        config,
        run_id,
        str(model_path),
        str(dataset),
        evaluate_split(model_path, dataset).metrics,
        config.mlflow.tracking_uri,
    )
    client = MlflowClient(config.mlflow.tracking_uri)
    assert client.search_logged_models([client.get_run(run_id).info.experiment_id])[0].model_id == logged.model_id
    assert len(client.search_logged_models([client.get_run(run_id).info.experiment_id])) == 1
    assert client.get_model_version("gate-test", decision.version).source == logged.model_uri


def test_champion_pyfunc_predicts_like_evaluate_on_raw_columns(make_config, dataset_factory, model_factory):
    config = make_config()
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    pipeline(config, dataset, model_path)
    manifest = read_manifest(dataset)
    frame = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    with use_tracking_uri(config.mlflow.tracking_uri):
        served = mlflow.pyfunc.load_model("models:/gate-test@champion")
    predicted = served.predict(frame[manifest.features])  # float32, as the source has them
    evaluated = evaluate_split(model_path, dataset, return_predictions=True).predictions
    np.testing.assert_array_equal(np.asarray(predicted), np.asarray(manifest.label_mapping)[evaluated])
    assert served.metadata.get_input_schema().input_names() == manifest.features
    assert {spec.type.name for spec in served.metadata.get_input_schema().inputs} == {"double"}  # float32 too


def test_a_model_pt_from_before_source_types_is_served_as_float64(
    make_config, dataset_factory, model_factory, tmp_path
):
    """A model.pt written before it recorded its inputs' source types still loads, logs and serves: its numeric
    inputs are declared double (float64) as they were, so what its users send keeps working."""
    import torch

    from training.inference.serving import log_pyfunc_model

    config = make_config()
    dataset = dataset_factory(rows={"train": 300, "val": 30, "test": 60})
    checkpoint = torch.load(model_factory(dataset), weights_only=True)
    assert checkpoint.pop("source_types") == dict.fromkeys(read_manifest(dataset).features, "float")
    old = tmp_path / "old.pt"
    torch.save(checkpoint, old)
    manifest, run_id = start_run(config, dataset)
    frame = pq.read_table(manifest.split_files(dataset, "test")[0]).to_pandas()
    with use_tracking_uri(config.mlflow.tracking_uri):
        logged = log_pyfunc_model(old, frame.head(3), run_id=run_id)
        served = mlflow.pyfunc.load_model(logged.model_uri)
    assert {spec.type.name for spec in served.metadata.get_input_schema().inputs} == {"double"}
    evaluated = evaluate_split(old, dataset, return_predictions=True).predictions
    predicted = served.predict(frame[manifest.features].astype("float64"))
    np.testing.assert_array_equal(np.asarray(predicted), np.asarray(manifest.label_mapping)[evaluated])


def nulls_table(rows: int = 1200, seed: int = 3) -> pa.Table:
    """Numbers as real tables hold them: an int64 column with nulls (informative: a missing age means
    label 1), a float column with NaN and nulls, a clean float, an int64 label."""
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 90, size=rows)
    no_age = rng.random(rows) < 0.2
    income = rng.lognormal(3.0, 1.0, size=rows)
    income[rng.random(rows) < 0.05] = np.nan
    income_nulls = rng.random(rows) < 0.05
    x = rng.normal(size=rows)
    label = (no_age | (x > 0.8)).astype(np.int64)
    return pa.table(
        {
            "age": pa.array(age, mask=no_age),
            "income": pa.array(income, mask=income_nulls),  # NaN and null: both missing
            "x": x,
            "label": label,
        }
    )


def test_a_table_with_nulls_trains_and_its_served_model_scores_rows_with_nulls(make_config, tmp_path):
    """Nulls are values: int64 and float inputs with nulls prepare (not refused), the model sees each one's
    missing indicator, and the champion served through MLflow scores rows with None, NaN and pandas' nullable
    Int64 as the evaluation scored them; a missing age means label 1, which only the indicator can tell."""
    from training.prepare.dataset import prepare_dataset

    source = tmp_path / "nulls.parquet"
    pq.write_table(nulls_table(), source)
    config = make_config()
    data = config.data.model_copy(update={"source": str(source), "label": "label"})
    prepared = prepare_dataset(data)
    manifest = prepared.manifest
    assert manifest.dropped_rows == 0 and manifest.n_features == 5  # age, income, x + 2 indicators
    assert set(prepared.summary()["null_rates"]) == {"age", "income"}
    dataset = prepared.dataset_dir
    from training.inference.reference import _Columns  # the boosting reference: missing values as NaN, natively

    shard = pq.read_table(manifest.split_files(dataset, "train")[0])
    codes = _Columns(manifest, dataset).codes(shard)
    assert np.isnan(codes[:, 0]).sum() == shard["age"].null_count > 0  # not the network's imputed mean
    model_path = train_typed_model(dataset, tmp_path / "runs" / "nulls" / "model.pt")
    run_id, decision = pipeline(config, dataset, model_path)
    assert decision.version is not None
    frame = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    assert frame["age"].isna().any() and frame["income"].isna().any()
    evaluated = evaluate_split(model_path, dataset, return_predictions=True)
    assert evaluated.metrics["test_accuracy"] > 0.9  # the indicator carries the missing ages
    expected = np.asarray(manifest.label_mapping)[evaluated.predictions]
    with use_tracking_uri(config.mlflow.tracking_uri):
        served = mlflow.pyfunc.load_model("models:/gate-test@champion")
    schema = {spec.name: spec for spec in served.metadata.get_input_schema().inputs}
    assert schema["age"].type.to_dict() == {"type": "any"} and schema["income"].type.name == "double"
    assert all(spec.required for spec in schema.values())
    features = frame[manifest.features]  # the shard's float32 with NaN where a value is missing
    np.testing.assert_array_equal(np.asarray(served.predict(features)), expected)
    source_rows = pq.read_table(source).to_pandas()  # the source's own dtypes: age float64 with NaN
    by_source = served.predict(source_rows[manifest.features].head(200))
    nullable = source_rows[manifest.features].head(200).astype({"age": "Int64"})  # pandas' nullable integer
    np.testing.assert_array_equal(np.asarray(served.predict(nullable)), np.asarray(by_source))
    by_hand = pd.DataFrame({"age": [None, 40, None], "income": [None, np.nan, 12.0], "x": [0.0, 0.0, 2.0]})
    assert np.asarray(served.predict(by_hand)).tolist()[0] == 1  # no age: label 1
    ints = pd.DataFrame({"age": [30, 40], "income": [10.0, 20.0], "x": [0.0, 0.1]})  # a plain int64 column
    assert len(served.predict(ints)) == 2


def test_champion_checkpoint_downloads_the_champions_weights(make_config, dataset_factory, model_factory, tmp_path):
    config = make_config()
    assert champion_checkpoint(config) is None  # no registered model yet
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    pipeline(config, dataset, model_path)
    downloaded = champion_checkpoint(config, tmp_path / "warm")
    _, original = load_model_checkpoint(model_path)
    model, meta = load_model_checkpoint(downloaded)
    assert meta["fingerprint"] == original["fingerprint"] and downloaded.name == "model.pt"


def test_nan_metric_registers_nothing(make_config, dataset_factory, model_factory):
    config = make_config()
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    metrics = {**evaluate_split(model_path, dataset).metrics, "test_loss": math.nan}
    run_id, decision = pipeline(config, dataset, model_path, metrics=metrics)
    assert decision.decision == "rejected" and "test_loss" in decision.reason and decision.version is None
    assert versions(config) == []
    client = MlflowClient(config.mlflow.tracking_uri)
    assert client.search_logged_models([client.get_run(run_id).info.experiment_id]) == []
    assert client.get_run(run_id).data.tags["registry.decision"] == "rejected"


def test_min_metric_floor(make_config, dataset_factory, model_factory):
    dataset = dataset_factory()
    model_path = model_factory(dataset, steps=3)
    _, decision = pipeline(make_config(min_metric=0.99), dataset, model_path)
    assert decision.decision == "rejected" and "min_metric" in decision.reason
    assert versions(make_config()) == []
    # Lower is better for rmse: the floor is a ceiling.
    regression = dataset_factory(task="regression")
    regressor = model_factory(regression, "reg", steps=150)
    rmse = evaluate_split(regressor, regression).metrics["test_rmse"]
    _, too_high = pipeline(make_config(min_metric=rmse / 2, model_name="reg-a"), regression, regressor)
    assert too_high.decision == "rejected"
    _, fine = pipeline(make_config(min_metric=rmse * 2, model_name="reg-b"), regression, regressor)
    assert fine.decision == "promoted"


def test_incompatible_champion_is_replaced(make_config, dataset_factory, model_factory):
    config = make_config()
    old_data = dataset_factory()
    _, first = pipeline(config, old_data, model_factory(old_data, "old", steps=80))
    new_data = dataset_factory(features=["a", "b", "c", "d", "e", "f"], fingerprint="renamed")
    _, decision = pipeline(config, new_data, model_factory(new_data, "new", steps=3))
    assert decision.decision == "promoted"
    assert decision.champion_status.startswith("incompatible") and "['f0'" in decision.champion_status
    assert "cannot score this data" in decision.reason and "['f0'" in decision.reason  # names the columns
    assert decision.champion_value is None and decision.champion_version == first.version
    client = MlflowClient(config.mlflow.tracking_uri)
    assert alias_version(client, "previous-champion") == first.version


def test_register_run_reruns_for_a_finished_run(make_config, dataset_factory, model_factory):
    config = make_config()
    dataset = dataset_factory()
    model_path = model_factory(dataset)
    _, run_id = start_run(config, dataset)
    client = MlflowClient(config.mlflow.tracking_uri)
    with pytest.raises(RegistrationError, match="never evaluated"):
        register_run(run_id, tracking_uri=config.mlflow.tracking_uri)
    for name, value in evaluate_split(model_path, dataset).metrics.items():
        client.log_metric(run_id, name, value)
    client.set_tag(run_id, "ddpflow.model_path", str(model_path))
    client.set_tag(run_id, "ddpflow.dataset_dir", str(dataset))
    end_pipeline_run(run_id, config.mlflow.tracking_uri)
    decision = register_run(run_id, tracking_uri=config.mlflow.tracking_uri)  # config comes from the run
    assert decision.decision == "promoted" and decision.model_name == "gate-test"
    assert register_run(run_id, tracking_uri=config.mlflow.tracking_uri).already_registered
    assert len(versions(config)) == 1
    with pytest.raises(RegistrationError, match="does not exist"):
        register_run("0" * 32, tracking_uri=config.mlflow.tracking_uri)


def test_missing_gate_metric_is_a_clear_error(make_config, dataset_factory, model_factory):
    config = make_config(metric="test_f2")
    dataset = dataset_factory(rows={"train": 200, "val": 20, "test": 20})
    with pytest.raises(RegistrationError, match="test_f2"):
        pipeline(config, dataset, model_factory(dataset, steps=1))


def test_unreachable_tracking_server_is_named():
    uri = f"http://127.0.0.1:{free_port()}"  # bound, then released: nothing listens there
    with pytest.raises(TrackingUnreachableError, match=uri.replace(".", r"\.")):
        check_tracking_reachable(uri, timeout_s=2)


def test_tracking_uri_resolution(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(PipelineConfig()) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    relative = PipelineConfig.model_validate({"mlflow": {"tracking_uri": "sqlite:///state/m.db"}})
    assert resolve_tracking_uri(relative) == f"sqlite:///{tmp_path / 'state' / 'm.db'}"
    assert tracking_uri_note(relative) is None  # one of the two unset: nothing to say
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(relative) == "http://127.0.0.1:5000"  # the variable wins, and says so
    assert tracking_uri_note(relative) == (
        "MLflow store http://127.0.0.1:5000 from $MLFLOW_TRACKING_URI, which wins over the config's "
        "mlflow.tracking_uri sqlite:///state/m.db"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'state' / 'm.db'}")
    assert tracking_uri_note(relative) is None  # the same store, written two ways
    check_tracking_reachable(f"sqlite:///{tmp_path / 'new' / 'dir' / 'mlflow.db'}")  # creates the folder
    assert (tmp_path / "new" / "dir").is_dir()


def test_transient_errors_are_told_apart():
    assert is_transient(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))
    assert is_transient(ConnectionRefusedError("refused"))
    assert is_transient(MlflowException("(sqlite3.OperationalError) database is locked"))
    assert not is_transient(MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_transient(MlflowException("bad filter", error_code=INVALID_PARAMETER_VALUE))
    assert not is_transient(RegistrationError("registry.metric 'x' is not among ..."))
    assert not is_transient(FileNotFoundError("model.pt"))


def test_regression_evaluation_logs_a_residual_plot(make_config, dataset_factory, model_factory, tmp_path):
    config = make_config()
    dataset = dataset_factory(task="regression", rows={"train": 600, "val": 50, "test": 120})
    model_path = model_factory(dataset, steps=50)
    _, run_id = start_run(config, dataset, "reg")
    result = evaluate_split(model_path, dataset, return_predictions=True, max_predictions=100)
    metrics_path = atomic_write_json(tmp_path / "eval" / "metrics.json", result.to_dict())
    log_evaluation(config.mlflow.tracking_uri, run_id, result, metrics_path, model_path, dataset)
    client = MlflowClient(config.mlflow.tracking_uri)
    assert {item.path for item in client.list_artifacts(run_id, "eval")} == {"eval/metrics.json", "eval/residuals.png"}
    run = client.get_run(run_id)
    assert run.data.metrics["test_r2"] == pytest.approx(result.metrics["test_r2"])
    # What `ddpflow register --run-id` reads back to gate this run later.
    assert run.data.tags["ddpflow.model_path"] == str(model_path.resolve())
    assert run.data.tags["ddpflow.dataset_dir"] == str(dataset.resolve())


def test_champion_loads_in_a_fresh_process_without_the_repository(
    make_config, dataset_factory, model_factory, tmp_path
):
    """code_paths make the logged model self-contained: `training` is imported from the model itself."""
    import json
    import os
    import subprocess
    import sys

    config = make_config()
    dataset = dataset_factory(rows={"train": 600, "val": 20, "test": 50})
    pipeline(config, dataset, model_factory(dataset))
    script = (
        "import json, mlflow, pandas as pd\n"
        f"mlflow.set_tracking_uri({config.mlflow.tracking_uri!r})\n"
        "model = mlflow.pyfunc.load_model('models:/gate-test@champion')\n"
        "out = model.predict(pd.DataFrame({f'f{i}': [40.0, 30.0] for i in range(6)}))\n"
        "import training\n"
        "print(json.dumps({'labels': [str(v) for v in out], 'training': training.__file__}))\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(answer["labels"]) == 2 and set(answer["labels"]) <= {"cat", "dog", "eel", "fox"}
    assert "/code/training/" in answer["training"] and not answer["training"].startswith(
        str(Path(__file__).resolve().parents[3])
    )
