"""A user model factory with dropout for tests/training/test_train_ddp.py.

Named as a user would name theirs: ``train.model=tests.dropout_model:dropout_mlp``.

Its dropout masks come from each rank's own RNG stream, so training it to the
same weights after a restart needs every rank's RNG state restored exactly.
"""

from __future__ import annotations

from torch import nn


def dropout_mlp(n_features: int, n_outputs: int, hidden: int = 32, p: float = 0.3) -> nn.Module:
    return nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, n_outputs))
