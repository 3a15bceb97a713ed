"""A two-class label is gated on its ranking (test_roc_auc against the trivial baseline's 0.5), against a real SQLite
MLflow store (tests/conftest.py: mlflow_store) with real model files and their evaluation: a model with real signal
whose accuracy only equals the majority class's share is registered; a model that cannot rank is still rejected, by
a reason that names the metric; a champion registered under test_accuracy is compared on test_roc_auc."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow import MlflowClient

from ddpflow.tracking.registration import register_candidate
from ddpflow.tracking.registry import find_alias
from ddpflow.tracking.runs import start_pipeline_run
from tests.manifest_datasets import train_model_file
from training.core.config import PipelineConfig
from training.core.manifest import Manifest, ShardInfo, SplitInfo, read_manifest, write_manifest
from training.inference.baselines import evaluate_baselines
from training.inference.evaluate import evaluate_split
from training.inference.model_file import inference_checkpoint
from training.models.registry import ModelSpec, build_model

MODEL = "two-class-gate"
FEATURES = ["x0", "x1", "x2"]
# P(late) = sigmoid(-1.5 + 0.6 z0), z0 cut to +-2.4: about a fifth of the rows are positive, and no row is more
# likely positive than not, so the teacher's own probabilities rank the rows (ROC AUC about 0.65) and beat the
# prior's log loss while its accuracy is exactly the majority class's share.
INTERCEPT, SLOPE, CUT = -1.5, 0.6, 2.4


def teacher_logit(z0: np.ndarray) -> np.ndarray:
    return INTERCEPT + SLOPE * z0


def write_two_class_dataset(root: Path, name: str, rows: dict[str, int], seed: int = 0, blind_test: bool = False):
    """A prepared dataset per the manifest contract: raw features (z * 7 + 40), the label drawn from the teacher.
    ``blind_test``: the train labels shuffled, and every test row twice, once per class, so that no model can rank
    the test rows (any scorer's ROC AUC is exactly 0.5) nor beat the prior's log loss on them."""
    rng = np.random.default_rng(seed)
    dataset, splits, train = root / name, {}, None
    for split, count in rows.items():
        z = rng.normal(size=(count, len(FEATURES)))
        z[:, 0] = np.clip(z[:, 0], -CUT, CUT)
        late = (rng.random(count) < 1 / (1 + np.exp(-teacher_logit(z[:, 0])))).astype(np.int64)
        if blind_test and split == "train":
            late = rng.permutation(late)
        if blind_test and split == "test":
            z, late = np.repeat(z, 2, axis=0), np.tile(np.array([0, 1]), count)
        x = (z * 7.0 + 40.0).astype(np.float32)
        (dataset / split).mkdir(parents=True)
        columns = {name: pa.array(x[:, i]) for i, name in enumerate(FEATURES)} | {"late": pa.array(late)}
        pq.write_table(pa.table(columns), dataset / split / "part-00000.parquet")
        shard = ShardInfo(
            f"{split}/part-00000.parquet", len(x), (dataset / split / "part-00000.parquet").stat().st_size
        )
        splits[split] = SplitInfo(len(x), [shard])
        train = (x, late) if split == "train" else train
    x, late = train
    schema = [*({"name": name, "type": "float"} for name in FEATURES), {"name": "late", "type": "int64"}]
    manifest = Manifest(
        fingerprint=name, source="tests", task="classification", label="late", key=None, features=FEATURES,
        label_mapping=[0, 1], feature_mean=x.mean(axis=0).tolist(), feature_std=x.std(axis=0).tolist(),
        splits=splits, schema=schema,
        config={}, created_at=dt.datetime.now(dt.timezone.utc).isoformat(), versions={},
        train_class_counts=np.bincount(late, minlength=2).tolist(),
    )  # fmt: skip
    write_manifest(dataset, manifest)
    return dataset


def teacher_model_file(dataset: Path, path: Path) -> Path:
    """model.pt of a linear model whose outputs are the teacher's logits (on the normalised features it is fed)."""
    manifest = read_manifest(dataset)
    spec = ModelSpec(model="mlp", n_features=3, n_outputs=2, model_kwargs={"hidden": []})
    model = build_model(spec)
    mean, std = manifest.feature_mean[0], manifest.feature_std[0]
    with torch.no_grad():  # z0 = (x0 - 40) / 7 and the normalised x0 = (x0 - mean) / std
        model.net[0].weight.zero_()
        model.net[0].bias.zero_()
        model.net[0].weight[1, 0] = SLOPE * std / 7.0
        model.net[0].bias[1] = INTERCEPT + SLOPE * (mean - 40.0) / 7.0
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(inference_checkpoint(model.state_dict(), spec, manifest, epochs=1, metrics={}), path)
    return path


def make_config(mlflow_store, **registry) -> PipelineConfig:
    uri, artifacts = mlflow_store
    return PipelineConfig.model_validate(
        {"mlflow": {"tracking_uri": uri, "artifact_location": artifacts}, "registry": {"model_name": MODEL, **registry}}
    )


def gate(config: PipelineConfig, dataset: Path, model_path: Path):
    """The pipeline's evaluate and register steps, minus Prefect: (the metrics, the decision)."""
    manifest = read_manifest(dataset)
    run_id = start_pipeline_run(config, "run", {}, manifest.fingerprint, manifest, {"nproc_per_node": 1}, dataset)
    metrics = evaluate_split(model_path, dataset).metrics
    metrics |= evaluate_baselines(model_path, dataset, "test", reference=False).metrics()
    uri = config.mlflow.tracking_uri
    return metrics, register_candidate(config, run_id, str(model_path), str(dataset), metrics, uri)


def test_a_model_that_ranks_is_registered_though_its_accuracy_is_the_majority_share(mlflow_store, tmp_path):
    dataset = write_two_class_dataset(tmp_path, "late", {"train": 4000, "val": 200, "test": 4000})
    shy = teacher_model_file(dataset, tmp_path / "shy" / "model.pt")
    client = MlflowClient(mlflow_store[0])

    # Gated on accuracy (the earlier default, now chosen by hand): rejected, but never called a guess.
    metrics, on_accuracy = gate(make_config(mlflow_store, metric="test_accuracy"), dataset, shy)
    assert metrics["test_accuracy"] == metrics["baseline_trivial/test_accuracy"] == metrics["test_majority_share"]
    assert metrics["test_roc_auc"] > 0.6 and metrics["baseline_trivial/test_roc_auc"] == 0.5
    assert metrics["test_log_loss"] < metrics["baseline_trivial/test_log_loss"] - 0.01, metrics
    assert on_accuracy.decision == "rejected" and on_accuracy.metric == "test_accuracy"
    assert "no better than guessing" not in on_accuracy.reason
    assert "its accuracy equals the majority class's share" in on_accuracy.reason, on_accuracy.reason
    assert on_accuracy.reason.endswith("set registry.metric: test_roc_auc to gate on ranking")
    assert client.search_model_versions(f"name = '{MODEL}'") == []

    # The default for two classes: the ranking decides, and the model is registered.
    _, default = gate(make_config(mlflow_store), dataset, shy)
    assert default.metric == "test_roc_auc" and default.candidate_value == metrics["test_roc_auc"]
    assert default.decision == "promoted" and default.version == "1", default.reason
    assert "test_roc_auc" in default.reason
    assert str(find_alias(client, MODEL).version) == "1"


def test_a_model_that_cannot_rank_is_rejected_naming_the_metric(mlflow_store, tmp_path):
    dataset = write_two_class_dataset(tmp_path, "blind", {"train": 1500, "val": 200, "test": 500}, blind_test=True)
    shuffled = train_model_file(dataset, tmp_path / "shuffled" / "model.pt", steps=40)  # learnt the shuffled labels
    metrics, decision = gate(make_config(mlflow_store), dataset, shuffled)
    assert metrics["test_roc_auc"] == 0.5 and metrics["test_log_loss"] >= metrics["baseline_trivial/test_log_loss"]
    assert decision.decision == "rejected" and decision.metric == "test_roc_auc" and decision.version is None
    assert decision.reason.startswith("test_roc_auc=0.5 does not beat the trivial baseline's 0.5"), decision.reason
    assert decision.reason.endswith("no better than guessing")
    tags = MlflowClient(mlflow_store[0]).get_run(decision.run_id).data.tags
    assert tags["registry.decision"] == "rejected" and tags["registry.metric"] == "test_roc_auc"


def test_a_champion_gated_on_accuracy_is_compared_on_roc_auc(mlflow_store, dataset_factory, model_factory):
    dataset = dataset_factory(n_classes=2, rows={"train": 1500, "val": 200, "test": 600})
    old, new = model_factory(dataset, "old", steps=3), model_factory(dataset, "new", steps=80)
    _, first = gate(make_config(mlflow_store, metric="test_accuracy"), dataset, old)
    assert first.decision == "promoted" and first.metric == "test_accuracy"

    metrics, second = gate(make_config(mlflow_store), dataset, new)
    assert second.metric == "test_roc_auc" and second.champion_status == "scored"
    # The champion re-scored on the same test rows, on the new metric (its own evaluation has it).
    assert second.champion_value == evaluate_split(old, dataset).metrics["test_roc_auc"]
    assert second.candidate_value == metrics["test_roc_auc"] > second.champion_value
    assert second.decision == "promoted", second.reason
    assert second.reason == (
        f"test_roc_auc {second.candidate_value:.6g} beats champion v1's {second.champion_value:.6g} by more than 0"
    )
    tags = MlflowClient(mlflow_store[0]).get_model_version(MODEL, second.version).tags
    assert tags["gate.metric"] == "test_roc_auc" and float(tags["gate.champion_value"]) == pytest.approx(
        second.champion_value
    )


def test_a_ranking_within_chance_of_guessing_is_rejected_unless_the_log_loss_shows_what_it_learnt():
    """What a model trained on shuffled labels scores: a ROC AUC a little above 0.5 by chance, a log loss no better
    than the prior's. Rejected as guessing, naming the metric and the chance it is within; the same ROC AUC with a
    log loss that beats the prior, or a ranking beyond chance, is registered."""
    from ddpflow.tracking.gate import GateRules, rejection_reason

    rules = GateRules("test_roc_auc", True, signal_metric="test_log_loss", alternatives=("test_log_loss",))
    shuffled = {
        "test_roc_auc": 0.52,
        "test_log_loss": 0.6961,
        "test_samples": 1000.0,
        "test_majority_share": 0.5,
        "baseline_trivial/test_roc_auc": 0.5,
        "baseline_trivial/test_log_loss": 0.6931,
    }
    reason = rejection_reason(shuffled, rules)
    assert reason.startswith("test_roc_auc=0.52 is within chance of guessing's 0.5 on these test rows")
    assert "up to 0.53 one time in 20 with 500 and 500 rows" in reason and reason.endswith("no better than guessing")
    assert rejection_reason({**shuffled, "test_log_loss": 0.69}, rules) is None  # the probabilities show signal
    assert rejection_reason({**shuffled, "test_roc_auc": 0.56}, rules) is None  # beyond chance on 1000 rows
    few = {**shuffled, "test_roc_auc": 0.56, "test_samples": 100.0}
    assert "within chance" in rejection_reason(few, rules)  # on 100 rows it is not
