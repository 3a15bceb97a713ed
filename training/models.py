"""Model construction. Models are plain single-device ``nn.Module``s.

Nothing here knows about processes or devices: ``training.distributed`` wraps
the model in DDP in one place. A user's own model is named by import path
``package.module:factory`` and built as ``factory(n_features, n_outputs, **kwargs)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the architecture; stored in every checkpoint."""

    model: str
    n_features: int
    n_outputs: int
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelSpec:
        return cls(**raw)


class MLP(nn.Module):
    """Feed-forward net: Linear -> ReLU (-> Dropout) per hidden layer, then a linear head."""

    def __init__(self, n_features: int, n_outputs: int, hidden: Sequence[int] = (256, 256), dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        width = n_features
        for size in hidden:
            layers += [nn.Linear(width, int(size)), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(size)
        layers.append(nn.Linear(width, n_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class ModelImportError(ValueError):
    """``train.model`` names something that cannot be imported or called."""


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    if name == "mlp":
        return MLP
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelImportError(f"train.model: cannot import module {module_name!r} ({error})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelImportError(f"train.model: {module_name!r} has no callable {attr!r}")
    return factory


def build_model(spec: ModelSpec) -> nn.Module:
    model = resolve_factory(spec.model)(spec.n_features, spec.n_outputs, **spec.model_kwargs)
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"train.model: {spec.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
