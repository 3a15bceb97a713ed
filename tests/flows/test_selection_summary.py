"""The run summary's selection line (flows/cli.py prints it; flows/pipeline.py builds it from the train
stage's last metrics line) and its baselines line (training/inference/baselines.py: comparison)."""

from __future__ import annotations

from flows.cli import _for_people
from training.core.config import load_config
from training.loop.selection import selection_summary


def test_the_summary_names_the_selected_epoch_of_those_trained():
    train = load_config(None, ["train.epochs=60", "train.early_stopping_patience=10"]).train
    last_line = {"epoch": 13, "val_loss": 0.3, "selected_epoch": 3, "selected_val_loss": 0.23149}
    summary = selection_summary(last_line, train)
    assert summary == {
        "select": "best", "monitor": "val_loss", "selected_epoch": 3, "value": 0.23149, "epochs_trained": 14,
        "epochs": 60,
    }  # fmt: skip
    shown = _for_people({"selection": summary})["selection"]
    assert shown == "epoch 4 of 14 (best val_loss 0.2315); stopped early, 60 planned"


def test_a_run_that_trained_every_epoch_says_so_and_an_old_result_has_no_selection():
    train = load_config(None, ["train.epochs=3", "train.select=last", "train.monitor=val_accuracy"]).train
    summary = selection_summary({"epoch": 2, "selected_epoch": 2, "selected_val_accuracy": 0.9}, train)
    assert _for_people({"selection": summary})["selection"] == "epoch 3 of 3 (last val_accuracy 0.9)"
    assert selection_summary({"epoch": 2, "val_loss": 1.0}, train) is None
    assert "selection" not in _for_people({"test_metrics": {}})


def test_the_summary_shows_the_majority_share_beside_accuracy_and_counts_as_integers():
    metrics = {
        "test_loss": 0.41234,
        "test_accuracy": 0.8712345,
        "test_roc_auc": 0.912,
        "test_precision_yes": 0.5,
        "test_majority_share": 0.6,
        "test_samples": 32530.0,
    }
    shown = _for_people({"test_metrics": metrics})["test_metrics"]
    assert shown == (
        "test_loss=0.4123, test_accuracy=0.8712 (majority class 0.6), test_roc_auc=0.912, test_samples=32530"
    )
    tokens = _for_people({"test_metrics": {"test_token_accuracy": 0.5, "test_tokens": 1.5e6}})["test_metrics"]
    assert tokens == "test_token_accuracy=0.5, test_tokens=1500000"


def test_the_summary_shows_the_model_beside_the_reference_and_guessing():
    from training.inference.baselines import comparison

    metrics = {
        "test_accuracy": 0.765,
        "test_roc_auc": 0.67,
        "baseline_trivial/test_accuracy": 0.763,
        "baseline_reference/test_accuracy": 0.804,
        "baseline_trivial/test_roc_auc": 0.5,
        "baseline_reference/test_roc_auc": 0.781,
    }
    line = comparison(metrics, ["test_accuracy", "test_roc_auc"])
    assert line == (
        "test_accuracy 0.765 · reference 0.804 · guessing 0.763; test_roc_auc 0.670 · reference 0.781 · guessing 0.500"
    )
    shown = _for_people({"test_metrics": {"test_accuracy": 0.765}, "baselines": {"comparison": line}})
    assert shown["baselines"] == line
    assert comparison({"test_rmse": 1.0}, ["test_rmse"]) == ""  # no baseline scored: no line
    assert _for_people({"test_metrics": {}, "baselines": {"comparison": ""}})["baselines"] == "none scored"
