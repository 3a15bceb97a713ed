"""Numeric inputs as real tables hold them: robust scaling (the train median and interquartile range, smoothly
clipped) fitted on the train split only, and the numeric embeddings' quantile bins, exact and the same for any
shard layout (training/kinds/tabular.py: NumericCodec.fit_train_column; docs/data.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.kinds.normalisation import Normaliser
from training.kinds.registry import read_encoders
from training.kinds.tabular import QUANTILE_BINS
from training.prepare.dataset import prepare_dataset

ROWS = 4000


def amounts_table(rows: int = ROWS, seed: int = 3) -> pa.Table:
    """A heavy-tailed int64 amount (lognormal, a few values a million times the median), nulls among them."""
    rng = np.random.default_rng(seed)
    amount = np.round(rng.lognormal(3.0, 1.5, size=rows)).astype(np.int64)
    amount[rng.choice(rows, size=8, replace=False)] = 10**9
    return pa.table(
        {
            "id": np.arange(rows),
            "amount": pa.array(amount, mask=rng.random(rows) < 0.05),
            "hour": rng.integers(0, 24, size=rows),
            "label": rng.integers(0, 2, size=rows),
        }
    )


INPUTS = {"amount": "numeric", "hour": "numeric"}


def numeric_state(prepared, name: str) -> dict:
    return read_encoders(prepared.dataset_dir, prepared.manifest)[name]["state"]


def train_values(prepared, dh, name: str) -> np.ndarray:
    column = dh.read_split(prepared, "train")[name].to_numpy(zero_copy_only=False).astype(np.float64)
    return column[~np.isnan(column)]


def test_robust_scaling_keeps_the_bulk_of_a_heavy_tailed_amount_apart(table_file, make_config, dh):
    """The default: center the train median, scale its interquartile range, clipped smoothly within (-3, 3): the
    middle 80 % of the train amounts spans more than one unit, where the mean and std (scaling: standard, the
    rule before) squash it to almost nothing. The statistics are the train split's (numpy's own quantiles)."""
    path = table_file(amounts_table())
    prepared = prepare_dataset(make_config(path, key="id", inputs=INPUTS))
    manifest, values = prepared.manifest, train_values(prepared, dh, "amount")
    low, median, high = np.quantile(values, [0.25, 0.5, 0.75])
    j = manifest.features.index("amount")
    assert manifest.feature_center[j] == pytest.approx(median) and manifest.feature_scale[j] == pytest.approx(
        high - low
    )
    assert manifest.feature_clip[: len(manifest.features)] == [True, True]
    assert numeric_state(prepared, "amount")["impute"] == pytest.approx(median)  # a null lands on 0, the center
    standard = prepare_dataset(
        make_config(path, key="id", inputs={**INPUTS, "amount": {"kind": "numeric", "scaling": "standard"}})
    )
    assert standard.fingerprint != prepared.fingerprint
    assert standard.manifest.feature_center[j] == pytest.approx(values.mean())
    assert standard.manifest.feature_scale[j] == pytest.approx(values.std())

    def spread(manifest) -> tuple[float, float]:
        """The scaled train amounts: the width of their middle 80 %, and their largest magnitude."""
        block = np.zeros((len(values), manifest.n_features), dtype=np.float32)
        block[:, j] = values
        scaled = Normaliser.from_manifest(manifest).features_(torch.from_numpy(block))[:, j].numpy()
        return float(np.subtract(*np.quantile(scaled, [0.9, 0.1]))), float(np.abs(scaled).max())

    robust_width, robust_largest = spread(manifest)
    standard_width, standard_largest = spread(standard.manifest)
    assert robust_width > 1.0 and robust_largest <= 3.0  # the bulk kept apart, the extremes clipped
    assert standard_width < 0.01 and standard_largest > 10  # the rule before: the bulk at ~0, the tail far out


def test_a_test_row_with_an_extreme_value_moves_no_statistic(table_file, make_config, dh):
    """Fitted on the train split only: an amount of 10^15 in a test row (the key keeps every row in its split)
    changes neither the scaling, the imputed value nor the bins."""
    table = amounts_table()
    before = prepare_dataset(make_config(table_file(table, "before.parquet"), key="id", inputs=INPUTS))
    test_ids = dh.read_split(before, "test")["id"].to_numpy()
    amount = table["amount"].to_numpy(zero_copy_only=False).copy()
    amount[test_ids[:3]] = 1e15
    changed = table.set_column(1, "amount", pa.array(amount.astype(np.float64)))
    after = prepare_dataset(make_config(table_file(changed, "after.parquet"), key="id", inputs=INPUTS))
    assert np.nanmax(dh.read_split(after, "test")["amount"].to_numpy(zero_copy_only=False)) > 1e14
    for field in ("feature_center", "feature_scale", "feature_clip"):
        assert getattr(after.manifest, field) == getattr(before.manifest, field), field
    assert after.manifest.inputs == before.manifest.inputs  # the bins the model gets
    for key in ("center", "scale", "impute", "edges"):
        assert numeric_state(after, "amount")[key] == numeric_state(before, "amount")[key], key


def test_bins_are_the_exact_train_quantiles_for_any_shard_layout(table_file, make_config, dh, tmp_path):
    """The bins are the train split's quantiles at 0, 1/48, ..., 1 (values, repeats merged), computed from
    the whole train column: the same edges whether the source is one file or three in another row order, and
    whatever the shard, row-group and read-batch sizes. The model gets them scaled, strictly increasing."""
    table = amounts_table()
    one = prepare_dataset(make_config(table_file(table), key="id", inputs=INPUTS))
    parts = tmp_path / "parts"
    parts.mkdir()
    order = np.random.default_rng(9).permutation(table.num_rows)
    for k, rows in enumerate(np.array_split(order, 3)):
        pq.write_table(table.take(pa.array(rows)), parts / f"part-{k}.parquet")
    other = prepare_dataset(
        make_config(parts, key="id", inputs=INPUTS, rows_per_shard=333, row_group_size=111, read_batch_rows=97)
    )
    assert len(other.manifest.splits["train"].shards) > len(one.manifest.splits["train"].shards)
    values = train_values(one, dh, "amount")
    expected = np.unique(np.quantile(values, np.linspace(0, 1, QUANTILE_BINS + 1), method="lower"))
    for prepared in (one, other):
        state = numeric_state(prepared, "amount")
        np.testing.assert_array_equal(state["edges"], expected)
        assert len(state["edges"]) > 40  # rounded amounts: a few low ones repeat
        hours = numeric_state(prepared, "hour")["edges"]
        assert hours == list(range(24))  # 24 values: one edge each, repeats merged
    assert other.manifest.inputs == one.manifest.inputs
    bins = {entry["name"]: entry["bins"] for entry in one.manifest.inputs}
    assert all(np.all(np.diff(edges) > 0) for edges in bins.values())
    assert max(map(abs, bins["amount"])) <= 3.0  # scaled and clipped as the input is
