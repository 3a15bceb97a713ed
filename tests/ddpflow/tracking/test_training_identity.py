"""Which train fields are a training's identity (resume and skip), as each field declares it in
training/core/config.py."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field

from ddpflow.tracking.runs import training_identity_tag
from training.checkpoint.files import resume_mismatches
from training.checkpoint.identity import training_identity
from training.core.config import ChangesWeights, KeepsWeights, PipelineConfig, TrainConfig


def config(**train) -> PipelineConfig:
    return PipelineConfig.model_validate({"train": train})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.01), ("epochs", 7), ("seed", 3), ("model_kwargs", {"hidden": [8]}), ("nproc_per_node", 2),
        # Added later (ChangesWeightsWhenSet): part of the identity once set away from the default.
        ("objective", "binary"), ("objective_kwargs", {"delta": 0.5}), ("class_weights", "balanced"),
        ("label_smoothing", 0.1),
    ],
)  # fmt: skip
def test_a_setting_that_changes_the_weights_changes_the_identity(field, value):
    assert training_identity(config(**{field: value}), "fp") != training_identity(config(), "fp")
    assert training_identity_tag(config(**{field: value}), "fp") != training_identity_tag(config(), "fp")
    saved = {"config": config(**{field: value}).model_dump(mode="json"), "fingerprint": "fp"}  # a checkpoint's
    assert [problem.split(" ")[0] for problem in resume_mismatches(saved, config(), "fp")] == [f"train.{field}"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("progress_interval_s", 1.0), ("timeout_s", 60.0), ("max_restarts", 3), ("run_root", "elsewhere")],
)
def test_a_setting_that_keeps_the_weights_leaves_the_identity(field, value):
    assert training_identity(config(**{field: value}), "fp") == training_identity(config(), "fp")
    saved = {"config": config(**{field: value}).model_dump(mode="json"), "fingerprint": "fp"}  # a checkpoint's
    assert resume_mismatches(saved, config(), "fp") == []


def test_the_identity_of_runs_recorded_before_stays_the_same():
    """The tag on existing runs and model versions (skip_if_unchanged compares it): a lost or added
    ChangesWeights declaration changes these hashes, and every champion would stop matching."""
    # They were recorded with train.model mlp (its default then; the pipeline now records what auto picks), and
    # the defaults of then: lr 0.001, 5 epochs, batch 512 per rank, no early stopping and no label smoothing (omitted
    # from the identity as before). A run records its lr as a number (auto resolves before the identity).
    then = {"model": "mlp", "lr": 0.001, "epochs": 5, "batch_size": 512, "early_stopping_patience": None}
    then |= {"label_smoothing": 0.0}
    assert training_identity_tag(config(**then), "fp0") == "aba5fe4681d3c94b"
    changed = config(**{**then, "lr": 0.01}, model_kwargs={"hidden": [8]}, nproc_per_node=2)
    assert training_identity_tag(changed, "fp1") == "c6294b16f1623240"
    # Today's defaults train otherwise (up to 100 epochs, early stopping, the batch for the data): another training.
    assert training_identity_tag(config(model="mlp"), "fp0") != "aba5fe4681d3c94b"


def test_every_train_field_is_declared_one_way_or_the_other():
    weights = TrainConfig.weight_fields()  # raises TypeError for a field declared neither way
    assert {"lr", "epochs", "model"} <= set(weights) and "progress_interval_s" not in weights

    class WithAnUndeclaredField(TrainConfig):
        new_knob: Literal["a", "b"] = Field("a")

    with pytest.raises(TypeError, match=r"\['new_knob'\] declare neither"):
        WithAnUndeclaredField.weight_fields()

    class Declared(TrainConfig):
        new_weight: ChangesWeights[int] = 1
        new_timeout: KeepsWeights[float] = 1.0

    assert Declared.weight_fields() == (*weights, "new_weight")


def test_a_checkpoint_recorded_before_a_field_existed_keeps_its_identity():
    """A weight field added later (ChangesWeightsWhenSet) is left out at its default: a last.pt or a champion
    recorded without it is the same training as today's config at the default."""
    added = TrainConfig.identity_defaults()
    assert {"objective": "auto", "class_weights": "none", "label_smoothing": 0.0}.items() <= added.items()
    # early_stopping_patience's and label_smoothing's defaults became auto: a record without them never stopped
    # early (none) and smoothed no label (0).
    assert added["early_stopping_patience"] is None and added["label_smoothing"] == 0.0
    today = config(early_stopping_patience=None, label_smoothing=0.0)
    old = today.model_dump(mode="json")
    for name in added:
        del old["train"][name]
    saved = {"config": old, "fingerprint": "fp"}
    assert resume_mismatches(saved, today, "fp") == []
    assert training_identity(old, "fp") == training_identity(today, "fp")
    assert training_identity(old, "fp") != training_identity(config(), "fp")  # auto stops early: not that training
    wrong = config(objective="binary", early_stopping_patience=None, label_smoothing=0.0)
    assert [p.split(" ")[0] for p in resume_mismatches(saved, wrong, "fp")] == ["train.objective"]
