"""The built-in tabular model's defaults: the batch a small table can take, early stopping,
the mlp's defaults recorded in the resolved config, and the ensemble (TabM-mini's k members: each trained on its
own loss, predicting with the mean of their probabilities or values).

No ranks here: tests/training/test_selection.py (``by_default``) trains a tiny table with these defaults under
torchrun."""

from __future__ import annotations

import pytest
import torch
from manifest_datasets import make_dataset

from training.core.config import (
    AUTO_BATCH_MAX,
    DEFAULT_LABEL_SMOOTHING,
    DEFAULT_LR,
    DEFAULT_PATIENCE,
    ConfigError,
    PipelineConfig,
    auto_batch_size,
)
from training.core.manifest import read_manifest
from training.core.topology import RankLayout
from training.kinds.inputs import InputInfo, numeric_input
from training.models.tabular import (
    MLP,
    MLP_DEFAULTS,
    SMALL_TABLE_ENSEMBLE,
    SMALL_TABLE_ROWS,
    default_ensemble,
    default_lr,
    defaults_to_record,
    embedding_dim,
    run_defaults,
)
from training.objectives.base import output_members
from training.objectives.registry import build_objective
from training.preflight import check_data
from training.resolve import resolve_for_data

TWO_RANKS = RankLayout(nproc_per_node=2, nnodes=1, backend="gloo", gpus=0)


def config(**train) -> PipelineConfig:
    return PipelineConfig.model_validate({"train": train})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """137 train rows, as scikit-learn's wine table has: the earlier default batch (512 per rank) was refused."""
    root = tmp_path_factory.mktemp("tiny")
    return read_manifest(make_dataset(root, rows={"train": 137, "val": 20, "test": 21}))


def test_the_default_batch_fits_a_tiny_table_and_the_run_records_it(tiny):
    check_data(config(), tiny, TWO_RANKS)  # refused before: "train.batch_size: 512 is larger than ..."
    resolved = resolve_for_data(config(), tiny, TWO_RANKS.world_size)
    assert resolved.train.batch_size == 4  # 137 rows / (2 ranks x 16 steps) = 4.3 -> 4
    assert resolved.train.early_stopping_patience == DEFAULT_PATIENCE
    assert resolved.train.model == "mlp" and resolved.train.model_kwargs == defaults_to_record(137)
    assert resolved.train.model_kwargs["ensemble"] == SMALL_TABLE_ENSEMBLE  # a small table: TabM's members
    assert '"batch_size":4' in resolved.model_dump_json()  # config.json holds the number, not auto
    assert resolve_for_data(resolved, tiny, TWO_RANKS.world_size) == resolved  # the stage's second pass: a no-op
    # A batch the user sets is theirs: kept, and still refused when it cannot fit.
    with pytest.raises(ConfigError, match="train.batch_size: 512 is larger"):
        check_data(config(batch_size=512), tiny, TWO_RANKS)
    assert resolve_for_data(config(batch_size=64), tiny, 2).train.batch_size == 64


def test_label_smoothing_is_realmlps_for_several_classes_and_none_for_two_classes_or_a_value(tmp_path, tiny):
    """auto: 0.1 for a softmax over more than two classes (accuracy gained on the real tables), 0 for two classes
    (their ROC AUC lost it) and for regression; the run records the number, and a number set is kept."""
    two = read_manifest(make_dataset(tmp_path, n_classes=2, rows={"train": 137, "val": 20, "test": 21}))
    value = read_manifest(make_dataset(tmp_path, task="regression", rows={"train": 137, "val": 20, "test": 21}))
    resolved = resolve_for_data(config(), tiny, 2).train  # 4 classes
    assert resolved.label_smoothing == DEFAULT_LABEL_SMOOTHING == 0.1
    assert build_objective(resolved, tiny).label_smoothing == 0.1
    assert build_objective(config().train, tiny).label_smoothing == 0.1  # a rank given an unresolved config
    assert resolve_for_data(config(), two, 2).train.label_smoothing == 0.0
    assert build_objective(config().train, two).label_smoothing == 0.0
    assert resolve_for_data(config(), value, 2).train.label_smoothing == 0.0
    assert build_objective(config().train, value).name == "mse"  # no smoothing to refuse
    assert resolve_for_data(config(label_smoothing=0.0), tiny, 2).train.label_smoothing == 0.0
    assert resolve_for_data(config(label_smoothing=0.2), two, 2).train.label_smoothing == 0.2


def test_the_mlps_rate_on_a_value_comes_down_with_the_square_root_of_a_small_steps_rows(tmp_path, tiny):
    """auto, for a regression target: DEFAULT_LR from 256 rows a step (the anchors' batch) up, lower below it by
    sqrt(rows / 256): Hitters' 8-row steps (222 train rows on 2 ranks) get 1.8e-4. Classes keep DEFAULT_LR (the rule
    was measured on regression targets). The run records the number; one set is kept; the world size does not move it
    where a step's rows stay the same; another model, and a rank given an unresolved config, take DEFAULT_LR."""
    assert [round(default_lr(rows, "regression"), 7) for rows in (1, 8, 16, 64, 256, 512, 4096)] == [
        6.25e-05,
        0.0001768,
        0.00025,
        0.0005,
        0.001,
        0.001,
        0.001,
    ]
    assert default_lr(8, "classification") == DEFAULT_LR
    value = read_manifest(make_dataset(tmp_path, task="regression", rows={"train": 137, "val": 20, "test": 21}))
    resolved = resolve_for_data(config(), value, 2).train  # 137 rows: 4 a rank, 8 a step
    assert resolved.lr == default_lr(8, "regression") and '"lr":0.000176' in resolved.model_dump_json()
    assert resolve_for_data(config(batch_size=8), value, 1).train.lr == resolved.lr  # 1 rank x 8: the same step
    assert resolve_for_data(config(batch_size=4, grad_accum=2), value, 1).train.lr == resolved.lr
    assert resolve_for_data(config(lr=0.01), value, 2).train.lr == 0.01
    assert resolve_for_data(config(), tiny, 2).train.lr == DEFAULT_LR == 1e-3  # 4 classes
    large = read_manifest(
        make_dataset(tmp_path / "large", task="regression", rows={"train": 9000, "val": 20, "test": 20})
    )
    assert resolve_for_data(config(), large, 2).train.lr == DEFAULT_LR  # 256 a rank, 512 a step
    custom = config(model="tests.stand_in_models:whatever")
    assert resolve_for_data(custom, value, 2).train.lr == DEFAULT_LR
    assert config().train.lr == "auto" and config().train.learning_rate() == DEFAULT_LR


def test_the_default_batch_grows_with_the_rows_up_to_its_cap():
    assert [auto_batch_size(rows, 2) for rows in (1, 31, 32, 137, 1441, 24_000)] == [1, 1, 1, 4, 32, 512]
    assert auto_batch_size(10_000_000, 8) == AUTO_BATCH_MAX
    assert auto_batch_size(24_000, 1) == 512 and auto_batch_size(8_000, 1) == 256


def test_without_a_val_split_the_default_does_not_stop_early_and_is_not_refused(tmp_path):
    manifest = read_manifest(make_dataset(tmp_path, rows={"train": 300, "val": 0, "test": 20}))
    check_data(config(), manifest, TWO_RANKS)
    assert resolve_for_data(config(), manifest, 2).train.early_stopping_patience is None
    with pytest.raises(ConfigError, match="the val split is empty"):
        check_data(config(early_stopping_patience=3), manifest, TWO_RANKS)  # asked for: refused, as before


def test_the_users_model_kwargs_win_over_the_mlp_defaults(tiny):
    resolved = resolve_for_data(config(model_kwargs={"hidden": [8], "ensemble": 3}), tiny, 2)
    assert resolved.train.model_kwargs == {**defaults_to_record(137), "hidden": [8], "ensemble": 3}
    # What is recorded rebuilds MLP_DEFAULTS' architecture; nothing is recorded where the class gives it already.
    built = MLP({"a": numeric_input("a")}, 2, **resolve_for_data(config(), tiny, 2).train.model_kwargs)
    layers = list(built.net)
    default_hidden = [a.out_features for a, b in zip(layers, layers[1:]) if isinstance(b, torch.nn.ReLU)]
    assert default_hidden == MLP_DEFAULTS["hidden"]
    assert built.output_members == run_defaults(137)["ensemble"] == SMALL_TABLE_ENSEMBLE
    custom = config(model="tests.stand_in_models:whatever", model_kwargs={"width": 4})
    assert resolve_for_data(custom, tiny, 2).train.model_kwargs == {"width": 4}  # a factory's own: untouched


def test_a_small_table_gets_tabms_ensemble_and_a_larger_one_a_single_model(tmp_path):
    """One seed's model moves most on a small table (diabetes' R² 0.227 and 0.246 at two seeds, 345 train rows), and
    there k members cost seconds: up to SMALL_TABLE_ROWS train rows a run's mlp has SMALL_TABLE_ENSEMBLE members."""
    assert [default_ensemble(rows) for rows in (1, 345, SMALL_TABLE_ROWS, SMALL_TABLE_ROWS + 1, 10**8)] == [
        SMALL_TABLE_ENSEMBLE,
        SMALL_TABLE_ENSEMBLE,
        SMALL_TABLE_ENSEMBLE,
        1,
        1,
    ]
    larger = read_manifest(make_dataset(tmp_path, rows={"train": SMALL_TABLE_ROWS + 1, "val": 20, "test": 20}))
    kwargs = resolve_for_data(config(), larger, 2).train.model_kwargs
    assert "ensemble" not in kwargs and kwargs == defaults_to_record(SMALL_TABLE_ROWS + 1)  # 1: the class's own
    assert MLP({"a": numeric_input("a")}, 2, **kwargs).adapter is None
    # A user's ensemble wins either way; the world size does not move it (resume on another world size).
    assert resolve_for_data(config(model_kwargs={"ensemble": 1}), larger, 2).train.model_kwargs["ensemble"] == 1
    small = read_manifest(make_dataset(tmp_path / "small", rows={"train": 300, "val": 20, "test": 20}))
    assert {resolve_for_data(config(), small, world).train.model_kwargs["ensemble"] for world in (1, 2, 3)} == {8}
    assert resolve_for_data(config(model_kwargs={"ensemble": 1}), small, 2).train.model_kwargs["ensemble"] == 1


def test_an_ensemble_returns_its_k_members_that_start_apart():
    torch.manual_seed(0)
    inputs = {name: numeric_input(name) for name in ("a", "b", "c")}
    model = MLP(inputs, 3, hidden=[16, 16], ensemble=4)
    row = torch.randn(5, 3)
    assert model.adapter(row).shape == (5, 4, 3)  # member i sees the row scaled by its own signs
    assert set(model.adapter.scale.unique().tolist()) <= {-1.0, 1.0}
    members = model({"a": row[:, 0], "b": row[:, 1], "c": row[:, 2]})
    assert members.shape == (5, 4, 3) and output_members(model) == 4
    torch.testing.assert_close(members, model.net[-1](model.net[:-1](model.adapter(row))))
    assert (members[:, 0] - members[:, 1]).abs().max() > 1e-3, "the members differ"
    # One member is the earlier MLP: the same parameters (keys and shapes), no adapter.
    single = MLP(inputs, 3, hidden=[16, 16])
    assert single.adapter is None and output_members(single) == 1
    names = [f"net.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")]
    assert [name for name, _ in single.named_parameters()] == names


def test_a_runs_mlp_scales_each_embedding_to_unit_variance_and_an_earlier_model_stays_unscaled(tiny):
    """An id's 64 N(0, 1) numbers would outweigh every other input of the first layer (card_fraud: the first layer
    memorised 5,000 customers by their random codes, docs/models.md); a run's mlp scales each embedding by
    1/sqrt(width), so each enters with unit variance at initialisation, as a scaled numeric input does."""
    assert resolve_for_data(config(), tiny, 2).train.model_kwargs["scale_embeddings"] is True
    inputs = {
        "a": numeric_input("a"),
        "customer": InputInfo("customer", "categorical", "int64", (), 5002),
        "kind": InputInfo("kind", "categorical", "int64", (), 8),
    }
    torch.manual_seed(0)
    scaled = MLP(inputs, 2, hidden=[8], numeric_embeddings="none", scale_embeddings=True)
    torch.manual_seed(0)
    earlier = MLP(inputs, 2, hidden=[8], numeric_embeddings="none")  # a model.pt of before: no such kwarg
    assert list(scaled.state_dict()) == list(earlier.state_dict())  # the same parameters: only the forward differs
    every_value = torch.arange(5002)
    for name, width in (("customer", 64), ("kind", embedding_dim(8))):
        vectors = scaled._embedded(name, every_value[: inputs[name].cardinality])
        torch.testing.assert_close(
            vectors, earlier._embedded(name, every_value[: inputs[name].cardinality]) / width**0.5
        )
        assert 0.8 < vectors.pow(2).sum(dim=1).mean() < 1.2  # unit variance in all, whatever the width
    unscaled_norm = earlier._embedded("customer", every_value).pow(2).sum(dim=1).mean()
    assert 55 < unscaled_norm < 73  # 64: what an unscaled id brought to the first layer
    batch = {"a": torch.randn(6), "customer": torch.randint(0, 5002, (6,)), "kind": torch.randint(0, 8, (6,))}
    moved = {key: value.clone() for key, value in scaled.state_dict().items()}
    moved["embeddings.customer.weight"] /= 8.0  # 1/sqrt(64) moved into the table...
    moved["embeddings.kind.weight"] /= embedding_dim(8) ** 0.5
    earlier.load_state_dict(moved)
    with torch.no_grad():
        torch.testing.assert_close(earlier(batch), scaled(batch))  # ...is the unscaled model: the same outputs


def test_the_mlp_keeps_relu_by_default_and_a_smooth_activation_is_the_same_parameters(tiny):
    """A run's mlp uses ReLU unless ``activation`` says otherwise (nothing recorded: a model.pt without the kwarg
    rebuilds as trained); ``activation: silu`` swaps only the nonlinearity: the same parameters, drawn alike."""
    assert "activation" not in resolve_for_data(config(), tiny, 2).train.model_kwargs
    inputs = {name: numeric_input(name) for name in ("a", "b")}
    torch.manual_seed(0)
    smooth = MLP(inputs, 2, hidden=[8, 8], activation="silu")
    torch.manual_seed(0)
    default = MLP(inputs, 2, hidden=[8, 8])
    assert [type(layer) for layer in default.net] == [torch.nn.Linear, torch.nn.ReLU] * 2 + [torch.nn.Linear]
    assert [type(layer) for layer in smooth.net] == [torch.nn.Linear, torch.nn.SiLU] * 2 + [torch.nn.Linear]
    assert list(smooth.state_dict()) == list(default.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(smooth.state_dict().values(), default.state_dict().values()))
    with pytest.raises(ValueError, match="activation must be one of .*'relu'.*not 'tanh'"):
        MLP(inputs, 2, activation="tanh")
