"""An ensemble's outputs through the objective contract (training/objectives/base.py: ``member_loss``,
``combine_members``): each member trains on its own loss (TabM), and the one prediction is the mean of the
members' probabilities (classes) or values (regression), never the members' averaged logits. No ranks: the
exact update of an ensemble across world sizes is tests/training/test_train_ddp.py's ``ensemble`` runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.kinds.inputs import numeric_input
from training.loading.batches import SplitTensors, TrainBatches
from training.loop.step import StepSettings, TrainStep
from training.models.tabular import MLP
from training.objectives.base import output_members
from training.objectives.registry import make_objective

K = 4
OBJECTIVES = {  # name: (task, n_classes, labels of 6 rows, outputs per member)
    "softmax": ("classification", 3, torch.tensor([0, 1, 2, 1, 0, 2]), 3),
    "binary": ("classification", 2, torch.tensor([0, 1, 1, 0, 1, 0]), 1),
    "multilabel": ("multilabel", 2, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]] * 2), 2),
    "mse": ("regression", None, torch.linspace(-1.0, 2.0, 6), 1),
    "huber": ("regression", None, torch.linspace(-3.0, 3.0, 6), 1),
}


def objective_of(name: str):
    task, n_classes, labels, width = OBJECTIVES[name]
    return make_objective(name, task, n_classes, None, 0.0, task == "multilabel"), labels, width


def member_zero_gradient(objective, members: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    members = members.clone().requires_grad_(True)
    objective.member_loss(members, labels).sum().backward()
    return members.grad[:, 0]


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_member_learns_from_its_own_loss_whatever_the_others_output(name):
    objective, labels, width = objective_of(name)
    generator = torch.Generator().manual_seed(1)
    members = 2 * torch.randn(len(labels), K, width, generator=generator)
    others_moved = members.clone()
    others_moved[:, 1:] = 3 * torch.randn(len(labels), K - 1, width, generator=generator)
    loss = objective.member_loss(members, labels)
    expected = torch.stack([objective.per_row_loss(members[:, j], labels) for j in range(K)], dim=1).mean(dim=1)
    torch.testing.assert_close(loss, expected)  # the mean of the members' own per-row losses
    own = members[:, :1].clone().requires_grad_(True)
    (objective.per_row_loss(own[:, 0], labels).sum() / K).backward()
    torch.testing.assert_close(member_zero_gradient(objective, members, labels), own.grad[:, 0])
    torch.testing.assert_close(
        member_zero_gradient(objective, members, labels), member_zero_gradient(objective, others_moved, labels)
    )
    # The one loss of the averaged outputs (members trained as one model) fails that: member 0's gradient moves.
    averaged = members.clone().requires_grad_(True)
    objective.per_row_loss(averaged.mean(dim=1), labels).sum().backward()
    moved = others_moved.clone().requires_grad_(True)
    objective.per_row_loss(moved.mean(dim=1), labels).sum().backward()
    assert not torch.allclose(averaged.grad[:, 0], moved.grad[:, 0])


@pytest.mark.parametrize("name", OBJECTIVES)
def test_the_prediction_is_the_mean_of_the_members_probabilities_or_values(name):
    objective, labels, width = objective_of(name)
    members = 20 * torch.randn(len(labels), K, width, generator=torch.Generator().manual_seed(2))  # saturated too
    combined = objective.combine_members(members)
    assert combined.shape == (len(labels), width) and torch.isfinite(combined).all()
    predicted, probabilities = objective.decode(combined)
    if name == "softmax":
        torch.testing.assert_close(probabilities, members.softmax(dim=-1).mean(dim=1))
        assert predicted.tolist() == members.softmax(dim=-1).mean(dim=1).argmax(dim=1).tolist()
    elif name == "binary":
        torch.testing.assert_close(probabilities[:, 1], members.sigmoid().mean(dim=1)[:, 0])
    elif name == "multilabel":
        torch.testing.assert_close(probabilities, members.sigmoid().mean(dim=1))
    else:
        torch.testing.assert_close(predicted, members.mean(dim=1)[:, 0])
    one = members[:, 0]
    assert objective.prediction(one, members=1) is one  # a model of one member: its outputs as they are


class RecordingSGD(torch.optim.SGD):
    """lr 0: records the step's gradients and leaves the weights alone."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]


def test_a_train_step_gives_each_head_the_gradient_of_its_own_members_loss():
    """One step of ``TrainStep`` on ``MLP(ensemble=4)``: each member's head gets the gradient of its own cross
    entropy (over k, the mean over the members), not that of the members' averaged logits."""
    generator = torch.Generator().manual_seed(3)
    split = SplitTensors(torch.randn(8, 3, generator=generator), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    objective = make_objective("softmax", "classification", 3)
    torch.manual_seed(0)
    model = MLP({f"x{j}": numeric_input(f"x{j}") for j in range(3)}, 3, hidden=[8], ensemble=K)
    assert output_members(model) == K
    optimizer = RecordingSGD(model.parameters())
    batches = TrainBatches(split, 0, 1, 8, seed=5, device=torch.device("cpu"), pin_memory=False)
    step = TrainStep(
        model, optimizer, None, batches, StepSettings("classification", torch.device("cpu"), objective=objective)
    )
    for index, rows in enumerate(batches.epoch(0)):
        step(index, rows)
    head = dict(zip([name for name, _ in model.named_parameters()], optimizer.grads))["net.2.weight"]
    hidden = model.net[:-1](model.adapter(split.features)).detach()
    for member in range(K):
        weight = model.net[-1].weight[member].detach().clone().requires_grad_(True)
        logits = hidden[:, member] @ weight + model.net[-1].bias[member].detach()
        (F.cross_entropy(logits, split.labels) / K).backward()
        torch.testing.assert_close(head[member], weight.grad, atol=1e-6, rtol=0)
