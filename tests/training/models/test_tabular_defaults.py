"""The built-in tabular model's defaults (issue 36 item 4): the batch a small table can take, early stopping,
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
    DEFAULT_PATIENCE,
    ConfigError,
    PipelineConfig,
    auto_batch_size,
)
from training.core.manifest import read_manifest
from training.core.topology import RankLayout
from training.kinds.inputs import numeric_input
from training.models.tabular import MLP, MLP_DEFAULTS, defaults_to_record
from training.objectives.base import output_members
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
    assert resolved.train.model == "mlp" and resolved.train.model_kwargs == defaults_to_record()
    assert '"batch_size":4' in resolved.model_dump_json()  # config.json holds the number, not auto
    assert resolve_for_data(resolved, tiny, TWO_RANKS.world_size) == resolved  # the stage's second pass: a no-op
    # A batch the user sets is theirs: kept, and still refused when it cannot fit.
    with pytest.raises(ConfigError, match="train.batch_size: 512 is larger"):
        check_data(config(batch_size=512), tiny, TWO_RANKS)
    assert resolve_for_data(config(batch_size=64), tiny, 2).train.batch_size == 64


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
    assert resolved.train.model_kwargs == {**defaults_to_record(), "hidden": [8], "ensemble": 3}
    # What is recorded rebuilds MLP_DEFAULTS' architecture; nothing is recorded where the class gives it already.
    built = MLP({"a": numeric_input("a")}, 2, **resolve_for_data(config(), tiny, 2).train.model_kwargs)
    layers = list(built.net)
    default_hidden = [a.out_features for a, b in zip(layers, layers[1:]) if isinstance(b, torch.nn.ReLU)]
    assert default_hidden == MLP_DEFAULTS["hidden"]
    assert (built.adapter is None) == (MLP_DEFAULTS["ensemble"] == 1)
    custom = config(model="tests.stand_in_models:whatever", model_kwargs={"width": 4})
    assert resolve_for_data(custom, tiny, 2).train.model_kwargs == {"width": 4}  # a factory's own: untouched


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
