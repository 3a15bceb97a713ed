"""Model construction: the model contract. Models are plain single-device ``nn.Module``s.

Nothing here knows about processes or devices: ``training.distributed.context`` wraps
the model in DDP in one place.

The contract (docs/models.md): ``train.model: package.module:factory`` is called as
``factory(inputs: dict[str, InputInfo], n_outputs: int, **model_kwargs)``; the module's
``forward(batch: dict[str, Tensor]) -> [B, n_outputs]`` gets one entry per input (``[B, *shape]`` of the
input's dtype, training/kinds/inputs.py). A factory whose FIRST parameter is not named ``inputs`` is the
older contract, ``factory(n_features, n_outputs, **model_kwargs)`` with ``forward(x: [B, F])``: it keeps
working when every input is numeric (a forward pre-hook stacks the numeric inputs, in manifest order, into
``[B, F]``; the module and its state dict are the factory's own, so its model.pt files still load).

Built in: ``mlp`` (numeric, categorical, hashed and vector inputs; ``tabular.py: MLP``), ``transformer`` (text inputs,
with any tabular ones: training/models/text.py) and ``auto``, which picks the built-in model for the inputs
(``transformer`` when one is text, else ``mlp``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from training.core.imports import import_factory
from training.kinds.inputs import InputInfo, inputs_from_dicts, numeric_input
from training.models.image import image_classifier
from training.models.tabular import mlp, numeric_block
from training.models.text import transformer

BUILT_IN = (
    "mlp",
    "auto",
    "image_cnn",
    "transformer",
)  # image_cnn: training/models/image.py; transformer: training/models/text.py


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the architecture; stored in every checkpoint.

    ``inputs``: every input's ``InputInfo.to_dict()``, in order. None (model.pt files from before typed
    inputs, and callers that only have a feature count): ``n_features`` numeric inputs."""

    model: str
    n_features: int
    n_outputs: int
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] | None = None

    @classmethod
    def for_inputs(
        cls, model: str, inputs: dict[str, InputInfo], n_outputs: int, model_kwargs: dict[str, Any]
    ) -> ModelSpec:
        """The spec of ``train.model`` for these inputs (``auto`` resolved to the built-in it picks)."""
        n_numeric = sum(info.kind == "numeric" for info in inputs.values())
        return cls(
            pick_model(model, inputs), n_numeric, n_outputs, dict(model_kwargs), [i.to_dict() for i in inputs.values()]
        )

    def input_infos(self, features: Sequence[str] | None = None) -> dict[str, InputInfo]:
        if self.inputs is not None:
            return inputs_from_dicts(self.inputs)
        names = list(features) if features is not None else [f"x{j}" for j in range(self.n_features)]
        return {name: numeric_input(name) for name in names}

    def to_dict(self) -> dict[str, Any]:
        raw = {
            "model": self.model,
            "n_features": self.n_features,
            "n_outputs": self.n_outputs,
            "model_kwargs": dict(self.model_kwargs),
        }
        if self.inputs is not None:
            raw["inputs"] = [dict(entry) for entry in self.inputs]
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], features: Sequence[str] | None = None) -> ModelSpec:
        """``features`` names the numeric inputs of a spec from before typed inputs (a model.pt's "features")."""
        spec = cls(**raw)
        if spec.inputs is None and features is not None and len(features) == spec.n_features:
            spec = cls(**{**raw, "inputs": [numeric_input(name).to_dict() for name in features]})
        return spec


def pick_model(model: str, inputs: dict[str, InputInfo]) -> str:
    """``auto``: the built-in model for the inputs (every tabular kind: ``mlp``); any other name as given."""
    if model != "auto":
        return model
    if any(info.kind == "image" for info in inputs.values()):
        return "image_cnn"  # a small residual CNN, with the tabular inputs beside it
    if any(info.kind == "text" for info in inputs.values()):
        return "transformer"  # training/models/text.py
    return "mlp"  # numeric, categorical, hashed, vector: all tabular


class ModelImportError(ValueError):
    """``train.model`` names something that cannot be imported or called."""


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    if name == "image_cnn":
        return image_classifier
    if name == "transformer":
        return transformer
    if name in BUILT_IN:
        return mlp
    return import_factory(name, "train.model", ModelImportError)


def takes_inputs(factory: Callable[..., nn.Module]) -> bool:
    """The contract a factory follows: its first parameter named ``inputs`` (else the older n_features one)."""
    try:
        parameters = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: assume the current contract
        return True
    return bool(parameters) and parameters[0] == "inputs"


def build_model(spec: ModelSpec, features: Sequence[str] | None = None) -> nn.Module:
    factory = resolve_factory(spec.model)
    inputs = spec.input_infos(features)
    if takes_inputs(factory):
        model = factory(inputs, spec.n_outputs, **spec.model_kwargs)
    else:
        model = _legacy_model(factory, spec, inputs)
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"train.model: {spec.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _legacy_model(factory: Callable[..., nn.Module], spec: ModelSpec, inputs: dict[str, InputInfo]) -> nn.Module:
    others = [f"{name} ({info.kind})" for name, info in inputs.items() if info.kind != "numeric"]
    if others:
        raise ModelImportError(
            f"train.model: {spec.model!r} takes (n_features, n_outputs), numeric inputs only; the inputs "
            f"{others} need a factory(inputs, n_outputs, **model_kwargs) (docs/models.md)"
        )
    model = factory(spec.n_features, spec.n_outputs, **spec.model_kwargs)
    if isinstance(model, nn.Module):
        names = list(inputs)
        model.register_forward_pre_hook(lambda module, args: _stacked(args, names))
    return model


def _stacked(args: tuple, names: list[str]) -> tuple | None:
    """The batch dict as the [B, F] matrix an older factory's forward takes; a tensor passes as it is."""
    if args and isinstance(args[0], dict):
        return (numeric_block(args[0], names), *args[1:])
    return None
