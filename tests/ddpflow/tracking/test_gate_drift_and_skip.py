"""The two new rules as pure functions: the gate's drift hold (registry.max_drift_psi) and the skip of a
run that would only repeat the champion (train.skip_if_unchanged). Through the real flow:
tests/flows/test_pipeline_skip_and_drift.py."""

from __future__ import annotations

from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

from ddpflow.drift.psi import FeatureDrift
from ddpflow.tracking.gate import (
    CHALLENGER,
    PROMOTED,
    ChampionReading,
    GateDecision,
    GateRules,
    decide,
)
from ddpflow.tracking.runs import TRAINING_IDENTITY_TAG, training_identity_tag
from ddpflow.tracking.skip import SKIPPED, decide_skip
from training.core.config import PipelineConfig

RULES = GateRules(metric="test_accuracy", greater_is_better=True, min_delta=0.01, max_drift_psi=0.25)
DRIFTED = FeatureDrift("f3", psi=0.41, mean_shift=1.2, reference_mean=0.0, current_mean=1.2)
CALM = FeatureDrift("f3", psi=0.05, mean_shift=0.1, reference_mean=0.0, current_mean=0.1)


def test_a_drifted_feature_holds_a_better_candidate_as_challenger_with_the_reason():
    decision, reason = decide(0.95, ChampionReading.scored("3", 0.7), RULES, DRIFTED)
    assert decision == CHALLENGER
    assert "feature 'f3' drifted from champion v3's training data: PSI 0.41 > registry.max_drift_psi 0.25" in reason
    assert "test_accuracy 0.95 beats champion v3's 0.7" in reason  # what the metric alone would have done


def test_drift_below_the_limit_or_no_limit_leaves_the_metric_to_decide():
    assert decide(0.95, ChampionReading.scored("3", 0.7), RULES, CALM)[0] == PROMOTED
    no_limit = GateRules(metric="test_accuracy", greater_is_better=True, min_delta=0.01)
    assert decide(0.95, ChampionReading.scored("3", 0.7), no_limit, DRIFTED)[0] == PROMOTED
    assert decide(0.95, ChampionReading.scored("3", 0.7), RULES, None)[0] == PROMOTED  # not measured


def test_drift_holds_over_a_champion_that_cannot_score_the_data_but_not_the_first_model_or_an_unreadable_one():
    assert decide(0.9, ChampionReading.incompatible("3", "other features"), RULES, DRIFTED)[0] == CHALLENGER
    assert decide(0.9, ChampionReading.none(), RULES, DRIFTED)[0] == PROMOTED
    opted_in = GateRules(**{**RULES.__dict__, "replace_unreadable_champion": True})
    decision, reason = decide(0.9, ChampionReading.unreadable("3", "gone"), opted_in, DRIFTED)
    assert decision == PROMOTED and "drifted" not in reason  # the unreadable champion's own rule decides


def test_the_drift_reading_is_recorded_on_the_version_and_reads_back():
    decision = GateDecision.judge(RULES, "m", "run1", "4", 0.95, ChampionReading.scored("3", 0.7), DRIFTED)
    tags = decision.version_tags()
    assert tags["gate.drift_feature"] == "f3" and float(tags["gate.drift_psi"]) == 0.41
    again = GateDecision.from_version_tags(tags, "m", "4", "run1")
    assert (again.decision, again.drift_feature, again.drift_psi) == (CHALLENGER, "f3", 0.41)


# ---------------------------------------------------------------- skip_if_unchanged


def config(**train) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {"train": {"skip_if_unchanged": True, **train}, "registry": {"model_name": "m"}}
    )


def champion(tags: dict[str, str], version: str = "7") -> ModelVersion:
    return ModelVersion(
        name="m",
        version=version,
        creation_timestamp=0,
        tags=[ModelVersionTag(key, value) for key, value in tags.items()],
    )


def champion_of(trained: PipelineConfig, fingerprint: str) -> ModelVersion:
    return champion(
        {"data.fingerprint": fingerprint, TRAINING_IDENTITY_TAG: training_identity_tag(trained, fingerprint)}
    )


def test_the_same_data_and_weight_settings_skip_naming_the_version_and_fingerprint():
    check = decide_skip(config(), "abcd1234abcd1234", champion_of(config(), "abcd1234abcd1234"))
    assert check.skip and check.champion_version == "7"
    assert "champion v7 was trained on the same data (fingerprint abcd1234abcd1234)" in check.reason
    assert check.run_tags() | {"registry.reason": ""} == {
        "ddpflow.skipped": "true",
        "registry.decision": SKIPPED,
        "registry.reason": "",
        "registry.model_name": "m",
        "registry.version": "7",
        "registry.champion_version": "7",
    }


def test_settings_that_do_not_change_the_weights_still_skip():
    trained = config(timeout_s=60, max_restarts=0, run_root="elsewhere", init_from="champion", progress_interval_s=9)
    assert decide_skip(config(), "f" * 16, champion_of(trained, "f" * 16)).skip


def test_new_data_a_weight_setting_no_champion_or_an_old_champion_train():
    fingerprint = "f" * 16
    other_data = decide_skip(config(), "e" * 16, champion_of(config(), fingerprint))
    assert (
        not other_data.skip and f"champion v7 was trained on {fingerprint}, the data is {'e' * 16}" in other_data.reason
    )
    other_lr = decide_skip(config(lr=0.5), fingerprint, champion_of(config(), fingerprint))
    assert not other_lr.skip and "a setting that changes the weights differs from champion v7's" in other_lr.reason
    assert not decide_skip(config(epochs=9), fingerprint, champion_of(config(), fingerprint)).skip
    assert not decide_skip(config(), fingerprint, None).skip
    untagged = decide_skip(config(), fingerprint, champion({"data.fingerprint": fingerprint}))
    assert not untagged.skip and "carries no ddpflow.training_identity tag" in untagged.reason


def test_a_training_script_skips_on_the_same_file_arguments_and_data_and_trains_when_any_changes(tmp_path, monkeypatch):
    """The script's identity is its file's sha256 (training/resolve.py: resolve_script), its arguments and params:
    the same script moved elsewhere still skips; an edited script, other arguments or other data train."""
    from training.resolve import resolve_script

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")

    def script(path: str = "train.py", **train) -> PipelineConfig:
        return resolve_script(config(**{"script": path, "script_args": ["--epochs", "3"], **train}))

    trained = script()
    assert trained.data is None and trained.train.script == str(tmp_path / "train.py")  # no data section
    assert decide_skip(script(), None, champion_of(trained, None)).skip
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "train.py").write_text("print('training')\n")
    assert decide_skip(script("moved/train.py"), None, champion_of(trained, None)).skip
    other_args = decide_skip(script(script_args=["--epochs", "4"]), None, champion_of(trained, None))
    assert not other_args.skip and "a setting that changes the weights differs" in other_args.reason
    assert not decide_skip(script(script_params={"lr": 0.1}), None, champion_of(trained, None)).skip
    (tmp_path / "train.py").write_text("print('training, edited')\n")
    edited = decide_skip(script(), None, champion_of(trained, None))
    assert not edited.skip and "a setting that changes the weights differs" in edited.reason
    with_data = decide_skip(script(), "f" * 16, champion_of(trained, None))
    assert not with_data.skip and "the data changed" in with_data.reason
