"""The time split (``data.split: {by: time}``, training/prepare/time_split.py) through the real prepare stage: the
newest rows go to test and the ones before them to val, by fractions of the rows or by cut-off dates; the rule and
its cut-offs in the manifest and the fingerprint; rows added later land in the newest split; a hash split keeps
the fingerprint it had before ``data.split`` existed; bad input is one clear error naming the file and column."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from training.core.config import ConfigError, load_config
from training.core.errors import DataError
from training.prepare.dataset import prepare_dataset
from training.prepare.fingerprint import dataset_fingerprint

OSLO = "Europe/Oslo"
INPUTS = "data.inputs={when: datetime, x: numeric}"  # the split column is an input too (it need not be)


def events(rows: int, start: str = "2024-01-01", seed: int = 0) -> pd.DataFrame:
    """A table whose rows are in no time order (as files often are), one event every 5 hours from ``start``."""
    rng = np.random.default_rng(seed)
    when = pd.Series(pd.date_range(start, periods=rows, freq="5h", tz=OSLO))
    frame = pd.DataFrame({"when": when, "x": rng.normal(size=rows), "y": rng.integers(0, 2, rows)})
    return frame.sample(frac=1.0, random_state=seed).reset_index(drop=True)


def prepare(tmp_path, frame: pd.DataFrame, *settings: str, name: str = "events.parquet"):
    """``frame`` written as a file of ``tmp_path / "source"`` (beside any already there), that folder prepared."""
    source = tmp_path / "source"
    source.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pacsv.write_csv(table, source / name) if name.endswith(".csv") else pq.write_table(table, source / name)
    base = [f"data.source={source}", f"data.root={tmp_path / 'shards'}", "data.label=y", INPUTS]
    return prepare_dataset(load_config(None, [*base, *settings]).data)


def times(prepared, split: str) -> pd.Series:
    paths = prepared.manifest.split_files(prepared.dataset_dir, split)
    return pd.concat([pq.read_table(path).to_pandas()["when"] for path in paths]) if paths else pd.Series([])


def test_fractions_put_the_newest_rows_in_test_and_those_before_them_in_val(tmp_path):
    prepared = prepare(tmp_path, events(1000), "data.split={by: time, column: when, val: 0.2, test: 0.1}")
    rows = {split: prepared.manifest.rows(split) for split in ("train", "val", "test")}
    assert rows == {"train": 700, "val": 200, "test": 100}
    train, val, test = times(prepared, "train"), times(prepared, "val"), times(prepared, "test")
    assert train.max() < val.min() and val.max() < test.min()  # judged on the rows after those it learnt from
    rule = prepared.manifest.extra["split"]
    assert rule == {
        "by": "time", "column": "when", "val": 0.2, "test": 0.1, "zone": OSLO,
        "val_from": str(val.min().tz_localize(None).to_datetime64().astype("datetime64[us]")),
        "test_from": str(test.min().tz_localize(None).to_datetime64().astype("datetime64[us]")),
    }  # fmt: skip
    assert prepared.summary()["split"] == rule and prepared.manifest.config["split"]["by"] == "time"
    # Unset, val and test are data.val_fraction and data.test_fraction.
    default = prepare(tmp_path, events(1000), "data.split={by: time, column: when}", "data.val_fraction=0.3")
    assert [default.manifest.rows(split) for split in ("train", "val", "test")] == [600, 300, 100]


def test_cut_off_dates_are_read_on_the_columns_clock_and_rows_added_later_land_in_test(tmp_path):
    rule = "data.split={by: time, column: when, val: 2024-03-01, test: '2024-03-15T00:00:00+00:00'}"
    first = prepare(tmp_path, events(500), rule)
    val, test = times(first, "val"), times(first, "test")
    assert val.min() >= pd.Timestamp("2024-03-01", tz=OSLO) > times(first, "train").max()
    assert test.min() >= pd.Timestamp("2024-03-15T01:00", tz=OSLO) > val.max()  # midnight UTC is 01:00 in Oslo
    extra = first.manifest.extra["split"]
    assert (extra["val_from"], extra["test_from"]) == ("2024-03-01T00:00:00.000000", "2024-03-15T01:00:00.000000")
    # A later night's file of newer rows: a new dataset, the old rows where they were, the new ones in test.
    later = events(40, start="2024-05-01", seed=1)
    second = prepare(tmp_path, later, rule, name="later.parquet")
    assert second.fingerprint != first.fingerprint
    assert second.manifest.rows("test") == first.manifest.rows("test") + 40
    for split in ("train", "val"):
        assert second.manifest.rows(split) == first.manifest.rows(split)
    # With fractions the cut-offs move with the data: the new rows, the newest, are in test all the same.
    fractions = "data.split={by: time, column: when, test: 0.1}"
    grown = prepare(tmp_path / "grown", events(500), fractions)
    regrown = prepare(tmp_path / "grown", later, fractions, name="later.parquet")
    assert set(later["when"]) <= set(times(regrown, "test")) and grown.manifest.rows("test") == 50


def test_a_hash_split_keeps_its_fingerprint():
    """A hash split, said or not, hashes as a config without data.split (these fingerprints are PREPARE_VERSION
    7's): no hash-split dataset is prepared again for it."""
    identity = {"kind": "files", "files": [["a.parquet", 10, "1"]]}
    before = {
        (): "4c546dc352950ebc",
        ("data.inputs={x: numeric, c: categorical}", "data.key=id"): "ed0f2ffe52191d85",
        ("data.val_fraction=0.2",): "8d397bc531cf38e9",
        ("data.split={by: hash}",): "4c546dc352950ebc",  # the default, said out loud
    }
    for overrides, fingerprint in before.items():
        assert dataset_fingerprint(identity, load_config(None, list(overrides)).data) == fingerprint, overrides
    rules = ("{by: time, column: t}", "{by: time, column: t, test: 0.2}", "{by: time, column: u}")
    by_time = [dataset_fingerprint(identity, load_config(None, [f"data.split={rule}"]).data) for rule in rules]
    assert len(set(by_time) | set(before.values())) == len(by_time) + 3  # each rule its own dataset


NULL_AT_7 = events(50).assign(when=lambda frame: frame["when"].where(frame.index != 7))
TEXT_LATER = events(50).assign(when=lambda frame: frame["when"].astype(str).where(frame.index != 3, "later"))
BAD_INPUT = [
    (events(50), "{by: time, column: stamp}", r"split column 'stamp' \(data.split.column\) not found"),
    (events(50), "{by: time, column: x}", r"split column 'x' \(data.split.column\) has type double, not a time"),
    (NULL_AT_7, "{by: time, column: when}", r"events.parquet: split column 'when' \(data.split.column\) holds 1 null"),
    (NULL_AT_7, "{by: time, column: when, val: 2024-01-02, test: 2024-01-05}", r"events.parquet: .* holds 1 null"),
    (TEXT_LATER, "{by: time, column: when}", r"events.parquet: split column 'when' .* holds 'later', not an ISO"),
    (events(50), "{by: time, column: when, val: 2024-03-01, test: 2024-02-01}",
     r"data.split.val '2024-03-01' is after the test cut-off 2024-02-01T00:00:00"),
    (events(50), "{by: time, column: when, val: 2020-01-01, test: 2030-01-01}",
     r"the train split is empty .*data.split by time on 'when': val from 2020-01-01"),
]  # fmt: skip


@pytest.mark.parametrize(("frame", "rule", "message"), BAD_INPUT)
def test_bad_input_is_one_error_naming_the_file_and_column(tmp_path, frame, rule, message):
    with pytest.raises(DataError, match=message):
        prepare(tmp_path, frame, f"data.split={rule}")


def test_a_bad_rule_is_refused_before_anything_is_read():
    for rule, message in [
        ("{by: time}", "by: time needs column"),
        ("{by: hash, test: 0.2}", "by: hash takes no column, val or test"),
        ("{by: time, column: t, test: next week}", "data.split.test: 'next week' is neither a fraction"),
        ("{by: time, column: t, val: 1.5}", "a fraction of the rows is at least 0 and below 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"data.split={rule}"])


def test_ddpflow_prepare_says_a_missing_split_column_in_one_line(repo_root, tmp_path):
    prepare(tmp_path, events(50), "data.split={by: time, column: when}")  # the source written
    env = {**os.environ, "PYTHONPATH": str(repo_root), "PREFECT_HOME": str(tmp_path / "prefect")}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "prepare", "--set", f"data.source={tmp_path / 'source'}", "--set",
         f"data.root={tmp_path / 'shards'}", "--set", "data.label=y", "--set", "data.split={by: time, column: day}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "split column 'day' (data.split.column) not found" in last and str(tmp_path / "source") in last, last
