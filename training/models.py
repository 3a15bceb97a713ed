"""Model construction: the model contract. Models are plain single-device ``nn.Module``s.

Nothing here knows about processes or devices: ``training.distributed`` wraps
the model in DDP in one place.

The contract (docs/models.md): ``train.model: package.module:factory`` is called as
``factory(inputs: dict[str, InputInfo], n_outputs: int, **model_kwargs)``; the module's
``forward(batch: dict[str, Tensor]) -> [B, n_outputs]`` gets one entry per input (``[B, *shape]`` of the
input's dtype, training/spec/inputs.py). A factory whose FIRST parameter is not named ``inputs`` is the
older contract, ``factory(n_features, n_outputs, **model_kwargs)`` with ``forward(x: [B, F])``: it keeps
working when every input is numeric (a forward pre-hook stacks the numeric inputs, in manifest order, into
``[B, F]``; the module and its state dict are the factory's own, so its model.pt files still load).

Built in: ``mlp`` (numeric, categorical, hashed and vector inputs; see ``MLP``), ``image_cnn`` (image inputs,
with any tabular ones: training/image_models.py), ``transformer`` (text inputs, with any tabular ones:
training/text_models.py) and ``auto``, the default, which picks the built-in model for the inputs
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

import torch
from torch import nn

from training.config import MODELS, ConfigError, PipelineConfig
from training.imports import import_factory
from training.spec.inputs import EMBEDDED_KINDS, InputInfo, inputs_from_dicts, inputs_from_manifest, numeric_input

BUILT_IN = MODELS  # image_cnn: training/image_models.py; transformer: training/text_models.py


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
        return "transformer"  # training/text_models.py
    return "mlp"  # numeric, categorical, hashed, vector: all tabular


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
    kinds = {info.kind for info in inputs.values()}
    if model == "auto":
        model = pick_model(model, inputs)
    takes = {"mlp": _MLP_KINDS, "image_cnn": (*_MLP_KINDS, "image"), "transformer": (*_MLP_KINDS, "text")}
    if model not in takes:
        return None
    needs = {"image_cnn": "image", "transformer": "text"}.get(model)
    if needs is not None and needs not in kinds:
        return f"train.model {model} needs at least one {needs} input (data.inputs: {{name: {needs}}})"
    others = [f"{name} ({info.kind})" for name, info in inputs.items() if info.kind not in takes[model]]
    if others:
        return f"train.model {model} takes {_TAKES[model]} inputs, not {others}"
    return None


_TAKES = {
    "mlp": "numeric, categorical, hashed and vector",
    "image_cnn": "image, numeric, categorical, hashed and vector",
    "transformer": "text, numeric, categorical, hashed and vector",
}


def embedding_dim(cardinality: int) -> int:
    """The embedding width of an input with ``cardinality`` rows: fastai's rule, min(64, round(1.6 * c^0.56))."""
    return max(1, min(64, round(1.6 * cardinality**0.56)))


class MLP(nn.Module):
    """Feed-forward net over every tabular input: Linear -> ReLU (-> Dropout) per hidden layer, then a head.

    Its input row is, in this order: the numeric inputs (manifest order), then each vector input, then an
    embedding per categorical and hashed input (``embedding_dim(cardinality)`` wide, or
    ``embedding_dims[name]``). With numeric inputs only it is exactly the earlier MLP: the same layers,
    created in the same order (so the same seed gives the same weights) and the same state dict keys.
    ``forward`` also takes the numeric block ``[B, F]`` as one tensor (benchmarks, older callers)."""

    def __init__(
        self,
        inputs: dict[str, InputInfo],
        n_outputs: int,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
        embedding_dims: dict[str, int] | None = None,
    ):
        super().__init__()
        self.numeric = [name for name, info in inputs.items() if info.kind == "numeric"]
        self.vectors = [name for name, info in inputs.items() if info.kind == "vector"]
        embedded = {name: info for name, info in inputs.items() if info.kind in EMBEDDED_KINDS}
        unknown = [f"{name} ({info.kind})" for name, info in inputs.items() if info.kind not in _MLP_KINDS]
        if unknown:
            raise ValueError(f"train.model mlp takes numeric, categorical, hashed and vector inputs, not {unknown}")
        widths = {
            name: int((embedding_dims or {}).get(name, embedding_dim(info.cardinality)))
            for name, info in embedded.items()
        }
        width = len(self.numeric) + sum(inputs[name].shape[0] for name in self.vectors) + sum(widths.values())
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, int(size)), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(size)
        layers.append(nn.Linear(width, n_outputs))
        self.net = nn.Sequential(*layers)  # first: numeric-only models draw their weights as before
        if embedded:
            self.embeddings = nn.ModuleDict(
                {name: nn.Embedding(info.cardinality, widths[name]) for name, info in embedded.items()}
            )
        self.embedded = list(embedded)

    def forward(self, batch):
        if isinstance(batch, torch.Tensor):
            return self.net(batch)
        parts = [numeric_block(batch, self.numeric)] if self.numeric else []
        parts += [batch[name] for name in self.vectors]
        parts += [self.embeddings[name](batch[name]) for name in self.embedded]
        return self.net(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


_MLP_KINDS = ("numeric", "vector", *EMBEDDED_KINDS)


def mlp(inputs: dict[str, InputInfo], n_outputs: int, **kwargs) -> MLP:
    return MLP(inputs, n_outputs, **kwargs)


class ModelImportError(ValueError):
    """``train.model`` names something that cannot be imported or called."""


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    if name == "image_cnn":
        from training.image_models import image_classifier

        return image_classifier
    if name == "transformer":
        from training.text_models import transformer

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


def numeric_block(batch: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The numeric inputs ``names`` as one ``[B, F]`` matrix, in that order.

    The loader hands them over as column views of the one block it gathered (training/loading.py); when
    they are exactly its columns, in order, that block IS the matrix and no copy is made. Otherwise (a
    dict built by hand, another order) they are stacked: the same values either way. A model built from a
    bare feature count (``ModelSpec`` without inputs: names x0, x1, ...) takes a dict of as many numeric
    entries, whatever their names, in the dict's order."""
    if names[0] not in batch and len(batch) == len(names) and all(name.startswith("x") for name in names):
        batch, names = dict(zip(names, batch.values())), list(names)
    first = batch[names[0]]
    block = first._base
    if (
        block is not None
        and block.dim() == 2
        and block.shape == (first.shape[0], len(names))
        and block.is_contiguous()
        and all(
            batch[name]._base is block and batch[name].storage_offset() == block.storage_offset() + j
            for j, name in enumerate(names)
        )
    ):
        return block
    return torch.stack([batch[name] for name in names], dim=1)
