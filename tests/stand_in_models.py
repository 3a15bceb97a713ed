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
