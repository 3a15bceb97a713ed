"""val_loss with data.weight: the weighted mean Σ w·ℓ / Σ w over the val split; the other val metrics count rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.loading.batches import SplitTensors
from training.loop.step import StepSettings, validate, validation_metrics
from training.objectives.registry import make_objective


class FirstFeature(nn.Module):
    """Logits [x0, -x0]: a fixed model, so each row's loss is known."""

    def forward(self, batch):
        x = batch["x0"]
        return torch.stack([x, -x], dim=1)


def test_val_loss_is_weighted_by_data_weight_and_accuracy_is_not():
    features = torch.tensor([[2.0], [-1.0], [0.5], [3.0]])
    labels = torch.tensor([0, 0, 1, 1])
    weights = torch.tensor([0.5, 3.0, 1.0, 2.0])
    split = SplitTensors(features=features, labels=labels, weights=weights)
    objective = make_objective("softmax", "classification", 2)
    settings = StepSettings(task="classification", device=torch.device("cpu"), objective=objective)
    sums = validate(FirstFeature(), split, 0, 4, batch_size=3, settings=settings).sums
    metrics = validation_metrics(sums.tolist(), settings)
    losses = objective.per_row_loss(FirstFeature()({"x0": features[:, 0]}), labels)
    torch.testing.assert_close(metrics["val_loss"], float((weights * losses).sum() / weights.sum()))
    assert abs(metrics["val_loss"] - float(losses.mean())) > 0.1  # the unweighted mean is another number
    assert metrics["val_accuracy"] == 0.25  # rows 0 right; 1, 2, 3 wrong: counted by rows, not weights


class RowsSeen(nn.Module):
    """A fixed linear model over three features that records how many rows each forward pass held."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.batches: list[int] = []

    def forward(self, batch):
        x = torch.stack([batch[f"x{j}"] for j in range(3)], dim=1)
        self.batches.append(len(x))
        return self.linear(x)


def test_val_batch_size_bounds_each_validation_batch_and_leaves_the_metrics_as_they_are(monkeypatch):
    from training.core.config import load_config

    # The setting's one rule: val_batch_size, else the per-rank train batch (train.batch_size, or the global / W).
    train = load_config(None, ["train.batch_size=16"]).train
    assert train.rank_val_batch_size(2) == 16
    assert load_config(None, ["train.batch_size=16", "train.val_batch_size=7"]).train.rank_val_batch_size(2) == 7
    global_batch = load_config(None, ["train.batch_size=null", "train.global_batch_size=12"]).train
    assert global_batch.rank_val_batch_size(3) == 4

    generator = torch.Generator().manual_seed(0)
    split = SplitTensors(torch.randn(50, 3, generator=generator), torch.randint(0, 3, (50,), generator=generator))
    built = []  # the rows of each batch validation builds (SplitTensors.rows)
    rows = SplitTensors.rows
    monkeypatch.setattr(
        SplitTensors, "rows", lambda self, start, stop: built.append(stop - start) or rows(self, start, stop)
    )
    settings = StepSettings(
        task="classification", device=torch.device("cpu"), objective=make_objective("softmax", "classification", 3)
    )
    torch.manual_seed(1)
    model = RowsSeen()
    metrics = {}
    for batch_size in (7, 16):
        built.clear()
        model.batches.clear()
        sums = validate(model, split, 3, 50, batch_size=batch_size, settings=settings).sums
        metrics[batch_size] = validation_metrics(sums.tolist(), settings)
        # 47 rows in full batches and one short one: never more rows at once than the setting.
        full, last = divmod(47, batch_size)
        assert built == model.batches == [batch_size] * full + [last]
    assert metrics[7].keys() == metrics[16].keys() and metrics[7]["val_samples"] == 47
    for name, value in metrics[7].items():
        assert value == pytest.approx(metrics[16][name], rel=1e-6, abs=1e-9), name
