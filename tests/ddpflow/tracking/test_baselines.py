"""The baselines every evaluation is compared with (training/inference/baselines.py, reference.py): the trivial one
equals the values computed by hand, the reference is fitted on the train split and scored on the same test rows
with the same metric definitions, and a deliberately useless model is rejected even as the first model, through
the real registration step on a SQLite MLflow store."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric

from ddpflow.tracking.registration import register_candidate, register_run
from ddpflow.tracking.registry import find_alias
from ddpflow.tracking.runs import DATASET_DIR_TAG, MODEL_PATH_TAG, start_pipeline_run
from training.core.config import DataConfig, PipelineConfig
from training.core.manifest import read_manifest, write_manifest
from training.inference.baselines import evaluate_baselines, trivial_baseline
from training.inference.evaluate import evaluate_split
from training.inference.model_file import inference_checkpoint
from training.inference.reference import FittedReference, fit_before_scoring, fit_reference, reference_baseline
from training.kinds.normalisation import Normaliser
from training.models.registry import ModelSpec, build_model
from training.objectives.registry import make_objective
from training.prepare.dataset import prepare_dataset

MODEL = "baseline-gate"


def labels_of(dataset, split: str) -> np.ndarray:
    manifest = read_manifest(dataset)
    return np.concatenate([pq.read_table(f)["label"].to_numpy() for f in manifest.split_files(dataset, split)])


# ----------------------------------------------------------------------------- the trivial baseline, by hand


@pytest.mark.parametrize("objective_name", ["softmax", "binary"])
def test_the_trivial_baseline_is_the_train_prior_scored_on_the_test_rows(dataset_factory, objective_name):
    n_classes = 2 if objective_name == "binary" else 3
    dataset = dataset_factory(n_classes=n_classes, rows={"train": 300, "val": 10, "test": 77}, shard_rows=50)
    manifest = read_manifest(dataset)
    train, test = labels_of(dataset, "train"), labels_of(dataset, "test")
    prior = np.bincount(train, minlength=n_classes) / len(train)
    majority = int(prior.argmax())
    objective = make_objective(objective_name, "classification", n_classes)

    metrics = trivial_baseline(objective, Normaliser.from_manifest(manifest), manifest, dataset)

    assert metrics["test_samples"] == len(test) == 77
    assert metrics["test_accuracy"] == pytest.approx(np.mean(test == majority), abs=1e-12)
    assert metrics["test_log_loss"] == pytest.approx(-np.mean(np.log(prior[test])), rel=1e-6)
    hits = int(np.sum(test == majority))
    assert metrics["test_macro_f1"] == pytest.approx(2 * hits / (len(test) + hits) / n_classes, rel=1e-9)
    if objective_name == "binary":
        assert metrics["test_roc_auc"] == 0.5  # every row tied


def test_the_trivial_regression_baseline_predicts_the_train_mean(dataset_factory):
    dataset = dataset_factory(task="regression", target_stats=True, rows={"train": 300, "val": 10, "test": 61})
    manifest = read_manifest(dataset)
    mean = labels_of(dataset, "train").astype(np.float64).mean()
    test = labels_of(dataset, "test").astype(np.float64)

    metrics = trivial_baseline(
        make_objective("mse", "regression", None), Normaliser.from_manifest(manifest), manifest, dataset
    )

    assert metrics["test_rmse"] == pytest.approx(math.sqrt(np.mean((test - mean) ** 2)), rel=1e-5)
    assert metrics["test_mae"] == pytest.approx(np.mean(np.abs(test - mean)), rel=1e-5)
    expected_r2 = 1 - np.sum((test - mean) ** 2) / np.sum((test - test.mean()) ** 2)
    assert metrics["test_r2"] == pytest.approx(expected_r2, abs=1e-5) and metrics["test_r2"] <= 0


def test_the_trivial_multilabel_baseline_is_each_labels_train_prior(dataset_factory):
    """Each label's train share as its constant logit: a label held by more than half the train rows is always
    predicted, the others never; the loss is the mean binary cross entropy of those priors."""
    dataset = dataset_factory(n_classes=3, rows={"train": 200, "val": 10, "test": 50}, shard_rows=40)
    manifest = read_manifest(dataset)
    rng = np.random.default_rng(3)
    share = np.array([0.7, 0.2, 0.45])  # label 0 mostly on, the others mostly off
    hot = {}
    for split in ("train", "val", "test"):
        hot[split] = []
        for path in manifest.split_files(dataset, split):
            table = pq.read_table(path)
            rows = rng.random((table.num_rows, 3)) < share
            hot[split].append(rows)
            lists = pa.array([np.flatnonzero(row).tolist() for row in rows], pa.list_(pa.int64()))
            pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", lists), path)
    manifest = dataclasses.replace(manifest, task="multilabel", train_class_counts=None)
    write_manifest(dataset, manifest)
    train, test = np.concatenate(hot["train"]), np.concatenate(hot["test"]).astype(np.float64)
    prior = train.mean(axis=0)
    objective = make_objective("multilabel", "multilabel", 3, multi_hot_label=True)

    metrics = trivial_baseline(objective, Normaliser.from_manifest(manifest), manifest, dataset)

    predicted = prior > 0.5
    assert metrics["test_exact_match"] == pytest.approx(np.mean(((test > 0.5) == predicted).all(axis=1)), abs=1e-12)
    entropy = -(test * np.log(prior) + (1 - test) * np.log(1 - prior)).mean(axis=1).mean()
    assert metrics["test_loss"] == pytest.approx(entropy, rel=1e-5)
    assert metrics["test_samples"] == 50


# ----------------------------------------------------------------------------- the reference model


def test_the_reference_is_scored_on_the_models_test_rows(dataset_factory, model_factory):
    dataset = dataset_factory(rows={"train": 900, "val": 50, "test": 313}, shard_rows=200)
    model_path = model_factory(dataset, steps=40)
    evaluated = evaluate_split(model_path, dataset)

    baselines = evaluate_baselines(model_path, dataset, "test", reference=True)

    assert baselines.reference["test_samples"] == baselines.trivial["test_samples"] == evaluated.samples == 313
    assert set(baselines.reference) == set(evaluated.metrics)  # the same metrics, by the same names
    assert baselines.reference["test_accuracy"] > baselines.trivial["test_accuracy"] + 0.2
    assert baselines.reference_fit["rows"] == 900
    flat = baselines.metrics()
    assert flat["baseline_reference/test_accuracy"] == baselines.reference["test_accuracy"]
    assert not any("_precision_" in name for name in flat)  # per-class numbers stay the model's own
    off = evaluate_baselines(model_path, dataset, "test", reference=False)
    assert off.reference is None and off.trivial == baselines.trivial and "eval.reference is false" in off.notes[0]


def test_a_reference_fitted_before_the_model_scores_as_one_fitted_after_it(dataset_factory, model_factory):
    """The pipeline fits the reference while the model trains (it needs the prepared data only) and scores it once
    the model exists: the same metrics as fitting it then, and a failed early fit is named, never raised."""
    dataset = dataset_factory(rows={"train": 600, "val": 50, "test": 211}, shard_rows=200)
    fitted = fit_before_scoring(read_manifest(dataset), dataset, 1000)  # before any model exists
    model_path = model_factory(dataset, steps=20)

    early = evaluate_baselines(model_path, dataset, "test", reference=True, fitted_reference=fitted)
    late = evaluate_baselines(model_path, dataset, "test", reference=True)

    assert early.reference == late.reference and early.reference["test_samples"] == 211
    assert early.reference_fit["rows"] == 600 and early.notes[-1].endswith(", beside the training")
    failed = evaluate_baselines(model_path, dataset, "test", fitted_reference=FittedReference(error="ValueError: x"))
    assert failed.reference is None and failed.notes[-1] == "no reference model: fitting it failed: ValueError: x"
    assert fit_before_scoring(read_manifest(dataset), Path("/nonexistent"), 1000).error  # the error, not raised


def test_the_reference_takes_a_table_as_it_is_and_matches_scikit_learns_own_scores(tmp_path):
    """int64 and string columns, nulls in a categorical, a categorical of more values than boosting's 255
    categories (noise here), a hashed id; fitted on a sample above the row cap; its accuracy and log loss
    through ddpflow's tallies equal scikit-learn's on the same rows."""
    rng = np.random.default_rng(7)
    rows = 3000
    shop = rng.integers(0, 400, size=rows)  # 400 values: more than 255 categories
    region = rng.choice(["north", "south", "east"], size=rows).astype(object)
    region[::41] = None
    amount = rng.lognormal(3, 1, size=rows).round().astype(np.int64)
    late = ((region == "north") ^ (amount > 30)).astype(np.int64)
    table = pa.table(
        {
            "amount": amount,
            "region": pa.array(region, type=pa.string()),
            "shop": pa.array([f"s{value}" for value in shop]),
            "customer": rng.integers(0, 10**9, size=rows),
            "late": late,
        }
    )
    source = tmp_path / "trips.parquet"
    pq.write_table(table, source)
    inputs = {
        "amount": "numeric",
        "region": "categorical",
        "shop": "categorical",
        "customer": {"kind": "hashed", "buckets": 1000},
    }
    data = DataConfig(source=str(source), root=str(tmp_path / "shards"), label="late", inputs=inputs)
    dataset = prepare_dataset(data).dataset_dir
    manifest = read_manifest(dataset)
    objective = make_objective("softmax", "classification", 2)

    scored = reference_baseline(objective, Normaliser.from_manifest(manifest), manifest, dataset, "test", 1000)

    assert scored.fit["rows"] == 1000 < scored.fit["train_rows"] == manifest.rows("train")
    assert scored.metrics["test_samples"] == manifest.rows("test")
    model, columns, _ = fit_reference(manifest, dataset, 1000)  # the same sample (fixed seed): the same model
    test = pa.concat_tables([pq.read_table(f) for f in manifest.split_files(dataset, "test")])
    matrix = columns.matrix(columns.codes(test))
    y = test["late"].to_numpy()
    from sklearn.metrics import accuracy_score, log_loss

    assert scored.metrics["test_accuracy"] == pytest.approx(accuracy_score(y, model.predict(matrix)), abs=1e-12)
    assert scored.metrics["test_log_loss"] == pytest.approx(log_loss(y, model.predict_proba(matrix)), rel=1e-5)
    assert scored.metrics["test_accuracy"] > 0.9  # the region x amount interaction: boosting finds it


# ----------------------------------------------------------------------------- a useless model at the gate


def constant_model_file(dataset, path):
    """model.pt of tests/stand_in_models.py's constant model: the same outputs for every row."""
    manifest = read_manifest(dataset)
    spec = ModelSpec(
        model="tests.stand_in_models:constant_model", n_features=manifest.n_features, n_outputs=manifest.n_outputs
    )
    model = build_model(spec, manifest.features)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(inference_checkpoint(model.state_dict(), spec, manifest, epochs=1, metrics={}), path)
    return path


@pytest.fixture
def config(mlflow_store, tmp_path) -> PipelineConfig:
    uri, artifacts = mlflow_store
    return PipelineConfig.model_validate(
        {"mlflow": {"tracking_uri": uri, "artifact_location": artifacts}, "registry": {"model_name": MODEL}}
    )


def gate(config, dataset, model_path, with_baselines: bool):
    """The pipeline's evaluate and register steps, minus Prefect: (run id, decision)."""
    manifest = read_manifest(dataset)
    run_id = start_pipeline_run(config, "run", {}, manifest.fingerprint, manifest, {"nproc_per_node": 1}, dataset)
    metrics = evaluate_split(model_path, dataset).metrics
    if with_baselines:  # what the evaluate task hands on; without: a run evaluated before baselines existed
        metrics |= evaluate_baselines(model_path, dataset, "test", reference=False).metrics()
    uri = config.mlflow.tracking_uri
    return run_id, register_candidate(config, run_id, str(model_path), str(dataset), metrics, uri)


@pytest.mark.parametrize("with_baselines", [True, False])
def test_a_useless_model_is_rejected_even_as_the_first_model(
    config, dataset_factory, model_factory, tmp_path, with_baselines
):
    dataset = dataset_factory(rows={"train": 600, "val": 20, "test": 200})
    useless = constant_model_file(dataset, tmp_path / "useless" / "model.pt")

    run_id, decision = gate(config, dataset, useless, with_baselines)

    assert decision.decision == "rejected" and decision.version is None
    assert "no better than guessing" in decision.reason and "baseline" in decision.reason
    client = MlflowClient(config.mlflow.tracking_uri)
    assert client.get_run(run_id).data.tags["registry.decision"] == "rejected"
    assert client.search_model_versions(f"name = '{MODEL}'") == []  # never registered, no champion crowned
    # A model that learnt something is promoted on the same data: the rule does not block real models.
    _, learnt = gate(config, dataset, model_factory(dataset, steps=40), with_baselines)
    assert learnt.decision == "promoted" and learnt.version == "1"
    assert str(find_alias(client, MODEL).version) == "1"


def test_trailing_the_reference_is_a_warning_or_with_require_reference_a_rejection(
    mlflow_store, dataset_factory, model_factory
):
    uri, artifacts = mlflow_store
    dataset = dataset_factory(rows={"train": 600, "val": 20, "test": 200})
    weak = model_factory(dataset, "weak", steps=1)  # beats guessing, trails boosting
    manifest = read_manifest(dataset)
    metrics = evaluate_split(weak, dataset).metrics | evaluate_baselines(weak, dataset, "test").metrics()
    assert metrics["baseline_trivial/test_accuracy"] < metrics["test_accuracy"]
    assert metrics["test_accuracy"] < metrics["baseline_reference/test_accuracy"] - 0.02, metrics

    def register(**registry):
        config = PipelineConfig.model_validate(
            {
                "mlflow": {"tracking_uri": uri, "artifact_location": artifacts},
                "registry": {"model_name": MODEL, **registry},
            }
        )
        run_id = start_pipeline_run(config, "run", {}, manifest.fingerprint, manifest, {"nproc_per_node": 1}, dataset)
        now = int(time.time() * 1000)  # logged as the evaluate task logs them: `ddpflow register` reads them back
        MlflowClient(uri).log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
        MlflowClient(uri).set_tag(run_id, MODEL_PATH_TAG, str(weak))
        MlflowClient(uri).set_tag(run_id, DATASET_DIR_TAG, str(dataset))
        return run_id, register_candidate(config, run_id, str(weak), str(dataset), metrics, uri)

    strict_run, strict = register(require_reference=True)
    assert strict.decision == "rejected" and "trails the reference model" in strict.reason
    assert "registry.require_reference is true" in strict.reason
    again = register_run(strict_run, tracking_uri=uri)  # the run's own config and its logged baselines
    assert again.decision == "rejected" and again.reason == strict.reason
    run_id, warned = register()
    assert warned.decision == "promoted" and "trails the reference model" in warned.warning
    assert MlflowClient(uri).get_run(run_id).data.tags["registry.warning"] == warned.warning
    _, wide = register(reference_margin=0.5)  # a margin wider than the gap: no warning
    assert wide.warning is None
