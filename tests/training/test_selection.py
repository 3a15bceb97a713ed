"""Which weights a run ends with, under REAL torchrun (2 gloo ranks, tiny data): best-epoch selection, early
stopping and its resume, and a NaN that stops the run at its step.

The data is the suite's small regression table (``make_dataset``: a linear teacher plus noise, target
standardised), with so few train rows and so high a learning rate that the validation loss stops improving
after a few epochs: the case where the last epoch is not the best one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from manifest_datasets import make_dataset

from tests.training.test_train_ddp import Launch, assert_same_weights, launch, succeeded
from training.core.config import DEFAULT_EPOCHS, DEFAULT_PATIENCE
from training.core.layout import STEP_METRICS
from training.inference.evaluate import evaluate_split

pytestmark = pytest.mark.torchrun

EPOCHS, PATIENCE, LOG_EVERY = 12, 2, 3
SETTINGS = {
    "epochs": EPOCHS,
    "batch_size": 8,
    "lr": 0.03,
    "model_kwargs": {"hidden": [64, 64]},
    "early_stopping_patience": PATIENCE,
    "log_every_steps": LOG_EVERY,
}


@pytest.fixture(scope="module")
def regression(tmp_path_factory) -> Path:
    rows = {"train": 48, "val": 160, "test": 16}
    return make_dataset(tmp_path_factory.mktemp("shards"), task="regression", rows=rows, target_stats=True)


@pytest.fixture(scope="module")
def stopped(regression, tmp_path_factory) -> Launch:
    """select: best (the default) with early stopping; every epoch's last.pt kept (DDPFLOW_KEEP_CHECKPOINTS)."""
    run_dir = tmp_path_factory.mktemp("stopped")
    return succeeded(launch(run_dir, regression, env={"DDPFLOW_KEEP_CHECKPOINTS": "1"}, **SETTINGS))


@pytest.fixture(scope="module")
def by_default(regression, tmp_path_factory) -> Launch:
    """The defaults a user leaves alone: the epoch budget, early stopping (patience auto) and the batch
    (auto) on a 48-row train split, which the earlier default batch of 512 per rank refused. The settings of
    ``job_config`` that are not the product's defaults are set back to them; the model and lr stay the suite's."""
    run_dir = tmp_path_factory.mktemp("by_default")
    defaults = {"epochs": DEFAULT_EPOCHS, "batch_size": "auto", "early_stopping_patience": "auto"}
    settings = {**SETTINGS, **defaults, "log_every_steps": None}
    return succeeded(launch(run_dir, regression, env={"DDPFLOW_KEEP_CHECKPOINTS": "1"}, **settings))


def test_by_default_a_tiny_table_trains_and_stops_early_with_the_best_epochs_weights(by_default):
    last_pt = torch.load(by_default.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last_pt["global_batch"] == 2, "48 train rows / (2 ranks x 16 steps): a batch of 1 row per rank"
    records = by_default.metrics()
    best, last = best_epoch(records), records[-1]["epoch"]
    assert last == best + DEFAULT_PATIENCE < DEFAULT_EPOCHS - 1, "early stopping is on without being asked for"
    final = by_default.model()
    kept = torch.load(by_default.run_dir / "checkpoints" / f"epoch{best}.pt", weights_only=True)
    assert_same_weights(final["model"], kept["model"], atol=0)  # the best epoch's weights, restored
    assert final["selected_epoch"] == best and final["selection"]["stopped_early"] is True
    assert final["selection"]["patience"] == DEFAULT_PATIENCE


def best_epoch(records: list[dict]) -> int:
    return min(records, key=lambda record: (record["val_loss"], record["epoch"]))["epoch"]


def test_model_pt_holds_the_best_epochs_weights_exactly(stopped):
    records = stopped.metrics()
    best = best_epoch(records)
    kept = torch.load(stopped.run_dir / "checkpoints" / f"epoch{best}.pt", weights_only=True)
    final = stopped.model()
    assert_same_weights(final["model"], kept["model"], atol=0)
    assert final["selected_epoch"] == best and final["metrics"]["epoch"] == best
    assert final["metrics"]["val_loss"] == records[best]["val_loss"]
    assert final["selection"]["select"] == "best" and final["selection"]["monitor"] == "val_loss"
    # Every epoch line says which epoch would be selected so far, and its validation metrics (the MLflow mirror).
    for record in records:
        so_far = best_epoch(records[: record["epoch"] + 1])
        assert record["selected_epoch"] == so_far
        assert record["selected_val_loss"] == records[so_far]["val_loss"]
        assert record["selected_val_rmse"] == records[so_far]["val_rmse"]


def test_early_stopping_stops_every_rank_at_the_same_epoch_and_ends_normally(stopped):
    records = stopped.metrics()
    best, last = best_epoch(records), records[-1]["epoch"]
    assert last == best + PATIENCE < EPOCHS - 1, "stopped PATIENCE epochs after the best, before the end"
    for rank in (0, 1):
        line = f"rank {rank}: early stopping after epoch {last + 1}/{EPOCHS}: val_loss has not improved for {PATIENCE}"
        assert stopped.output.count(line) == 1, stopped.output[-3000:]  # epochs counted from 1, as progress lines
    final = stopped.model()
    assert final["epochs"] == last + 1 and final["selection"]["stopped_early"] is True
    assert final["selection"]["epochs_without_improvement"] == PATIENCE


def test_select_best_ends_with_a_lower_validation_loss_than_select_last(stopped, regression, tmp_path):
    """The same launch holds both: model.pt (select: best) and last.pt's weights, which are what select: last
    writes into model.pt. Evaluated by the evaluate stage's own code on the val split."""
    final = stopped.model()
    last_weights = torch.load(stopped.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    torch.save({**final, "model": last_weights}, tmp_path / "last_model.pt")
    best = evaluate_split(stopped.run_dir / "model.pt", regression, "val").metrics["val_loss"]
    last = evaluate_split(tmp_path / "last_model.pt", regression, "val").metrics["val_loss"]
    print(f"\n[selection] val_loss: select best {best:.4f}, select last {last:.4f}")
    assert best == pytest.approx(final["metrics"]["val_loss"], rel=1e-5)
    assert best < last


def test_the_curves_within_an_epoch_are_written_every_n_steps(stopped):
    lines = [json.loads(line) for line in (stopped.run_dir / STEP_METRICS).read_text().splitlines()]
    optimizer_steps = 48 // (2 * SETTINGS["batch_size"])  # 3 an epoch
    trained = len(stopped.metrics()) * optimizer_steps
    assert [line["step"] for line in lines] == list(range(LOG_EVERY, trained + 1, LOG_EVERY))
    for line in lines:
        assert line["step/lr"] == SETTINGS["lr"] and 0 < line["step/grad_norm"] < 1e6 and line["step/train_loss"] > 0


def test_a_resume_after_the_stop_keeps_the_best_weights_and_trains_no_further(stopped, regression):
    """last.pt holds the selection so far and the best epoch's weights: a relaunch of the finished (model.pt
    removed) run trains nothing and writes the same model.pt."""
    before = stopped.model()
    (stopped.run_dir / "model.pt").unlink()
    again = succeeded(launch(stopped.run_dir, regression, **SETTINGS))
    epochs = len(stopped.metrics())
    assert f"after {epochs} epoch(s)" in again.output and "early stopping" not in again.output
    assert f"(the weights of epoch {best_epoch(again.metrics()) + 1} of {epochs} trained" in again.output
    assert len(again.metrics()) == epochs
    after = again.model()
    assert_same_weights(after["model"], before["model"], atol=0)
    assert after["selection"] == before["selection"]


def test_a_nan_fails_the_run_at_its_step_naming_it_and_keeps_the_earlier_checkpoint(regression, tmp_path):
    settings = {**SETTINGS, "epochs": 3, "early_stopping_patience": None}
    result = launch(tmp_path / "nan", regression, env={"DDPFLOW_FAULT": "nan:rank=1:epoch=1:step=2"}, **settings)
    assert result.returncode != 0
    assert "non-finite training values at epoch 1 step 2" in result.output, result.output[-3000:]
    assert "the loss was non-finite on rank(s) [1]" in result.output
    assert "train.lr" in result.output and "unnormalised" in result.output
    assert torch.load(tmp_path / "nan" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1
    assert not (tmp_path / "nan" / "model.pt").exists()
    assert [record["epoch"] for record in Launch(tmp_path / "nan", 0, "").metrics()] == [0]
