"""The champion gate cannot be bypassed: an unreadable champion, the record before the aliases, retries.

The pure rules are checked as values; everything else runs against a real SQLite
MLflow store (tests/conftest.py: mlflow_store) with real model files. Faults
are injected through the gate's own hooks (ddpflow/tracking/registration.py:
GateHooks) or by damaging the champion's files on disk, never by mocking MLflow.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ddpflow.tracking.gate import (
    ChampionReading,
    ChampionUnreadableError,
    GateDecision,
    GateRules,
    decide,
    metric_higher_is_better,
    recorded_complete,
    reference_warning,
    rejection_reason,
)
from ddpflow.tracking.registration import GateHooks, register_candidate, register_run
from ddpflow.tracking.registry import MODEL_PT_IN_MODEL, ChampionDownloadError, champion_checkpoint, find_alias
from ddpflow.tracking.runs import log_evaluation, start_pipeline_run
from training.core.config import PipelineConfig, load_config
from training.core.fileio import atomic_write_json
from training.core.manifest import read_manifest
from training.inference.evaluate import evaluate_split

MODEL = "gate-guarantees"
RULES = GateRules(metric="test_accuracy", greater_is_better=True, min_delta=0.01)


# ----------------------------------------------------------------------------- the rules, as values


def test_decide_for_every_kind_of_champion():
    assert decide(0.8, ChampionReading.none(), RULES)[0] == "promoted"
    assert decide(0.8, ChampionReading.scored("3", 0.7), RULES)[0] == "promoted"
    assert decide(0.8, ChampionReading.scored("3", 0.795), RULES)[0] == "challenger"  # not by more than 0.01
    assert decide(0.8, ChampionReading.scored("3", math.nan), RULES)[0] == "promoted"
    decision, reason = decide(0.1, ChampionReading.incompatible("3", "needs feature columns ['f0']"), RULES)
    assert decision == "promoted" and "['f0']" in reason and "v3" in reason
    decision, reason = decide(0.99, ChampionReading.unreadable("3", "model.pt is gone"), RULES)
    assert decision == "challenger" and "unreadable" in reason and "model.pt is gone" in reason
    opted_in = GateRules("test_accuracy", True, replace_unreadable_champion=True)
    decision, reason = decide(0.1, ChampionReading.unreadable("3", "model.pt is gone"), opted_in)
    assert decision == "promoted" and "was unreadable" in reason and "replace_unreadable_champion" in reason


def test_a_candidate_must_beat_guessing_and_may_be_held_to_the_reference(repo_root):
    rules = GateRules("test_accuracy", True)
    guessing = {"baseline_trivial/test_accuracy": 0.763, "baseline_reference/test_accuracy": 0.804}
    tie = rejection_reason({"test_accuracy": 0.763, **guessing}, rules)
    assert "does not beat the trivial baseline's 0.763" in tie and "no better than guessing" in tie  # strictly
    assert rejection_reason({"test_accuracy": 0.7631, **guessing}, rules) is None
    lift = GateRules("test_accuracy", True, min_lift=0.01)
    assert "registry.min_lift=0.01" in rejection_reason({"test_accuracy": 0.77, **guessing}, lift)
    losses = GateRules("test_log_loss", False)  # lower is better: the prior's log loss must be beaten downwards
    assert rejection_reason({"test_log_loss": 0.55, "baseline_trivial/test_log_loss": 0.55}, losses)
    assert rejection_reason({"test_log_loss": 0.54, "baseline_trivial/test_log_loss": 0.55}, losses) is None
    # A baseline's NaN (a ROC AUC with one class) is not the candidate's: only its own metrics must be finite.
    assert rejection_reason({"test_accuracy": 0.9, "baseline_trivial/test_roc_auc": math.nan}, rules) is None
    # Trailing the reference: a warning by default, a rejection with registry.require_reference.
    trailing = {"test_accuracy": 0.78, **guessing}
    assert rejection_reason(trailing, rules) is None
    assert "trails the reference model" in reference_warning(trailing, rules)
    # ...and says where to look: the section it names exists in the docs.
    assert "When the mlp trails the reference" in reference_warning(trailing, rules)
    assert "## When the mlp trails the reference" in (repo_root / "docs" / "models.md").read_text()
    assert reference_warning({"test_accuracy": 0.785, **guessing}, rules) is None  # within the 0.02 margin
    strict = GateRules("test_accuracy", True, require_reference=True)
    assert "registry.require_reference is true" in rejection_reason(trailing, strict)
    assert rejection_reason({"test_accuracy": 0.79, **guessing}, strict) is None


# A two-class model with real signal whose accuracy equals the majority class's share: it ranks (ROC AUC 0.667
# against the prior's 0.5) and its log loss is below the prior's.
SHY = {
    "test_accuracy": 0.763, "baseline_trivial/test_accuracy": 0.763,
    "test_roc_auc": 0.667, "baseline_trivial/test_roc_auc": 0.5,
    "test_log_loss": 0.51, "baseline_trivial/test_log_loss": 0.55,
}  # fmt: skip
ON_ACCURACY = GateRules(
    "test_accuracy", True, signal_metric="test_log_loss", alternatives=("test_roc_auc", "test_log_loss")
)


def test_a_model_with_signal_is_never_called_a_guess_and_is_told_what_to_gate_on():
    reason = rejection_reason(SHY, ON_ACCURACY)
    assert "no better than guessing" not in reason and reason.startswith("test_accuracy=0.763 does not beat")
    assert "its accuracy equals the majority class's share" in reason and "test_log_loss=0.51 beats" in reason
    assert reason.endswith("set registry.metric: test_roc_auc to gate on ranking"), reason
    assert rejection_reason(SHY, replace(ON_ACCURACY, metric="test_roc_auc")) is None  # the two-class default
    # Its log loss beats the prior's only by 0.04: with registry.min_lift above it, it is a guess on every count.
    lifted = replace(ON_ACCURACY, min_lift=0.05)
    assert rejection_reason(SHY, lifted).endswith("no better than guessing")
    # No ranking to offer (more classes): the signal metric itself; a model whose accuracy is below the share.
    many = replace(ON_ACCURACY, alternatives=("test_log_loss",))
    below = {**SHY, "test_accuracy": 0.70}
    assert rejection_reason(below, many).endswith(
        "it does not show on test_accuracy; set registry.metric: test_log_loss to gate on the probabilities"
    )
    # A guess on the signal metric too (or no signal metric): no better than guessing, naming the gate metric.
    guess = {**SHY, "test_roc_auc": 0.5, "test_log_loss": 0.56}
    assert rejection_reason(guess, replace(ON_ACCURACY, metric="test_roc_auc")) == (
        "test_roc_auc=0.5 does not beat the trivial baseline's 0.5 (the train split's class prior or mean on the "
        "same test rows) by more than registry.min_lift=0: no better than guessing"
    )
    assert rejection_reason(SHY, GateRules("test_accuracy", True)).endswith("no better than guessing")
    # Regression: the RMSE is both the gate and the signal metric.
    values = {"test_rmse": 2.0, "baseline_trivial/test_rmse": 2.0, "test_r2": 0.0, "baseline_trivial/test_r2": 0.0}
    rmse = GateRules("test_rmse", False, signal_metric="test_rmse", alternatives=("test_rmse",))
    assert rejection_reason(values, rmse).endswith("no better than guessing")
    on_r2 = GateRules("test_r2", True, signal_metric="test_rmse", alternatives=("test_rmse",))
    assert "set registry.metric: test_rmse to gate on the errors" in rejection_reason(
        {**values, "test_rmse": 1.5}, on_r2
    )


@pytest.mark.parametrize(
    ("metric", "higher"),
    [
        ("test_log_loss", False), ("val_log_loss", False), ("test_loss", False), ("test_rmse", False),
        ("test_mae", False), ("test_mse", False), ("val_huber", False),
        ("test_accuracy", True), ("test_top5_accuracy", True), ("test_macro_f1", True), ("test_micro_f1", True),
        ("test_roc_auc", True), ("test_r2", True), ("val_exact_match", True),
        # A class's own metric: its kind decides, not a class label that reads like a cost.
        ("test_precision_error", True), ("test_recall_loss", True),
        ("test_my_error_rate", False), ("test_within_one", True),  # a user objective's: the cost words
    ],
)  # fmt: skip
def test_the_gate_infers_each_metrics_direction_from_its_kind(metric, higher):
    assert metric_higher_is_better(metric) is higher
    registry = load_config(None, [f"registry.metric={metric}"]).registry
    assert registry.higher_is_better("test_accuracy") is higher  # the objective default loses to registry.metric
    given = load_config(None, [f"registry.metric={metric}", f"registry.greater_is_better={not higher}"]).registry
    assert given.higher_is_better("test_accuracy") is (not higher)  # given: it wins


def test_the_decision_reads_back_from_its_version_tags():
    decision = GateDecision.judge(RULES, MODEL, "run-1", "4", 0.8125, ChampionReading.scored("3", 0.75))
    again = GateDecision.from_version_tags(decision.version_tags(), MODEL, "4", "run-1")
    assert again == decision.again() and again.already_registered
    assert decision.to_dict()["model_uri"] == f"models:/{MODEL}/4"
    assert decision.run_tags()["registry.champion_version"] == "3"
    assert decision.run_metrics() == {"gate_candidate_test_accuracy": 0.8125, "gate_champion_test_accuracy": 0.75}


def test_only_an_applied_readable_decision_is_final():
    applied = {"gate.decision": "promoted", "gate.state": "applied", "gate.champion_status": "scored"}
    assert recorded_complete(applied)
    assert recorded_complete({"gate.decision": "challenger"})  # gated before gate.state existed: decision last
    assert not recorded_complete({**applied, "gate.state": "recorded"})  # died before the aliases moved
    assert not recorded_complete({"gate.state": "recorded"})
    held_back = {"gate.decision": "challenger", "gate.state": "applied", "gate.champion_status": "unreadable: gone"}
    assert not recorded_complete(held_back)
    assert recorded_complete({**held_back, "gate.decision": "promoted"})  # replaced with the opt-in: final


# ----------------------------------------------------------------------------- against a real store


@pytest.fixture
def config(mlflow_store, tmp_path) -> PipelineConfig:
    uri, artifacts = mlflow_store
    return PipelineConfig.model_validate(
        {
            "mlflow": {"tracking_uri": uri, "artifact_location": artifacts},
            "data": {"root": str(tmp_path / "shards")},
            "registry": {"model_name": MODEL},
        }
    )


@pytest.fixture
def client(config) -> MlflowClient:
    return MlflowClient(config.mlflow.tracking_uri)


@pytest.fixture
def models(dataset_factory, model_factory):
    """One dataset and three models on it, in a known order of test accuracy."""
    dataset = dataset_factory()
    paths = {
        "weak": model_factory(dataset, "weak", steps=3),
        "medium": model_factory(dataset, "medium", steps=15),
        "strong": model_factory(dataset, "strong", steps=80),
    }
    accuracy = {name: evaluate_split(path, dataset).metrics["test_accuracy"] for name, path in paths.items()}
    assert accuracy["weak"] < accuracy["medium"] < accuracy["strong"], accuracy  # the setup the tests rely on
    return dataset, paths


def evaluated_run(config: PipelineConfig, dataset: Path, model_path: Path, name: str) -> tuple[str, dict]:
    """What the pipeline has before its register step: a run with its evaluation logged. (run id, metrics)."""
    manifest = read_manifest(dataset)
    run_id = start_pipeline_run(config, name, {}, manifest.fingerprint, manifest, {"nproc_per_node": 1}, dataset)
    result = evaluate_split(model_path, dataset)
    metrics_path = atomic_write_json(model_path.parent / "eval" / "metrics.json", result.to_dict())
    log_evaluation(config.mlflow.tracking_uri, run_id, result, metrics_path, model_path, dataset)
    return run_id, result.metrics


def gate(config, dataset, model_path, run_id, metrics, **kwargs) -> GateDecision:
    """The register step of the pipeline, minus Prefect."""
    uri = config.mlflow.tracking_uri
    return register_candidate(config, run_id, str(model_path), str(dataset), metrics, uri, **kwargs)


def register(config, dataset, model_path, name) -> tuple[str, GateDecision]:
    run_id, metrics = evaluated_run(config, dataset, model_path, name)
    return run_id, gate(config, dataset, model_path, run_id, metrics)


def alias(client: MlflowClient, name: str) -> str | None:
    version = find_alias(client, MODEL, name)
    return None if version is None else str(version.version)


def champion_file(client: MlflowClient, version: str) -> Path:
    """The champion's model.pt in the (local) artifact store, as the gate downloads it."""
    root = client.get_model_version_download_uri(MODEL, version)
    return Path(unquote(urlparse(f"{root.rstrip('/')}/{MODEL_PT_IN_MODEL}").path))


def test_a_champion_with_missing_files_stops_the_gate_until_the_user_opts_in(config, client, models):
    dataset, paths = models
    _, first = register(config, dataset, paths["weak"], "weak")
    champion_file(client, first.version).unlink()  # the artifact store lost the champion's weights

    run_id, metrics = evaluated_run(config, dataset, paths["strong"], "strong")
    with pytest.raises(ChampionUnreadableError) as raised:
        gate(config, dataset, paths["strong"], run_id, metrics)
    message = str(raised.value)
    assert f"champion v{first.version} could not be read" in message and "could not be downloaded" in message
    assert f"ddpflow register --run-id {run_id}" in message
    assert "--set registry.replace_unreadable_champion=true" in message and "restore the champion's files" in message
    # Registered, waiting as challenger; the champion did not move; the record is written.
    assert alias(client, "champion") == first.version and alias(client, "challenger") == "2"
    assert alias(client, "previous-champion") is None
    tags = client.get_run(run_id).data.tags
    assert tags["registry.decision"] == "challenger" and tags["registry.champion_status"].startswith("unreadable")
    assert client.get_model_version(MODEL, "2").tags["gate.state"] == "applied"

    # Without the opt-in, trying again stops again (it does not return the recorded challenger as final).
    with pytest.raises(ChampionUnreadableError):
        register_run(run_id, tracking_uri=config.mlflow.tracking_uri)
    replaced = register_run(
        run_id, overrides=["registry.replace_unreadable_champion=true"], tracking_uri=config.mlflow.tracking_uri
    )
    assert replaced.decision == "promoted" and replaced.version == "2" and not replaced.already_registered
    assert "was unreadable" in replaced.reason and replaced.champion_version == first.version
    assert alias(client, "champion") == "2" and alias(client, "previous-champion") == first.version
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 2  # no second version for the run
    assert register_run(run_id, tracking_uri=config.mlflow.tracking_uri).already_registered


def test_a_corrupt_champion_is_unreadable_and_the_gate_scores_it_once_restored(config, client, models, tmp_path):
    dataset, paths = models
    _, first = register(config, dataset, paths["weak"], "weak")
    weights = champion_file(client, first.version)
    kept = shutil.copy(weights, tmp_path / "kept.pt")
    weights.write_bytes(b"not a torch file")

    run_id, metrics = evaluated_run(config, dataset, paths["strong"], "strong")
    with pytest.raises(ChampionUnreadableError, match="does not load"):
        gate(config, dataset, paths["strong"], run_id, metrics)
    assert alias(client, "champion") == first.version and alias(client, "challenger") == "2"

    shutil.copy(kept, weights)  # the files are restored: the gate compares as usual
    decision = register_run(run_id, tracking_uri=config.mlflow.tracking_uri)
    assert decision.decision == "promoted" and decision.champion_status == "scored"
    assert decision.champion_value == pytest.approx(first.candidate_value)
    assert alias(client, "champion") == "2" and alias(client, "previous-champion") == first.version


class Crash(RuntimeError):
    """Stands for the process dying between the record and the alias moves."""


def crash(decision: GateDecision) -> None:
    raise Crash(f"died before moving aliases for v{decision.version}")


@pytest.mark.parametrize(("candidate", "outcome"), [("strong", "promoted"), ("weak", "challenger")])
def test_the_record_is_written_before_any_alias_moves_and_a_retry_finishes(config, client, models, candidate, outcome):
    dataset, paths = models
    _, first = register(config, dataset, paths["medium"], "medium")
    run_id, metrics = evaluated_run(config, dataset, paths[candidate], candidate)

    with pytest.raises(Crash):
        gate(config, dataset, paths[candidate], run_id, metrics, hooks=GateHooks(before_aliases=crash))
    run = client.get_run(run_id)
    assert run.data.tags["registry.decision"] == outcome and run.data.tags["registry.version"] == "2"
    assert run.data.metrics["gate_champion_test_accuracy"] == pytest.approx(first.candidate_value)
    tags = client.get_model_version(MODEL, "2").tags
    assert tags["gate.decision"] == outcome and tags["gate.state"] == "recorded"
    assert alias(client, "champion") == first.version  # nothing moved
    assert alias(client, "challenger") is None and alias(client, "previous-champion") is None

    finished = gate(config, dataset, paths[candidate], run_id, metrics)
    assert finished.decision == outcome and finished.version == "2" and not finished.already_registered
    assert client.get_model_version(MODEL, "2").tags["gate.state"] == "applied"
    if outcome == "promoted":
        assert alias(client, "champion") == "2" and alias(client, "previous-champion") == first.version
    else:
        assert alias(client, "champion") == first.version and alias(client, "challenger") == "2"
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 2
    assert gate(config, dataset, paths[candidate], run_id, metrics).already_registered


def test_only_a_missing_alias_means_no_champion(config, client, models):
    assert find_alias(client, MODEL) is None  # no registered model at all
    dataset, paths = models
    register(config, dataset, paths["weak"], "weak")
    assert find_alias(client, MODEL, "no-such-alias") is None
    with pytest.raises(MlflowException, match="alias"):
        find_alias(client, MODEL, "")  # an error of another kind is raised, never taken as "no champion"


def test_a_warm_start_from_an_unreadable_champion_names_the_version(config, client, models, tmp_path):
    dataset, paths = models
    _, first = register(config, dataset, paths["weak"], "weak")
    champion_file(client, first.version).unlink()
    with pytest.raises(ChampionDownloadError, match=f"champion v{first.version}'s model.pt could not be downloaded"):
        champion_checkpoint(config, tmp_path / "warm")
