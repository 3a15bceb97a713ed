"""Typed inputs at prepare: data.inputs, the encoders fitted on train, raw columns in the shards, the columns
the default leaves out, row weights (training/kinds/registry.py, training/prepare/dataset.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import ConfigError, load_config
from training.kinds.registry import ENCODERS_FILE, encoders_sha256, make_codec, read_encoders
from training.prepare.dataset import DataError, prepare_dataset

ROWS = 2000


def mixed_table(rows: int = ROWS, seed: int = 0) -> pa.Table:
    """A numeric column, three categoricals (one with a rare value), an id, a vector, a long text column."""
    rng = np.random.default_rng(seed)
    country = rng.choice(["no", "se", "dk"], size=rows, p=[0.5, 0.3, 0.2]).astype(object)
    country[::97] = None  # nulls are a category of their own (index 0)
    plan = rng.choice(["basic", "pro"], size=rows).astype(object)
    plan[0] = "rare"  # seen once: below min_count 2
    return pa.table(
        {
            "customer": np.arange(rows),
            "tenure": rng.normal(size=rows),
            "country": pa.array(country, type=pa.string()),
            "plan": pa.array(plan, type=pa.string()),
            "device": rng.choice(["ios", "android", "web"], size=rows),
            "merchant_id": [f"m-{i:06d}" for i in rng.permutation(rows)],
            "embedding": [rng.normal(size=3).tolist() for _ in range(rows)],
            "big_id": rng.integers(0, 2**40, size=rows),
            "notes": ["a free-text remark about this customer, long enough to read as text"] * rows,
            "w": rng.uniform(0.5, 2.0, size=rows),
            "churned": (country == "no").astype(np.int64),
        }
    )


INPUTS = {
    "tenure": "numeric",
    "country": "categorical",
    "plan": {"kind": "categorical", "min_count": 2},
    "device": {"kind": "categorical", "max_size": 2},
    "merchant_id": {"kind": "hashed", "buckets": 97},
    "embedding": "vector",
}


@pytest.fixture
def mixed(table_file, make_config):
    path = table_file(mixed_table())
    config = make_config(path, label="churned", key="customer", inputs=INPUTS, weight="w")
    return prepare_dataset(config), path


def test_short_and_long_forms_and_errors_that_name_the_path():
    """The kind's record checks its options (``check_inputs``: the flow's preflight, prepare)."""
    from training.kinds.registry import check_inputs

    config = load_config(None, ["data.inputs={a: categorical, b: {kind: hashed, buckets: 7}}"])
    assert check_inputs(config.data) == {"a": ("categorical", {"min_count": 1}), "b": ("hashed", {"buckets": 7})}
    for override, fragment in (
        ("data.inputs={a: hashed}", "data.inputs.a: kind 'hashed' needs buckets"),
        ("data.inputs={a: {kind: numeric, min_count: 2}}", "data.inputs.a: kind 'numeric' takes no option"),
        ("data.inputs={a: audio}", "data.inputs.a.kind"),
        ("data.inputs={label: numeric}", "inputs.label: 'label' is the label column"),
    ):
        with pytest.raises(ConfigError) as caught:
            check_inputs(load_config(None, [override]).data)
        assert fragment in str(caught.value)
    with pytest.raises(ConfigError, match="data.inputs or data.features, not both"):
        load_config(None, ["data.inputs={a: numeric}", "data.features=[a]"])


def test_manifest_records_each_input_and_shards_keep_raw_values(mixed, dh):
    prepared, _ = mixed
    manifest = prepared.manifest
    kinds = {entry["name"]: (entry["kind"], entry["dtype"], tuple(entry["shape"])) for entry in manifest.inputs}
    assert kinds == {
        "tenure": ("numeric", "float32", ()),
        "country": ("categorical", "int64", ()),
        "plan": ("categorical", "int64", ()),
        "device": ("categorical", "int64", ()),
        "merchant_id": ("hashed", "int64", ()),
        "embedding": ("vector", "float32", (3,)),
    }
    cardinality = {entry["name"]: entry["cardinality"] for entry in manifest.inputs}
    assert cardinality["country"] == 3 + 2 and cardinality["plan"] == 2 + 2 and cardinality["device"] == 2 + 2
    assert cardinality["merchant_id"] == 97 + 1
    assert manifest.features == ["tenure"] and manifest.weight == "w"
    train = dh.read_split(prepared, "train")
    assert train.schema.field("country").type == pa.string() and train.schema.field("w").type == pa.float32()
    assert train.schema.field("embedding").type == pa.list_(pa.float32())
    assert set(train["country"].drop_null().to_pylist()) == {"no", "se", "dk"}  # strings stay strings


def test_encoders_fitted_on_train_only_deterministic_and_hashed_into_the_manifest(mixed, dh, make_config):
    prepared, path = mixed
    text = (prepared.dataset_dir / ENCODERS_FILE).read_text()
    assert prepared.manifest.encoders == {"file": ENCODERS_FILE, "sha256": encoders_sha256(text)}
    states = read_encoders(prepared.dataset_dir, prepared.manifest)
    train = dh.read_split(prepared, "train")
    counts = {}
    for value in train["country"].drop_null().to_pylist():
        counts[value] = counts.get(value, 0) + 1
    expected = sorted(counts, key=lambda value: (-counts[value], value))  # count descending, then value
    assert states["country"]["state"]["values"] == expected
    assert states["country"]["state"]["counts"] == [counts[value] for value in expected]
    assert "rare" not in states["plan"]["state"]["values"]  # below min_count
    assert len(states["device"]["state"]["values"]) == 2  # max_size
    # Another root, the same source and config: the same encoders, byte for byte.
    again = prepare_dataset(
        make_config(
            path,
            label="churned",
            key="customer",
            inputs=INPUTS,
            weight="w",
            root=str(prepared.dataset_dir.parent.parent / "again"),
        )
    )
    assert (again.dataset_dir / ENCODERS_FILE).read_text() == text
    (prepared.dataset_dir / ENCODERS_FILE).write_text(text.replace('"no"', '"xx"'))
    with pytest.raises(ValueError, match="sha256 does not match"):
        read_encoders(prepared.dataset_dir, prepared.manifest)


def test_codecs_reserve_null_and_unknown_and_hash_stably():
    codec = make_codec("c", "categorical", {"min_count": 1})
    codec.observe(pa.array(["b", "a", "b", None]))
    codec.load(codec.fit())
    assert codec.encode(pa.array(["b", "a", None, "never-seen"])).tolist() == [2, 3, 0, 1]
    hashed = make_codec("h", "hashed", {"buckets": 10})
    first = hashed.encode(pa.array(["x", "y", None, "x"]))
    assert first[2] == 0 and first[0] == first[3] and all(1 <= first[i] <= 10 for i in (0, 1, 3))
    # A stable hash (pandas' SipHash with a fixed key), not Python's salted hash(): fixed buckets.
    assert hashed.encode(pa.array(["x", "y"])).tolist() == first[:2].tolist()
    assert make_codec("h", "hashed", {"buckets": 1_000_003}).encode(pa.array([42, 43])).tolist() == [
        EXPECTED_INT_BUCKETS[42],
        EXPECTED_INT_BUCKETS[43],
    ]
    vector = make_codec("v", "vector")
    assert vector.valid(pa.array([[1.0, 2.0], [3.0], None, [np.nan, 1.0]]), "f").tolist() == [True, False, False, False]
    assert vector.encode(pa.array([[1.0, 2.0], [3.0, 4.0]])).shape == (2, 2)


def test_the_batch_evaluation_and_serving_encode_owns_its_memory():
    """A null-free float32 vector column's values come out of pyarrow as a read-only view of its buffer: a
    batch tensor on that view would alias the caller's table, and a model writing its input in place would
    write into the table."""
    from training.kinds.inputs import InputInfo
    from training.kinds.normalisation import Normaliser
    from training.kinds.registry import encode_columns

    vector = make_codec("v", "vector")
    vector.load({"dim": 2})
    column = pa.array([[1.0, 2.0], [3.0, 4.0]], type=pa.list_(pa.float32()))
    inputs = {"v": InputInfo("v", "vector", "float32", shape=(2,))}
    batch = encode_columns({"v": column}, inputs, {"v": vector}, Normaliser.from_stats([], []))
    batch["v"].add_(10.0)  # what a model that normalises its input in place does
    assert column.to_pylist() == [[1.0, 2.0], [3.0, 4.0]]
    assert batch["v"].tolist() == [[11.0, 12.0], [13.0, 14.0]]


# pandas.util.hash_array of the int64 values, mod 1_000_003, plus 1: the same on every machine and run.
EXPECTED_INT_BUCKETS = {42: 836832, 43: 352817}


def test_default_inputs_name_every_column_left_out_and_warn_on_big_integers(table_file, make_config):
    prepared = prepare_dataset(make_config(table_file(mixed_table()), label="churned", key="customer"))
    left = {entry["column"]: entry["suggest"] for entry in prepared.manifest.extra["left_out"]}
    assert left["country"] == "categorical" and left["plan"] == "categorical" and left["device"] == "categorical"
    assert left["merchant_id"].startswith("{kind: hashed")
    assert left["embedding"] == "vector" and left["notes"].startswith("text")
    assert "tenure" not in left and "big_id" not in left  # numeric: taken as features, as before
    warnings = prepared.manifest.extra["warnings"]
    assert len(warnings) == 1 and "'big_id'" in warnings[0] and "categorical" in warnings[0]
    assert "hashed" in warnings[0]


def test_row_weights_are_checked(table_file, make_config):
    table = mixed_table(400)
    weights = table["w"].to_numpy().copy()
    weights[7] = -1.0
    path = table_file(table.set_column(table.schema.get_field_index("w"), "w", pa.array(weights)))
    with pytest.raises(DataError) as caught:
        prepare_dataset(make_config(path, label="churned", key="customer", inputs={"tenure": "numeric"}, weight="w"))
    assert str(path) in str(caught.value) and "column 'w': 1" in str(caught.value)
    zero = table_file(table.set_column(table.schema.get_field_index("w"), "w", pa.array(np.zeros(400))), "zero.parquet")
    with pytest.raises(DataError) as caught:
        prepare_dataset(make_config(zero, label="churned", key="customer", inputs={"tenure": "numeric"}, weight="w"))
    assert "weight column 'w'" in str(caught.value) and "400 rows" in str(caught.value)


def test_a_list_label_is_multilabel_with_multi_hot_rows(table_file, make_config):
    from training.loading.batches import load_split

    rng = np.random.default_rng(2)
    tags = [sorted(set(rng.choice(["news", "sport", "tech"], size=rng.integers(0, 3)).tolist())) for _ in range(600)]
    path = table_file({"x": rng.normal(size=600), "tags": pa.array(tags, type=pa.list_(pa.string()))})
    prepared = prepare_dataset(make_config(path, label="tags"))
    manifest = prepared.manifest
    assert manifest.task == "multilabel" and manifest.label_mapping == ["news", "sport", "tech"]
    assert manifest.n_outputs == 3
    split = load_split(prepared.dataset_dir, manifest, "train")
    assert split.labels.dtype == torch.float32 and split.labels.shape == (manifest.rows("train"), 3)
    shards = pa.concat_tables([pq.read_table(p) for p in manifest.split_files(prepared.dataset_dir, "train")])
    expected = np.zeros((len(shards), 3), dtype=np.float32)
    for row, indices in enumerate(shards["tags"].to_pylist()):
        expected[row, indices] = 1
    assert np.array_equal(split.labels.numpy(), expected) and expected.sum(axis=1).max() == 2
    with_null = table_file({"x": np.zeros(3), "tags": pa.array([["a"], None, ["b"]])}, "null.parquet")
    with pytest.raises(DataError, match="label column 'tags' has 1 null"):
        prepare_dataset(make_config(with_null, label="tags"))


def test_the_kinds_config_names_are_the_kinds_the_registry_encodes():
    """The built-in kinds are listed once (config.INPUT_KINDS) and each has its record in the registry; a
    kind the registry does not hold is refused, naming the input and the known kinds."""
    from training.core.config import INPUT_KINDS
    from training.kinds.inputs import KINDS
    from training.kinds.registry import CODECS, kind_record, known_kinds

    built_in = [kind for kind, codec in CODECS.items() if codec.__module__.startswith("training.kinds.")]
    assert built_in == list(INPUT_KINDS) == list(KINDS) == known_kinds()[: len(INPUT_KINDS)]
    assert all(kind_record(kind).kind == kind for kind in INPUT_KINDS)
    with pytest.raises(ValueError, match="unknown input kind 'audio' .known: numeric, categorical"):
        kind_record("audio")


def test_the_inputs_are_described_by_kind_for_the_logs():
    from training.kinds.inputs import InputInfo, describe_inputs, numeric_input

    inputs = {
        "city": InputInfo("city", "categorical", "int64", cardinality=5),
        **{f"x{i}": numeric_input(f"x{i}") for i in range(7)},
        "shop": InputInfo("shop", "hashed", "int64", cardinality=101),
        "plan": InputInfo("plan", "categorical", "int64", cardinality=3),
    }
    assert describe_inputs(inputs) == "7 numeric, 2 categorical, 1 hashed"
    assert describe_inputs({}) == "no inputs"


def test_a_numeric_codec_imputes_the_train_mean_and_indicates_missing_values_fitted_on_train_only():
    """The imputed value is the mean of the TRAIN rows' non-null values (val/test rows never reach
    ``observe``), nulls and NaN alike are missing, inf is not, and the indicator exists only where the train
    split held a missing value; missing: error imputes nothing."""
    codec = make_codec("age", "numeric", {})
    codec.observe(pa.array([10, None, 30], type=pa.int64()))
    codec.observe(pa.array([20.0, np.nan]))
    state = codec.fit()
    assert state == {"impute": 20.0, "indicator": True, "rows": 5, "nulls": 2}
    served = pa.array([None, 5.0, np.nan, np.inf])
    np.testing.assert_array_equal(codec.encode(served), np.array([20.0, 5.0, 20.0, np.inf], dtype=np.float32))
    np.testing.assert_array_equal(codec.missing(served), np.array([1, 0, 1, 0], dtype=np.float32))
    assert codec.valid(served, "f").tolist() == [True, True, True, False]
    assert codec.info().missing_indicator
    clean = make_codec("x", "numeric", {})
    clean.observe(pa.array([1.0, 3.0]))
    assert clean.fit()["indicator"] is False and not clean.info().missing_indicator
    assert clean.encode(pa.array([None], type=pa.float64())).tolist() == [2.0]  # imputed, no indicator
    strict = make_codec("x", "numeric", {"missing": "error"})
    strict.observe(pa.array([1.0, None]))
    assert strict.fit()["indicator"] is False and strict.valid(pa.array([None, 1.0]), "f").tolist() == [False, True]
    assert np.isnan(strict.encode(pa.array([None], type=pa.float64()))).all()  # serving refuses it
    loaded = make_codec("age", "numeric", {})
    loaded.load(state)
    assert loaded.encode(served).tolist()[:3] == [20.0, 5.0, 20.0] and loaded.info().missing_indicator


def test_numeric_imputation_is_fitted_on_the_train_split_only(table_file, make_config, dh):
    """Prepared: encoders.json's imputed value is the median of the train split's non-null values (their mean
    under scaling: standard), not of all rows', and its null count is the train split's; the missing setting is
    part of the dataset's fingerprint."""
    rng = np.random.default_rng(1)
    rows = 3000
    value = rng.lognormal(0.0, 2.0, size=rows)  # skewed: the mean of any other subset differs
    value[::7] = np.nan
    table = pa.table({"id": np.arange(rows), "v": value, "label": rng.integers(0, 2, size=rows)})
    path = table_file(table)
    prepared = prepare_dataset(make_config(path, key="id", inputs={"v": "numeric"}))
    state = read_encoders(prepared.dataset_dir, prepared.manifest)["v"]["state"]
    train = dh.read_split(prepared, "train")["v"]
    assert state["nulls"] == train.null_count > 0 and state["rows"] == len(train) < rows
    train_values = train.to_numpy(zero_copy_only=False).astype(np.float64)
    assert state["impute"] == pytest.approx(np.nanmedian(train_values), rel=1e-6)
    assert state["impute"] != pytest.approx(np.nanmedian(value), rel=1e-3)  # not the whole source's
    assert prepared.manifest.n_features == 2  # v and its indicator
    standard = prepare_dataset(make_config(path, key="id", inputs={"v": {"kind": "numeric", "scaling": "standard"}}))
    state = read_encoders(standard.dataset_dir, standard.manifest)["v"]["state"]
    assert state["impute"] == pytest.approx(np.nanmean(train_values), rel=1e-6)
    assert state["impute"] != pytest.approx(np.nanmean(value), rel=1e-3)
    strict = prepare_dataset(
        make_config(path, key="id", inputs={"v": {"kind": "numeric", "missing": "error"}}, on_invalid="drop")
    )
    assert strict.fingerprint != prepared.fingerprint and strict.manifest.n_features == 1
    assert strict.manifest.dropped_rows == int(np.isnan(value).sum())
