"""Every kind of bad input: a DataError naming file, column and problem, and nothing that looks complete."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from training.core.config import ConfigError, load_config
from training.prepare.dataset import DataError, prepare_dataset


@pytest.fixture
def expect_error(make_config, dh):
    """Run prepare on ``source`` and return its DataError message, checking nothing complete was left."""

    def run(source, *fragments: str, **fields) -> str:
        config = make_config(source, **fields)
        with pytest.raises(DataError) as caught:
            prepare_dataset(config)
        message = str(caught.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        assert dh.nothing_complete(Path(config.root))
        return message

    return run


def test_missing_label_column(table_file, expect_error, dh):
    path = table_file(dh.numeric_table())
    expect_error(path, str(path), "'target'", "not found", label="target")


def test_missing_key_or_feature_column(table_file, expect_error, dh):
    path = table_file(dh.numeric_table())
    expect_error(path, "key column 'row_id'", "not found", key="row_id")
    expect_error(path, "feature column 'x9'", "not found", features=["x0", "x9"])


def test_non_numeric_feature(table_file, expect_error, dh):
    table = dh.numeric_table().append_column("city", pa.array(["oslo"] * dh.rows))
    path = table_file(table)
    expect_error(path, str(path), "feature column 'city'", "string", "numeric", features=["x0", "city"])


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, None], ids=["nan", "inf", "null"])
def test_invalid_feature_values_error_with_counts(table_file, expect_error, dh, bad_value):
    """inf always stops; null and NaN stop where the input says ``missing: error`` (today's stop, on request)."""
    x2 = dh.numeric_table()["x2"].to_pylist()
    for row in (5, 2000, 4999):  # spread over several read batches: the count covers all of them
        x2[row] = bad_value
    path = table_file(dh.numeric_table().set_column(3, "x2", pa.array(x2, type=pa.float64())))
    inputs = {"x0": "numeric", "x1": "numeric", "x2": {"kind": "numeric", "missing": "error"}}
    expect_error(path, str(path), "3 rows", "column 'x2': 3", "on_invalid=drop", inputs=inputs)
    if bad_value is np.inf:  # inf is not a missing value: it stops with the default too
        expect_error(path, str(path), "3 rows", "column 'x2': 3", "on_invalid=drop")


@pytest.mark.parametrize("bad_value", [np.nan, None], ids=["nan", "null"])
def test_nulls_in_numeric_inputs_are_values_by_default(table_file, make_config, dh, bad_value):
    """An int64 and a float input with nulls prepare by default: every row kept, the nulls counted in the
    prepare report and the histograms, each input given a missing indicator; a null label still stops."""
    table = dh.numeric_table()
    x2 = table["x2"].to_pylist()
    for row in (5, 2000, 4999):
        x2[row] = bad_value
    table = table.set_column(3, "x2", pa.array(x2, type=pa.float64()))
    counts = pa.array([None if i % 10 == 0 else v for i, v in enumerate(table["count"].to_pylist())], pa.int64())
    prepared = prepare_dataset(make_config(table_file(table.set_column(4, "count", counts))))
    manifest = prepared.manifest
    assert manifest.dropped_rows == 0 and sum(manifest.rows(split) for split in manifest.splits) == dh.rows
    rates = prepared.summary()["null_rates"]
    assert set(rates) == {"x2", "count"} and rates["count"] == pytest.approx(0.1, abs=0.02)
    indicators = {entry["name"] for entry in manifest.inputs if entry.get("missing_indicator")}
    assert indicators == {"x2", "count"} and manifest.n_features == len(manifest.features) + 2
    histograms = dict(zip(manifest.features, manifest.feature_histograms, strict=True))
    assert histograms["x0"]["nulls"] == 0
    assert histograms["count"]["nulls"] == round(rates["count"] * manifest.rows("train"))
    with_null_label = table.set_column(5, "label", pa.array([None] + table["label"].to_pylist()[1:]))
    with pytest.raises(DataError, match="label column 'label' has 1 null"):
        prepare_dataset(make_config(table_file(with_null_label, "null_label.parquet")))


def test_invalid_labels_error_with_counts(table_file, expect_error, dh):
    label = dh.numeric_table()["label"].to_pylist()
    label[7] = label[8] = None
    path = table_file(dh.numeric_table().set_column(5, "label", pa.array(label)), "null_label.parquet")
    expect_error(path, str(path), "label column 'label'", "2 null")
    target = np.linspace(0, 1, dh.rows)
    target[[1, 2, 3]] = np.nan
    path = table_file(dh.numeric_table().set_column(5, "label", pa.array(target)), "nan_label.parquet")
    expect_error(path, str(path), "label column 'label'", "3 NaN/inf")


def test_all_rows_dropped(table_file, expect_error, dh):
    table = dh.numeric_table(rows=100)
    path = table_file(table.set_column(1, "x0", pa.array([np.inf] * 100)))
    expect_error(path, "all 100 rows were dropped", on_invalid="drop")


def test_empty_source(tmp_path, table_file, expect_error, dh):
    path = table_file(dh.numeric_table().slice(0, 0), "empty.parquet")
    expect_error(path, "has no rows")
    header_only = tmp_path / "header.csv"
    header_only.write_text("x0,x1,label\n")
    expect_error(header_only, str(header_only), "label column 'label' holds no values")
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    expect_error(empty_dir, str(empty_dir), "no .parquet or .csv files")


def test_single_class(table_file, expect_error, dh):
    path = table_file(dh.numeric_table(classes=("only",)))
    expect_error(path, "label column 'label'", "single class", "'only'")


def test_corrupt_parquet_file(tmp_path, expect_error):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1" + b"\x00" * 100)
    expect_error(path, str(path), "cannot be read as parquet")


def test_corrupt_csv_file(tmp_path, expect_error):
    path = tmp_path / "ragged.csv"
    rows = "".join(
        f"{i},{i * 0.5},{i % 2}\n" for i in range(120_000)
    )  # > 1 MiB: past the block the schema is read from
    path.write_text("id,x,label\n" + rows + "1,2\n")  # a short row, found only while streaming
    expect_error(path, str(path), "cannot be read as csv", "Expected 3 columns")


def test_truncated_parquet_in_a_directory(tmp_path, table_file, expect_error, dh):
    table_file(dh.numeric_table(rows=1000), "a.parquet")
    good = table_file(dh.numeric_table(rows=1000, seed=1), "b.parquet")
    broken = good.with_name("c.parquet")
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    expect_error(good.parent, str(broken), "cannot be read as parquet")


def test_schemas_disagree(tmp_path, table_file, expect_error, dh):
    first = table_file(dh.numeric_table(rows=500), "a.parquet")
    second = table_file(dh.numeric_table(rows=500).drop_columns(["x2"]), "b.parquet")
    expect_error(first.parent, "schemas disagree", str(second), "lacks columns ['x2']", str(first))
    second.unlink()
    third = table_file(dh.numeric_table(rows=500).set_column(1, "x0", pa.array(["text"] * 500)), "c.parquet")
    expect_error(first.parent, "schemas disagree", "column 'x0'", str(first), str(third))


def test_numeric_widths_that_differ_are_widened(tmp_path, table_file, make_config, dh):
    table_file(dh.numeric_table(rows=500), "a.parquet")
    narrower = dh.numeric_table(rows=500, seed=1, start=500)
    narrower = narrower.set_column(4, "count", narrower["count"].cast(pa.int32()))
    table_file(narrower.set_column(1, "x0", narrower["x0"].cast(pa.float32())), "b.parquet")
    prepared = prepare_dataset(make_config(tmp_path / "src", key="id"))
    assert sum(prepared.summary()["rows"].values()) == 1000


def test_mixed_formats_in_a_directory(table_file, expect_error, dh):
    first = table_file(dh.numeric_table(rows=100), "a.parquet")
    table_file(dh.numeric_table(rows=100), "b.csv")
    expect_error(first.parent, "mixes csv and parquet")


def test_source_does_not_exist(tmp_path, expect_error):
    missing = tmp_path / "no" / "such.parquet"
    expect_error(missing, str(missing), "no such file")
    expect_error(f"{tmp_path}/*.parquet", "matches no files")


def test_bad_synthetic_spec(expect_error):
    expect_error("synthetic://classification?rows=10&features=2&colour=red", "unknown parameter 'colour'")
    expect_error("synthetic://clustering?rows=10", "synthetic://classification")


def test_split_fractions_must_leave_room_for_train():
    with pytest.raises(ConfigError, match=r"data: .*must sum to less than 1"):
        load_config(None, ["data.val_fraction=0.5", "data.test_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"data.val_fraction"):
        load_config(None, ["data.val_fraction=1.5"])


def test_a_file_changing_during_prepare_is_not_published(table_file, make_config, dh, monkeypatch):
    import training.prepare.dataset as prepare_module

    path = table_file(dh.numeric_table())
    real_build = prepare_module._build

    def build_then_touch(*args, **kwargs):
        manifest = real_build(*args, **kwargs)
        os.utime(path, ns=(1, 1))  # as if rewritten after it was read
        return manifest

    monkeypatch.setattr(prepare_module, "_build", build_then_touch)
    config = make_config(path)
    with pytest.raises(DataError, match=r"data.parquet: changed while it was being prepared"):
        prepare_dataset(config)
    assert dh.nothing_complete(Path(config.root))


# --- typed inputs (data.inputs): each bad input named by its column -----------------------------------------


def typed_table(dh, **columns) -> pa.Table:
    table = dh.numeric_table()
    for name, values in columns.items():
        table = table.append_column(name, values if isinstance(values, pa.Array) else pa.array(values))
    return table


def test_a_listed_input_that_is_missing(table_file, expect_error, dh):
    path = table_file(dh.numeric_table())
    expect_error(
        path, str(path), "input column 'city'", "data.inputs.city", "not found", inputs={"city": "categorical"}
    )


def test_a_kind_that_does_not_fit_the_column(table_file, expect_error, dh):
    path = table_file(typed_table(dh, city=["oslo"] * dh.rows))
    expect_error(
        path, "input column 'city'", "type string", "vector", "fits: categorical, hashed", inputs={"city": "vector"}
    )
    expect_error(path, "input column 'city'", "numeric", inputs={"city": "numeric"})
    expect_error(path, "input column 'x0'", "categorical", inputs={"x0": "categorical"})


def test_a_vector_of_another_length_errors_or_is_dropped_and_counted(table_file, expect_error, make_config, dh):
    vectors = [[1.0, 2.0, 3.0]] * dh.rows
    vectors[1234] = [1.0, 2.0]
    vectors[4321] = [1.0, 2.0, 3.0, 4.0]
    path = table_file(typed_table(dh, emb=pa.array(vectors)))
    expect_error(path, str(path), "vector column 'emb'", "length 3", "on_invalid=drop", inputs={"emb": "vector"})
    prepared = prepare_dataset(make_config(path, inputs={"emb": "vector", "x0": "numeric"}, on_invalid="drop"))
    assert prepared.manifest.dropped_rows == 2 and prepared.manifest.extra["invalid_per_column"] == {"emb": 2}
    assert sum(prepared.manifest.rows(split) for split in ("train", "val", "test")) == dh.rows - 2


def test_a_categorical_that_is_almost_all_unique_looks_like_an_id(table_file, expect_error, dh):
    path = table_file(typed_table(dh, user=[f"user-{i}" for i in range(dh.rows)]))
    message = expect_error(path, "'user'", "looks like an id", "hashed", inputs={"user": "categorical"})
    assert "data.inputs.user" in message


def test_an_integer_feature_beyond_float32s_exact_range_is_warned_about(table_file, make_config, dh):
    ids = np.arange(dh.rows, dtype=np.int64) + 2**24 + 1
    prepared = prepare_dataset(make_config(table_file(typed_table(dh, account=ids))))
    (warning,) = prepared.manifest.extra["warnings"]
    assert "'account'" in warning and "2^24" in warning and "categorical" in warning and "hashed" in warning


def test_ddpflow_run_says_a_data_error_once_without_a_traceback(tmp_path, table_file, dh, prefect_harness):
    """The whole command, as a user runs it: the error once, in a few lines; the trace in the log file.
    (Prefect's engines used to print it with two tracebacks, five times, in 77-95 lines.) --verbose keeps the
    console's records whole: tests/ddpflow/test_console.py."""
    from tests.flows.cli_runs import cli_env

    path = table_file(dh.numeric_table(rows=1000), "truncated.parquet")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    config = {
        "data": {"source": str(path), "root": str(tmp_path / "shards")},
        "train": {"nproc_per_node": 2, "backend": "gloo", "run_root": str(tmp_path / "runs")},
        "registry": {"model_name": "truncated-source"},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "truncated-source"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))

    argv = [sys.executable, "-m", "flows.cli", "run", "--config", "run.yaml"]
    env = cli_env(prefect_harness)
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {path}: cannot be read as parquet"), done.stderr
    assert len(lines) <= 15 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("cannot be read as parquet") == 1, done.stderr
    (log_file,) = re.findall(r"the full trace is in (\S+) \(or run with --verbose\)", done.stderr)
    log_text = Path(log_file).read_text()
    assert Path(log_file).parent == tmp_path / ".ddpflow" / "logs"
    assert "Traceback" in log_text and "DataError" in log_text, log_text[-3000:]
