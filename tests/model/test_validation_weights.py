"""val_loss with data.weight: the weighted mean Σ w·ℓ / Σ w over the val split; the other val metrics count rows."""

from __future__ import annotations

import torch
from torch import nn

from training.loading import SplitTensors
from training.loop import StepSettings, evaluate, validation_metrics
from training.spec.objectives import make_objective


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
    sums = evaluate(FirstFeature(), split, 0, 4, batch_size=3, settings=settings).sums
    metrics = validation_metrics(sums.tolist(), settings)
    losses = objective.per_row_loss(FirstFeature()({"x0": features[:, 0]}), labels)
    torch.testing.assert_close(metrics["val_loss"], float((weights * losses).sum() / weights.sum()))
    assert abs(metrics["val_loss"] - float(losses.mean())) > 0.1  # the unweighted mean is another number
    assert metrics["val_accuracy"] == 0.25  # rows 0 right; 1, 2, 3 wrong: counted by rows, not weights
