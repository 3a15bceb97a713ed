"""The model contract (training/models/registry.py): factory(inputs, n_outputs), the older factory(n_features,
n_outputs) for numeric inputs, the built-in mlp with embeddings, auto, and specs from before typed inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from training.kinds.inputs import InputInfo, numeric_input
from training.models.registry import ModelImportError, ModelSpec, build_model, pick_model
from training.models.tabular import MLP, embedding_dim, numeric_block

NUMERIC = {name: numeric_input(name) for name in ("a", "b", "c")}
MIXED = {
    **NUMERIC,
    "country": InputInfo("country", "categorical", "int64", (), 7),
    "shop": InputInfo("shop", "hashed", "int64", (), 1001),
    "vec": InputInfo("vec", "vector", "float32", (4,)),
}


def batch_of(inputs: dict[str, InputInfo], rows: int = 5) -> dict[str, torch.Tensor]:
    batch = {}
    for name, info in inputs.items():
        if info.kind in ("categorical", "hashed"):
            batch[name] = torch.randint(0, info.cardinality, (rows,))
        else:
            batch[name] = torch.randn(rows, *info.shape)
    return batch


def earlier_mlp(n_features: int, n_outputs: int, hidden=(16,)) -> nn.Module:
    """The mlp before typed inputs, as it was written: Linear -> ReLU per hidden layer, then the head."""
    layers, width = [], n_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    module = nn.Module()
    module.net = nn.Sequential(*layers, nn.Linear(width, n_outputs))
    return module


def test_numeric_only_mlp_draws_the_earlier_weights_and_keys_and_takes_the_batch_dict():
    torch.manual_seed(11)
    before = earlier_mlp(3, 2).state_dict()
    torch.manual_seed(11)
    model = build_model(ModelSpec.for_inputs("auto", NUMERIC, 2, {"hidden": [16]}))
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[key], before[key]) for key in before)
    batch = batch_of(NUMERIC)
    stacked = torch.stack([batch["a"], batch["b"], batch["c"]], dim=1)
    assert torch.equal(model(batch), model(stacked))
    # The loader's dict (views of the columns of one gathered block): that block, no copy; any other order stacks.
    views = {name: stacked[:, j] for j, name in enumerate(NUMERIC)}
    assert numeric_block(views, list(NUMERIC)) is stacked
    assert torch.equal(numeric_block(views, ["c", "a", "b"]), stacked[:, [2, 0, 1]])


def test_mlp_embeds_categorical_and_hashed_inputs_by_the_documented_rule():
    model = build_model(ModelSpec.for_inputs("mlp", MIXED, 3, {"hidden": [8]}))
    assert model.embeddings["country"].weight.shape == (7, embedding_dim(7))
    assert model.embeddings["shop"].weight.shape == (1001, min(64, round(1.6 * 1001**0.56)))
    assert model.net[0].in_features == 3 + 4 + embedding_dim(7) + embedding_dim(1001)
    assert model(batch_of(MIXED)).shape == (5, 3)
    sized = build_model(ModelSpec.for_inputs("mlp", MIXED, 3, {"hidden": [8], "embedding_dims": {"country": 2}}))
    assert sized.embeddings["country"].weight.shape == (7, 2)
    assert pick_model("auto", MIXED) == "mlp" and embedding_dim(2) == 2 and embedding_dim(10**9) == 64


def legacy_factory(n_features: int, n_outputs: int, hidden: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_outputs))


def inputs_factory(inputs, n_outputs: int) -> nn.Module:
    return MLP(inputs, n_outputs, hidden=(4,))


def test_an_older_factory_takes_numeric_inputs_and_is_refused_others_by_name(monkeypatch):
    import sys
    import types

    module = types.ModuleType("user_models")
    module.legacy_factory, module.inputs_factory = legacy_factory, inputs_factory
    monkeypatch.setitem(sys.modules, "user_models", module)
    legacy = build_model(ModelSpec.for_inputs("user_models:legacy_factory", NUMERIC, 2, {}))
    assert isinstance(legacy, nn.Sequential) and list(legacy.state_dict()) == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    batch = batch_of(NUMERIC)
    assert torch.equal(legacy(batch), legacy(torch.stack(list(batch.values()), dim=1)))
    with pytest.raises(ModelImportError) as caught:
        build_model(ModelSpec.for_inputs("user_models:legacy_factory", MIXED, 2, {}))
    assert "country (categorical)" in str(caught.value) and "factory(inputs, n_outputs" in str(caught.value)
    assert build_model(ModelSpec.for_inputs("user_models:inputs_factory", MIXED, 2, {}))(batch_of(MIXED)).shape == (
        5,
        2,
    )


def test_a_spec_from_before_typed_inputs_rebuilds_on_its_features():
    old = {"model": "mlp", "n_features": 2, "n_outputs": 3, "model_kwargs": {"hidden": [4]}}
    spec = ModelSpec.from_dict(old, ["p", "q"])
    assert list(spec.input_infos()) == ["p", "q"] and spec.to_dict()["inputs"][0]["kind"] == "numeric"
    model = build_model(ModelSpec.from_dict(old))  # no names: x0, x1
    assert model({"x0": torch.ones(2), "x1": torch.ones(2)}).shape == (2, 3)
    # Built from a bare count, it takes any two numeric entries in order (bench/ builds models that way).
    assert torch.equal(
        model({"p": torch.ones(2), "q": torch.zeros(2)}), model({"x0": torch.ones(2), "x1": torch.zeros(2)})
    )


def test_a_user_factorys_package_is_shipped_with_the_served_model():
    from training.inference.serving import user_code_paths

    (shipped,) = user_code_paths("tests.dropout_model:dropout_mlp")
    assert shipped == str(Path(__file__).resolve().parents[2])  # the top-level package: tests/
    assert user_code_paths("mlp") == [] and user_code_paths("auto") == []


def test_the_default_is_auto_and_an_explicit_model_that_cannot_take_the_inputs_names_the_one_that_can():
    """train.model defaults to auto; mlp named on an image folder says to set auto or image_cnn (and image_cnn
    is a name the config takes); image and text together: no built-in takes both, a factory does."""
    from training.core.config import ConfigError, PipelineConfig

    assert PipelineConfig().train.model == "auto"
    assert PipelineConfig.model_validate({"train": {"model": "image_cnn"}}).train.model == "image_cnn"
    image = {"image": InputInfo("image", "image", "float32", (3, 12, 12))}
    wanted = r"mlp takes .* not \['image \(image\)'\]; set train.model: auto or image_cnn$"
    with pytest.raises(ConfigError, match=wanted):
        build_model(ModelSpec.for_inputs("mlp", image, 3, {}))
    with pytest.raises(ConfigError, match=r"image_cnn needs at least one image input.*auto or mlp$"):
        build_model(ModelSpec.for_inputs("image_cnn", MIXED, 3, {}))
    assert build_model(ModelSpec.for_inputs("auto", image, 3, {"width": 4, "blocks": [1], "groups": 2}))
    text = {"note": InputInfo("note", "text", "int64", (8,), 50)}
    with pytest.raises(ConfigError, match=r"no built-in model takes \['image', 'text'\] together"):
        build_model(ModelSpec.for_inputs("auto", {**image, **text}, 3, {}))
