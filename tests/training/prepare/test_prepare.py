"""prepare_dataset on real files: layout, manifest, counts, stats, labels, splits, cache."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.core.layout import SPLITS
from training.core.manifest import read_manifest
from training.prepare.dataset import prepare_dataset


def test_layout_and_manifest_fields(table_file, make_config, dh):
    source = table_file(dh.numeric_table())
    prepared = prepare_dataset(make_config(source, key="id"))
    directory = prepared.dataset_dir
    assert directory.name == prepared.fingerprint and directory.parent.name == "shards"
    assert not list(directory.parent.glob(".tmp-*"))
    manifest = read_manifest(directory)
    assert manifest == prepared.manifest
    raw = json.loads((directory / "manifest.json").read_text())
    for name in (
        "fingerprint",
        "source",
        "task",
        "label",
        "key",
        "features",
        "label_mapping",
        "feature_mean",
        "feature_std",
        "splits",
        "schema",
        "config",
        "created_at",
        "versions",
        "dropped_rows",
    ):
        assert name in raw, name
    assert manifest.features == ["x0", "x1", "x2", "count"]  # numeric, minus key and label, in source order
    assert manifest.task == "classification" and manifest.label_mapping == ["a", "b", "c"]
    assert manifest.schema == [
        {"name": "x0", "type": "double"},
        {"name": "x1", "type": "float"},
        {"name": "x2", "type": "double"},
        {"name": "count", "type": "int64"},
        {"name": "label", "type": "string"},
        {"name": "id", "type": "int64"},
    ]
    assert manifest.config["root"] == str(make_config(source).root)
    assert {"pyarrow", "numpy", "pandas"} <= set(manifest.versions)
    for split in SPLITS:
        for path in manifest.split_files(directory, split):
            assert path.is_file() and path.parent.name == split and path.name.startswith("part-")
            schema = pq.read_schema(path)
            assert schema.names == ["x0", "x1", "x2", "count", "label", "id"]
            assert [schema.field(name).type for name in manifest.features] == [pa.float32()] * 4
            assert schema.field("label").type == pa.int64()
    summary = prepared.summary()
    assert summary["rows"] == {split: manifest.rows(split) for split in SPLITS}
    assert summary["n_classes"] == 3 and summary["n_features"] == 4 and summary["cache_hit"] is False
    json.dumps(summary)  # the CLI prints it


def test_shard_and_row_counts(table_file, make_config, dh):
    prepared = prepare_dataset(make_config(table_file(dh.numeric_table()), rows_per_shard=1000, row_group_size=300))
    manifest = prepared.manifest
    assert sum(manifest.rows(split) for split in SPLITS) == dh.rows
    for split in SPLITS:
        info = manifest.splits[split]
        assert sum(shard.rows for shard in info.shards) == info.rows
        assert len(info.shards) == -(-info.rows // 1000)  # ceil: every shard full but the last
        for shard in info.shards:
            path = prepared.dataset_dir / shard.file
            metadata = pq.ParquetFile(path).metadata
            assert metadata.num_rows == shard.rows and path.stat().st_size == shard.bytes
            groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
            assert all(rows == 300 for rows in groups[:-1]) and groups[-1] <= 300
    # the 80/10/10 default, within sampling noise of 5000 rows
    assert 0.75 < manifest.rows("train") / dh.rows < 0.85


def test_union_of_splits_is_the_source(table_file, make_config, dh):
    source_table = dh.numeric_table()
    prepared = prepare_dataset(make_config(table_file(source_table), key="id"))
    splits = dh.read_all_splits(prepared)
    ids = {split: table["id"].to_pylist() for split, table in splits.items()}
    all_ids = sum(ids.values(), [])
    assert sorted(all_ids) == list(range(dh.rows))  # every row exactly once: no loss, no duplicate, no leak
    by_id = {row["id"]: row for row in source_table.to_pylist()}
    mapping = prepared.manifest.label_mapping
    for row in splits["test"].to_pylist()[:200]:
        original = by_id[row["id"]]
        assert mapping[row["label"]] == original["label"]
        assert row["x0"] == pytest.approx(original["x0"], rel=1e-6) and row["count"] == original["count"]


def test_union_without_key_compares_sorted_rows(table_file, make_config, dh):
    source_table = dh.numeric_table().drop_columns(["id"])
    prepared = prepare_dataset(make_config(table_file(source_table)))
    union = pa.concat_tables(dh.read_all_splits(prepared).values())
    features = prepared.manifest.features
    got = np.column_stack([union[name].to_numpy() for name in features])
    want = np.column_stack([source_table[name].to_numpy().astype(np.float32) for name in features])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))


def test_train_stats_match_numpy(table_file, make_config, dh):
    table = dh.numeric_table()
    table = table.append_column("constant", pa.array(np.full(dh.rows, 7.0)))
    prepared = prepare_dataset(make_config(table_file(table)))
    train = dh.read_split(prepared, "train")
    matrix = np.column_stack([train[name].to_numpy().astype(np.float64) for name in prepared.manifest.features])
    np.testing.assert_allclose(prepared.manifest.feature_mean, matrix.mean(axis=0), rtol=1e-10, atol=1e-12)
    expected_std = matrix.std(axis=0)
    expected_std[expected_std == 0] = 1.0
    np.testing.assert_allclose(prepared.manifest.feature_std, expected_std, rtol=1e-9)
    assert prepared.manifest.feature_std[prepared.manifest.features.index("constant")] == 1.0


def test_cache_hit_then_miss_after_source_changes(table_file, make_config, dh):
    path = table_file(dh.numeric_table())
    config = make_config(path)
    first = prepare_dataset(config)
    second = prepare_dataset(config)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.dataset_dir == first.dataset_dir and second.manifest == first.manifest
    # a different root or read batch does not change the output, hence not the fingerprint
    assert prepare_dataset(config.model_copy(update={"read_batch_rows": 999})).cache_hit
    assert prepare_dataset(config.model_copy(update={"val_fraction": 0.2})).fingerprint != first.fingerprint
    # same path, new content
    pq.write_table(dh.numeric_table(rows=3000, seed=1), path)
    os.utime(path, ns=(1, 1))  # and an mtime that cannot collide with the first write
    third = prepare_dataset(config)
    assert not third.cache_hit and third.fingerprint != first.fingerprint
    assert sum(third.manifest.rows(split) for split in SPLITS) == 3000
    assert first.dataset_dir.is_dir()  # the old dataset stays for runs that used it


def test_half_written_directory_is_not_taken_as_complete(table_file, make_config, dh):
    config = make_config(table_file(dh.numeric_table()))
    fingerprint = prepare_dataset(config).fingerprint
    dataset_dir = prepare_dataset(config).dataset_dir
    (dataset_dir / "manifest.json").unlink()  # as if a crash had left it half-written
    (dataset_dir / "train" / "part-00000.parquet").write_bytes(b"truncated")
    stale_temp = dataset_dir.parent / f".tmp-{fingerprint}-deadbeef"
    stale_temp.mkdir()
    (stale_temp / ".owner").write_text(f"{os.uname().nodename} 999999999\n")  # a pid that cannot be alive
    redone = prepare_dataset(config)
    assert not redone.cache_hit and redone.dataset_dir == dataset_dir
    assert pq.read_table(dataset_dir / "train" / "part-00000.parquet").num_rows > 0
    assert not stale_temp.exists()


def test_rows_keep_their_split_when_rows_are_appended(tmp_path, table_file, make_config, dh):
    old = dh.numeric_table(rows=3000, seed=0, start=0)
    new = dh.numeric_table(rows=2000, seed=1, start=3000)
    for key in ("id", None):  # by key, and by content when there is no key
        old_source = table_file(old if key else old.drop_columns(["id"]), name="old.parquet")
        both = pa.concat_tables([old, new]) if key else pa.concat_tables([old, new]).drop_columns(["id"])
        grown_source = table_file(both, name="grown.parquet")
        before = dh.read_all_splits(prepare_dataset(make_config(old_source, key=key)))
        after = dh.read_all_splits(prepare_dataset(make_config(grown_source, key=key)))
        identity = (lambda table: table["id"].to_pylist()) if key else (lambda table: table["x0"].to_pylist())
        where_before = {value: split for split, table in before.items() for value in identity(table)}
        where_after = {value: split for split, table in after.items() for value in identity(table)}
        assert len(where_before) == 3000 and len(where_after) == 5000
        moved = [value for value, split in where_before.items() if where_after[value] != split]
        assert moved == [], f"key={key}: {len(moved)} old rows changed split"


def test_split_is_the_same_from_csv_and_parquet(table_file, make_config, dh):
    table = dh.numeric_table(rows=2000).drop_columns(["x1"])  # CSV holds float64 text exactly
    from_parquet = dh.read_all_splits(prepare_dataset(make_config(table_file(table, "d.parquet"), key="id")))
    from_csv = dh.read_all_splits(prepare_dataset(make_config(table_file(table, "d.csv"), key="id")))
    for split in SPLITS:
        assert from_csv[split]["id"].to_pylist() == from_parquet[split]["id"].to_pylist()


def test_directory_and_glob_sources_read_every_file(tmp_path, table_file, make_config, dh):
    for part in range(3):
        table_file(dh.numeric_table(rows=1000, seed=part, start=1000 * part), name=f"part-{part}.parquet")
    (tmp_path / "src" / "_SUCCESS").write_text("")  # marker files are skipped
    for source in (tmp_path / "src", f"{tmp_path}/src/part-*.parquet"):
        prepared = prepare_dataset(make_config(source, key="id"))
        ids = sorted(sum((table["id"].to_pylist() for table in dh.read_all_splits(prepared).values()), []))
        assert ids == list(range(3000))
        assert len(prepared.manifest.extra["source_identity"]["files"]) == 3


def test_integer_labels_map_through_sorted_values(table_file, make_config, dh):
    rng = np.random.default_rng(3)
    labels = rng.choice([10, -3, 7], size=dh.rows)
    table = dh.numeric_table().set_column(5, "label", pa.array(labels))
    prepared = prepare_dataset(make_config(table_file(table), key="id"))
    assert prepared.manifest.label_mapping == [-3, 7, 10]
    for split_table in dh.read_all_splits(prepared).values():
        indices = split_table["label"].to_numpy()
        originals = dict(zip(table["id"].to_pylist(), labels.tolist()))
        assert [prepared.manifest.label_mapping[i] for i in indices] == [
            originals[i] for i in split_table["id"].to_pylist()
        ]


def test_categorical_string_view_and_bool_labels(table_file, make_config, dh):
    table = dh.numeric_table(rows=1000)
    categorical = table.set_column(5, "label", pc_dictionary(table["label"]))
    assert prepare_dataset(make_config(table_file(categorical, "cat.parquet"))).manifest.label_mapping == [
        "a",
        "b",
        "c",
    ]
    views = table.set_column(5, "label", table["label"].cast(pa.string_view()))
    assert prepare_dataset(make_config(table_file(views, "view.parquet"))).manifest.label_mapping == ["a", "b", "c"]
    flags = table.set_column(5, "label", pa.array(np.arange(1000) % 3 == 0))
    prepared = prepare_dataset(make_config(table_file(flags, "bool.parquet")))
    assert prepared.manifest.task == "classification" and prepared.manifest.label_mapping == [False, True]


def pc_dictionary(column):
    import pyarrow.compute as pc

    return pc.dictionary_encode(column)


def test_float_label_means_regression(table_file, make_config, dh):
    table = dh.numeric_table().set_column(5, "label", pa.array(np.linspace(0, 1, dh.rows)))
    prepared = prepare_dataset(make_config(table_file(table)))
    assert prepared.manifest.task == "regression" and prepared.manifest.label_mapping is None
    assert prepared.manifest.n_outputs == 1
    assert dh.read_split(prepared, "train").schema.field("label").type == pa.float32()
    forced = prepare_dataset(
        make_config(
            table_file(dh.numeric_table().set_column(5, "label", pa.array(np.arange(dh.rows) % 2)), "int.parquet"),
            task="regression",
        )
    )
    assert forced.manifest.task == "regression"


def test_an_integer_label_with_many_values_is_a_number_to_predict(table_file, make_config, dh):
    """Prices as int64 are a number to predict, not thousands of classes, without data.task. An integer
    label with more than INTEGER_CLASSES_MAX distinct values is inferred as regression (the dataset data.task:
    regression prepares, fingerprint included); few values stay classes (the fingerprint of data.task unset);
    data.task wins."""
    from training.prepare.columns import INTEGER_CLASSES_MAX
    from training.prepare.dataset import fingerprint_from_listing

    prices = np.random.default_rng(0).integers(1_000, 900_000, size=dh.rows).astype(np.int64)
    priced = table_file(dh.numeric_table().set_column(5, "label", pa.array(prices)), "prices.parquet")
    inferred = prepare_dataset(make_config(priced))
    assert inferred.manifest.task == "regression" and inferred.manifest.label_mapping is None
    line = inferred.summary()["task_inferred"]
    assert f"more than {INTEGER_CLASSES_MAX} distinct values" in line and "data.task: classification" in line
    declared = prepare_dataset(make_config(priced, task="regression"))
    assert declared.fingerprint == inferred.fingerprint and declared.cache_hit, "the same dataset"
    assert declared.summary()["task_inferred"] == line  # the cached manifest, prepared as inferred
    forced = prepare_dataset(make_config(priced, task="classification", on_invalid="drop"))
    assert forced.manifest.task == "classification" and len(forced.manifest.label_mapping) > INTEGER_CLASSES_MAX

    few = dh.numeric_table().set_column(5, "label", pa.array(np.arange(dh.rows) % INTEGER_CLASSES_MAX))
    data = make_config(table_file(few, "few.parquet"))
    classes = prepare_dataset(data)
    assert classes.manifest.task == "classification" and len(classes.manifest.label_mapping) == INTEGER_CLASSES_MAX
    assert f"holds {INTEGER_CLASSES_MAX} distinct values" in classes.summary()["task_inferred"]
    assert classes.fingerprint == fingerprint_from_listing(data)[1]  # the fingerprint of data.task unset
    assert (
        "(data.task)"
        in prepare_dataset(make_config(priced, task="regression", val_fraction=0.2)).summary()["task_inferred"]
    )


def test_explicit_features_and_key(table_file, make_config, dh):
    prepared = prepare_dataset(make_config(table_file(dh.numeric_table()), features=["x2", "x0"], key="id"))
    assert prepared.manifest.features == ["x2", "x0"]
    assert dh.read_split(prepared, "val").column_names == ["x2", "x0", "label", "id"]


def test_drop_invalid_rows_records_dropped_rows(table_file, make_config, dh):
    table = dh.numeric_table()
    x0 = table["x0"].to_numpy().copy()
    x0[:10] = np.nan
    x0[10:15] = np.inf
    label = table["label"].to_pylist()
    label[20:23] = [None] * 3
    table = table.set_column(1, "x0", pa.array(x0)).set_column(5, "label", pa.array(label))
    path = table_file(table)
    # NaN in a numeric input is a missing value (imputed, kept); inf and a null label are invalid.
    prepared = prepare_dataset(make_config(path, key="id", on_invalid="drop"))
    assert prepared.manifest.dropped_rows == 8 and prepared.summary()["dropped_rows"] == 8
    assert prepared.manifest.extra["invalid_per_column"] == {"x0": 5, "label": 3}
    assert prepared.manifest.extra["null_rates"]["x0"] > 0
    # With missing: error, NaN is invalid too: dropped with the rest.
    inputs = {"x0": {"kind": "numeric", "missing": "error"}, "x1": "numeric"}
    prepared = prepare_dataset(make_config(path, key="id", on_invalid="drop", inputs=inputs))
    assert prepared.manifest.dropped_rows == 18 and prepared.summary()["dropped_rows"] == 18
    assert prepared.manifest.extra["invalid_per_column"] == {"x0": 15, "label": 3}
    kept = sorted(sum((t["id"].to_pylist() for t in dh.read_all_splits(prepared).values()), []))
    assert kept == [i for i in range(dh.rows) if not (i < 15 or 20 <= i < 23)]


def test_empty_val_split_still_gets_a_readable_shard(table_file, make_config, dh):
    prepared = prepare_dataset(make_config(table_file(dh.numeric_table(rows=500)), key="id", val_fraction=0.0))
    assert prepared.manifest.rows("val") == 0
    (shard,) = prepared.manifest.split_files(prepared.dataset_dir, "val")
    assert pq.read_table(shard).num_rows == 0 and pq.read_schema(shard).names[:4] == ["x0", "x1", "x2", "count"]


def test_synthetic_source_is_learnable_and_balanced(make_config):
    prepared = prepare_dataset(make_config("synthetic://classification?rows=5000&features=8&classes=3&seed=1"))
    manifest = prepared.manifest
    assert manifest.features == [f"f{i}" for i in range(8)] and manifest.label_mapping == [0, 1, 2]
    train = pa.concat_tables([pq.read_table(f) for f in manifest.split_files(prepared.dataset_dir, "train")])
    test = pa.concat_tables([pq.read_table(f) for f in manifest.split_files(prepared.dataset_dir, "test")])
    counts = Counter(train["label"].to_pylist())
    assert min(counts.values()) > 0.1 * train.num_rows  # no class is vanishingly rare

    # learnable: a least-squares linear classifier on normalised features beats chance by far
    def design(table):
        x = np.column_stack([table[f].to_numpy() for f in manifest.features])
        x = (x - manifest.feature_mean) / manifest.feature_std
        return np.column_stack([x, np.ones(len(x))])

    targets = np.eye(3)[train["label"].to_numpy()]
    weights, *_ = np.linalg.lstsq(design(train), targets, rcond=None)
    accuracy = (design(test) @ weights).argmax(axis=1) == test["label"].to_numpy()
    assert accuracy.mean() > 0.7


def test_output_root_inside_the_source_directory_is_not_read_back(tmp_path, table_file, make_config, dh):
    path = table_file(dh.numeric_table())
    config = make_config(path.parent, key="id", root=str(path.parent / "shards"))
    first = prepare_dataset(config)
    (path.parent / "_temporary").mkdir()
    pq.write_table(dh.numeric_table(rows=10), path.parent / "_temporary" / "half.parquet")  # a writer's scratch dir
    again = prepare_dataset(config)  # the shards and scratch files now sit under the source directory
    assert again.cache_hit and again.fingerprint == first.fingerprint
    assert len(again.manifest.extra["source_identity"]["files"]) == 1


def test_a_damaged_cached_dataset_is_rebuilt(table_file, make_config, dh):
    config = make_config(table_file(dh.numeric_table()))
    first = prepare_dataset(config)
    shard = first.manifest.split_files(first.dataset_dir, "train")[0]
    shard.unlink()  # someone cleaned up by hand
    rebuilt = prepare_dataset(config)
    assert not rebuilt.cache_hit and rebuilt.dataset_dir == first.dataset_dir and shard.is_file()
    (first.dataset_dir / "manifest.json").write_text("{not json")
    assert not prepare_dataset(config).cache_hit
    assert prepare_dataset(config).cache_hit
    assert not list(first.dataset_dir.parent.glob(".tmp-*"))
