"""Small stand-in models for in-process tests of the step and the tallies (the model contract: forward takes the
batch dict)."""

from __future__ import annotations

import torch


class NumericLinear(torch.nn.Module):
    """A linear layer over the batch dict's numeric columns x0, x1, ... (SplitTensors' default names)."""

    def __init__(self, n_features: int, n_outputs: int):
        super().__init__()
        self.names = [f"x{j}" for j in range(n_features)]
        self.linear = torch.nn.Linear(n_features, n_outputs)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(torch.stack([inputs[name] for name in self.names], dim=1))


class Constant(torch.nn.Module):
    """A deliberately useless model: the same outputs for every row (zeros: every class equally likely, so
    class 0 is predicted for every row; a regression model's standardised 0, the train mean)."""

    def __init__(self, n_outputs: int):
        super().__init__()
        self.outputs = torch.nn.Parameter(torch.zeros(n_outputs))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = len(next(iter(inputs.values())))
        return self.outputs.expand(rows, -1)


def constant_model(inputs, n_outputs: int) -> torch.nn.Module:
    """``train.model=tests.stand_in_models:constant_model``: a factory of the current contract."""
    return Constant(n_outputs)
