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

Built in: ``mlp`` (numeric, categorical, hashed, vector and datetime inputs; ``tabular.py: MLP``), ``image_cnn``
(image inputs, with any tabular ones: training/models/image.py), ``transformer`` (text inputs, with any tabular ones:
training/models/text.py) and ``auto``, the default, which picks the built-in model for the inputs
(``image_cnn`` when one is an image, ``transformer`` when one is text, else ``mlp``). The pipeline resolves
``auto`` once the data is prepared (``with_resolved_model``), so a run's records and its training identity
name the model that trained: the default on a table is the same training as ``train.model: mlp``.
A built-in model named explicitly that cannot take the inputs is a ConfigError naming the one that can.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from training.core.config import MODELS, ConfigError, PipelineConfig
from training.core.imports import import_factory
from training.kinds.base import PIXELS, TOKENS
from training.kinds.inputs import (
    InputInfo,
    block_names,
    inputs_from_dicts,
    inputs_from_manifest,
    numeric_input,
    numeric_names,
)
from training.kinds.registry import block_of, kind_record, known_kinds
from training.models.image import image_classifier
from training.models.tabular import TABULAR_BLOCKS, mlp, numeric_block
from training.models.text import transformer

BUILT_IN = MODELS  # image_cnn: training/models/image.py; transformer: training/models/text.py


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the architecture; stored in every checkpoint.

    ``inputs``: every input's ``InputInfo.to_dict()``, in order. None (a model.pt whose spec has no inputs,
    and callers that only have a feature count): ``n_features`` numeric inputs."""

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
        n_numeric = len(block_names(inputs))  # the numeric block's width: missing indicators included
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
        """``features`` names the numeric inputs of a spec without ``inputs`` (a model.pt's "features")."""
        spec = cls(**raw)
        if spec.inputs is None and features is not None and len(features) == spec.n_features:
            spec = cls(**{**raw, "inputs": [numeric_input(name).to_dict() for name in features]})
        return spec


def pick_model(model: str, inputs: dict[str, InputInfo]) -> str:
    """``auto``: the built-in model for the inputs (every tabular kind: ``mlp``); any other name as given."""
    if model != "auto":
        return model
    kinds = [kind_record(kind) for kind in dict.fromkeys(info.kind for info in inputs.values())]
    picks = sorted((codec.default_model_rank, codec.default_model) for codec in kinds if codec.default_model)
    return picks[0][1] if picks else "mlp"  # image_cnn, transformer: their kinds say so (Codec.default_model)


def with_resolved_model(config: PipelineConfig, manifest) -> PipelineConfig:
    """The config with ``train.model: auto`` replaced by the built-in model it picks for the manifest's inputs
    (any other model: the config itself). The pipeline calls it once the data is prepared, before anything
    records the config or computes its training identity (resume, skip_if_unchanged, the MLflow run)."""
    picked = pick_model(config.train.model, inputs_from_manifest(manifest))
    if picked == config.train.model:
        return config
    return config.model_copy(update={"train": config.train.model_copy(update={"model": picked})})


def check_fits(model: str, inputs: dict[str, InputInfo]) -> None:
    """A built-in model that cannot take these inputs: ConfigError saying which model can (a user factory
    checks its own inputs)."""
    problem = _fit_problem(model, inputs)
    if problem is None:
        return
    picked = pick_model("auto", inputs)
    if _fit_problem(picked, inputs) is None:
        raise ConfigError(f"{problem}; set train.model: auto or {picked}")
    kinds = sorted({info.kind for info in inputs.values()})
    raise ConfigError(
        f"{problem}; no built-in model takes {kinds} together: "
        "train.model: package.module:factory names your own (docs/models.md)"
    )


def _fit_problem(model: str, inputs: dict[str, InputInfo]) -> str | None:
    if model == "auto":
        model = pick_model(model, inputs)
    if model not in BLOCKS_TAKEN:
        return None
    needs = BLOCK_NEEDED.get(model)
    if needs is not None and needs not in {block_of(info) for info in inputs.values()}:
        kind = next(kind for kind in known_kinds() if kind_record(kind).model_block == needs)
        return f"train.model {model} needs at least one {kind} input (data.inputs: {{name: {kind}}})"
    others = [f"{name} ({info.kind})" for name, info in inputs.items() if block_of(info) not in BLOCKS_TAKEN[model]]
    if others:
        return f"train.model {model} takes {_TAKES[model]} inputs, not {others}"
    return None


# The model blocks (training/kinds/base.py: MODEL_BLOCKS) each built-in model takes, and the one it needs.
BLOCKS_TAKEN = {"mlp": TABULAR_BLOCKS, "image_cnn": (*TABULAR_BLOCKS, PIXELS), "transformer": (*TABULAR_BLOCKS, TOKENS)}
BLOCK_NEEDED = {"image_cnn": PIXELS, "transformer": TOKENS}
_TAKES = {
    "mlp": "numeric, categorical, hashed, vector and datetime",
    "image_cnn": "image, numeric, categorical, hashed, vector and datetime",
    "transformer": "text, numeric, categorical, hashed, vector and datetime",
}


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
    check_fits(spec.model, inputs)
    if takes_inputs(factory):
        model = factory(inputs, spec.n_outputs, **spec.model_kwargs)
    else:
        model = _legacy_model(factory, spec, inputs)
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"train.model: {spec.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _legacy_model(factory: Callable[..., nn.Module], spec: ModelSpec, inputs: dict[str, InputInfo]) -> nn.Module:
    others = [f"{name} ({info.kind})" for name, info in inputs.items() if name not in numeric_names(inputs)]
    if others:
        raise ModelImportError(
            f"train.model: {spec.model!r} takes (n_features, n_outputs), numeric inputs only; the inputs "
            f"{others} need a factory(inputs, n_outputs, **model_kwargs) (docs/models.md)"
        )
    model = factory(spec.n_features, spec.n_outputs, **spec.model_kwargs)
    if isinstance(model, nn.Module):
        names = block_names(inputs)  # the numeric inputs, then their missing indicators
        model.register_forward_pre_hook(lambda module, args: _stacked(args, names))
    return model


def _stacked(args: tuple, names: list[str]) -> tuple | None:
    """The batch dict as the [B, F] matrix an older factory's forward takes; a tensor passes as it is."""
    if args and isinstance(args[0], dict):
        return (numeric_block(args[0], names), *args[1:])
    return None
