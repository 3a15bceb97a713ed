"""The tables benchmark's generators have the structure they claim, and the family is registered.

No torchrun and no training here: ``python -m bench --only tables`` measures; these tests check that what it
measures on is what docs/benchmarks.md says (nulls where stated, the imbalance, the target's range, ids with
thousands of values, the dtypes of real sources) and that the same call gives the same table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench.__main__ import FAMILIES, family_module
from bench.workloads.beside_boosting import MAX_BINS, boosting_features, wide_ids
from bench.workloads.tables import (
    BINARY,
    BUNDLED,
    GENERATED,
    MULTICLASS,
    REGRESSION,
    TABLES,
    generate,
    inputs_of,
)

ROWS = 6_000
BY_NAME = {spec.name: spec for spec in TABLES}


@pytest.fixture(scope="module")
def frames():
    return {spec.name: generate(spec, ROWS) for spec in GENERATED}


def test_the_family_is_registered_and_its_module_runs_tables():
    import importlib

    assert "tables" in FAMILIES
    module = importlib.import_module(family_module("tables"))
    assert callable(module.run)


def test_generators_are_deterministic_and_the_seed_matters(frames):
    for spec in GENERATED:
        pd.testing.assert_frame_equal(generate(spec, ROWS), frames[spec.name])
        assert not generate(spec, ROWS, seed=1).equals(frames[spec.name]), spec.name


def test_at_least_eight_generated_tables_mixing_every_kind_of_label():
    assert len(GENERATED) >= 8
    assert {spec.task for spec in GENERATED} == {BINARY, MULTICLASS, REGRESSION}
    assert {spec.task for spec in BUNDLED} == {BINARY, MULTICLASS, REGRESSION}


def test_every_column_but_the_label_is_declared_by_kind(frames):
    for spec in GENERATED:
        frame = frames[spec.name]
        assert set(spec.inputs) == set(frame.columns) - {spec.label}, spec.name
        assert set(spec.inputs.values()) <= {"numeric", "categorical"}


def test_columns_come_in_the_dtypes_real_sources_have(frames):
    dtypes = {str(dtype) for frame in frames.values() for dtype in frame.dtypes}
    assert {"int64", "int32", "float32", "bool", "Int64", "Float32"} <= dtypes
    for spec in GENERATED:  # categoricals are strings, as users' tables hold them
        frame = frames[spec.name]
        for name, kind in spec.inputs.items():
            if kind == "categorical":
                assert pd.api.types.is_string_dtype(frame[name]), (spec.name, name)


def test_nulls_are_where_the_spec_says_and_nowhere_else(frames):
    for spec in GENERATED:
        with_nulls = {name for name, count in frames[spec.name].isna().sum().items() if count}
        assert with_nulls == set(spec.nulls), spec.name
    assert sum(bool(spec.nulls) for spec in GENERATED) >= 3


def test_informative_nulls_carry_the_label(frames):
    credit = frames["credit_default"]
    missing = credit["months_employed"].isna()
    rate_missing = (credit.loc[missing, "default"] == "yes").mean()
    rate_present = (credit.loc[~missing, "default"] == "yes").mean()
    assert rate_missing > rate_present + 0.1
    houses = frames["house_prices"]
    assert houses["lot_m2"].isna().equals(houses["kind"] == "flat")


def test_class_imbalance_and_ids_with_thousands_of_values(frames):
    fraud = frames["card_fraud"]["fraud"].mean()
    assert 0.005 < fraud < 0.06
    shares = frames["ticket_priority"]["priority"].value_counts(normalize=True)
    assert shares.iloc[0] > 0.5 and shares.iloc[-1] < 0.06 and len(shares) == 5
    for table, column in [("trips_late", "route"), ("card_fraud", "customer"), ("ticket_priority", "account")]:
        assert frames[table][column].nunique() > 1_000, (table, column)


def test_regression_targets_span_orders_of_magnitude(frames):
    price = frames["house_prices"]["price"]
    assert price.min() > 0 and np.log10(price.max() / price.min()) >= 3
    claim = frames["insurance_claims"]["claim"]
    assert np.log10(claim.quantile(0.999) / claim.quantile(0.001)) >= 2
    assert frames["store_sales"]["units"].dtype == np.int64


def test_time_of_day_and_date_effects_are_in_the_label(frames):
    trips = frames["trips_late"]
    rush = trips["hour"].isin([8, 9, 17, 18])
    assert trips.loc[rush, "late"].mean() > trips.loc[~rush, "late"].mean() + 0.1
    sales = frames["store_sales"]
    assert sales.loc[sales["weekday"] >= 5, "units"].mean() > sales.loc[sales["weekday"] < 5, "units"].mean()


def test_bundled_tables_load_offline_with_their_label():
    for spec in BUNDLED:
        frame = generate(spec, 0)
        assert spec.label in frame and len(frame) > 100
        inputs = inputs_of(spec, frame)
        assert inputs and spec.label not in inputs and all(kind == "numeric" for kind in inputs.values())
        assert all(name.replace("_", "").isalnum() for name in inputs), spec.name


def test_boosting_takes_categoricals_natively_and_leaves_wide_ids_to_the_target_encoder():
    frame = pd.DataFrame({"small": ["a", "b", None], "wide": ["id1", "id9", "unseen"], "x": [1.0, np.nan, 3.0]})
    categories = {"small": ["a", "b"], "wide": [f"id{i}" for i in range(MAX_BINS + 1)]}
    features = boosting_features(frame, {"small": "categorical", "wide": "categorical", "x": "numeric"}, categories)
    assert isinstance(features["small"].dtype, pd.CategoricalDtype) and pd.isna(features["small"].iloc[2])
    assert "wide" not in features and wide_ids(categories) == ["wide"]
    assert np.isnan(features["x"].iloc[1])
