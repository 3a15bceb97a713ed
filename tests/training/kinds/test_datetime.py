"""The datetime kind (training/kinds/times.py) without ranks: a time read on the wall clock of the train column's
zone whatever form it comes in (zoned, naive, a date, ISO text with or without an offset), its features, nulls as
values, a string that is not a time refused; prepared from Parquet and CSV as the source has it; its drift; the
reference's columns; and a model trained in process on it scoring raw rows (pandas and Arrow, as read back from
the source) as its evaluation scored them. The served pyfunc, over HTTP too, and a time split: tests/flows/
test_dates.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from ddpflow.drift.report import compare
from tests.manifest_datasets import train_typed_model
from training.core.config import load_config
from training.core.errors import DataError
from training.core.manifest import read_manifest
from training.inference.baselines import evaluate_baselines
from training.inference.evaluate import evaluate_split
from training.inference.predict import Predictor
from training.inference.scored_drift import DriftTally
from training.kinds.inputs import inputs_from_manifest
from training.kinds.registry import codecs_for, read_encoders
from training.kinds.times import DatetimeCodec
from training.prepare.dataset import prepare_dataset

OSLO = "Europe/Oslo"


def features(codec: DatetimeCodec, values) -> np.ndarray:
    return codec.encode(values if isinstance(values, pa.Array) else pa.array(values))


def test_a_time_is_read_on_the_wall_clock_of_the_train_columns_zone():
    train = pd.Series(pd.to_datetime(["2024-01-01 09:00", "2024-07-01 09:00", None, "2024-12-31 21:30"]))
    codec = DatetimeCodec("when")
    codec.observe(pa.array(train.dt.tz_localize(OSLO)))
    state = codec.fit()
    assert state["zone"] == OSLO and state["indicator"] and state["nulls"] == 1
    assert codec.shape() == (10,)  # 4 cycles x (sin, cos), the time since the origin, the missing indicator
    zoned = features(codec, pa.array(train.dt.tz_localize(OSLO)))
    # The same instants, in every form a served row or a source brings them: the same features.
    same = {
        "UTC timestamps": pa.array(train.dt.tz_localize(OSLO).dt.tz_convert("UTC")),
        "naive wall-clock times": pa.array(train),
        "ISO text with Z": ["2024-01-01T08:00:00Z", "2024-07-01T07:00:00Z", None, "2024-12-31T20:30:00Z"],
        "ISO text with offsets": ["2024-01-01T09:00:00+01:00", "2024-07-01 09:00+02:00", None, "2024-12-31T21:30+0100"],
        "ISO text on the wall clock": ["2024-01-01T09:00:00", "2024-07-01T09:00", None, "2024-12-31 21:30:00"],
    }
    for form, values in same.items():
        np.testing.assert_allclose(features(codec, values), zoned, atol=1e-6, err_msg=form)
    hour, weekday, day, month, time, missing = (zoned[:, k] for k in (slice(0, 2), slice(2, 4), slice(4, 6),
                                                                       slice(6, 8), 8, 9))  # fmt: skip
    circle = 2 * np.pi
    np.testing.assert_allclose(hour[0], [np.sin(circle * 9 / 24), np.cos(circle * 9 / 24)], atol=1e-6)
    np.testing.assert_allclose(hour[3], [np.sin(circle * 21.5 / 24), np.cos(circle * 21.5 / 24)], atol=1e-6)
    monday_nine = (0 + 9 / 24) / 7  # 2024-01-01 was a Monday, the week's start
    np.testing.assert_allclose(weekday[0], [np.sin(circle * monday_nine), np.cos(circle * monday_nine)], atol=1e-6)
    np.testing.assert_allclose(month[:, 1], [1.0, -1.0, 0.0, np.cos(circle * 11 / 12)], atol=1e-6)  # Jan, Jul
    assert abs(day[3, 0]) < 0.02 and day[3, 1] > 0.99  # New Year's Eve sits next to January on the circle
    assert time[0] == 0.0 and time[3] == pytest.approx(1.0)  # the train split's earliest and latest
    # A null: the circle's centre, the train mean time, the indicator.
    np.testing.assert_array_equal(zoned[2, :8], 0.0)
    assert time[2] == pytest.approx(np.mean([0.0, time[1], 1.0]), abs=1e-6) and list(missing) == [0, 0, 1, 0]
    with pytest.raises(ValueError, match=r"'when' holds 'soon' \(row 1.*not an ISO-8601 date or time"):
        features(codec, ["2024-01-01", "soon"])
    with pytest.raises(ValueError, match="holds int64 values; a datetime input takes timestamps"):
        features(codec, pa.array([1704099600], pa.int64()))


def test_a_date_column_has_no_time_of_day_and_no_nulls_no_indicator():
    codec = DatetimeCodec("day")
    dates = pa.array(pd.to_datetime(["2024-03-01", "2024-03-02"]).date, pa.date32())
    codec.observe(dates)
    codec.fit()
    assert codec.cycles == ("day_of_week", "day_of_year", "month") and codec.shape() == (7,)
    np.testing.assert_allclose(features(codec, ["2024-03-02"]), features(codec, dates)[1:], atol=1e-6)


def timetable(rows: int = 600, seed: int = 0, hour_shift: int = 0) -> pd.DataFrame:
    """Rows of a shop's orders: ``late`` is 1 at night (the zone's own 22:00-06:00), which only the order time
    says; a date and an ISO-text copy of the time beside it; a few nulls in the time."""
    rng = np.random.default_rng(seed)
    days = pd.Timestamp("2024-01-01", tz=OSLO) + pd.to_timedelta(rng.integers(0, 300, rows), unit="D")
    # Most orders around midday, a third at any time: the hours are far from uniform (what drift would see move).
    minutes = np.where(rng.random(rows) < 0.65, rng.normal(13 * 60, 150, rows), rng.uniform(0, 24 * 60, rows))
    minutes = np.mod(minutes + hour_shift * 60, 24 * 60).astype(np.int64)
    when = pd.Series(days + pd.to_timedelta(minutes, unit="min"))
    hour = when.dt.hour
    when[rng.random(rows) < 0.03] = pd.NaT
    return pd.DataFrame(
        {
            "order_id": np.arange(rows, dtype=np.int64),
            "when": when,
            "day": when.dt.tz_localize(None).dt.date,
            "text": when.dt.strftime("%Y-%m-%dT%H:%M:%S%z").where(when.notna(), None),
            "basket": rng.gamma(2.0, 20.0, rows),
            "late": ((hour >= 22) | (hour < 6)).astype(np.int64),
        }
    )


def prepare(root: Path, frame: pd.DataFrame, *settings: str, name: str = "orders.parquet"):
    source = root / name
    if name.endswith(".csv"):
        pacsv.write_csv(pa.Table.from_pandas(frame, preserve_index=False), source)
    else:
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), source)
    overrides = [f"data.source={source}", f"data.root={root / 'shards'}", "data.label=late", "data.key=order_id"]
    return prepare_dataset(load_config(None, [*overrides, *settings]).data)


INPUTS = "data.inputs={when: datetime, day: datetime, basket: numeric}"


def test_prepare_takes_times_as_parquet_and_csv_hold_them(tmp_path):
    frame = timetable()
    parquet = prepare(tmp_path, frame, INPUTS)
    schema = {column["name"]: column["type"] for column in parquet.manifest.schema}
    assert schema["when"] == "timestamp[us, tz=Europe/Oslo]" and schema["day"] == "date32[day]"
    shapes = {entry["name"]: entry["shape"] for entry in parquet.manifest.inputs}
    assert shapes == {"when": [10], "day": [8], "basket": []}  # the date: no time of day; both held nulls
    encoders = json.loads((parquet.dataset_dir / "encoders.json").read_text())
    assert encoders["when"]["state"]["zone"] == OSLO and encoders["day"]["state"]["zone"] is None
    # Without data.inputs, prepare names the time columns it left out and the entry that takes them.
    plain = prepare(tmp_path, frame)
    suggested = {entry["column"]: entry["suggest"] for entry in plain.manifest.extra["left_out"]}
    assert suggested == {"when": "datetime", "day": "datetime", "text": "datetime"}

    # CSV: pyarrow reads ISO text with offsets as UTC timestamps, and a column holding one bad value as strings.
    text = frame.assign(when=frame["text"])
    text.loc[5, "when"] = "2024-02-30T10:00:00+01:00"  # no such day
    with pytest.raises(DataError, match=r"orders\.csv: datetime column 'when' holds '2024-02-30T10:00:00\+01:00'"):
        prepare(tmp_path, text, INPUTS, name="orders.csv")
    dropped = prepare(tmp_path, text, INPUTS, "data.on_invalid=drop", name="orders.csv")
    assert dropped.manifest.dropped_rows == 1 and dropped.manifest.extra["invalid_per_column"] == {"when": 1}
    read = prepare(tmp_path, frame.assign(when=frame["text"]), INPUTS, name="clean.csv")
    assert {column["name"]: column["type"] for column in read.manifest.schema}["when"] == "timestamp[s, tz=UTC]"


def test_the_time_since_the_start_goes_through_the_mlps_numeric_embeddings(tmp_path):
    """Each datetime input's time since the start carries the train split's quantiles as bins (scaled: the train
    split spans 0..1) and the mlp embeds it as it embeds a numeric input: the stem holds it after the numeric
    inputs, its raw column leaves the dense block, and its piecewise-linear steps move the output. A datetime state
    without edges (prepared before them) and the column a time split is by keep the time as one dense number."""
    import torch

    from training.models.numeric_embeddings import DEFAULT_DIM
    from training.models.tabular import MLP

    prepared = prepare(tmp_path, timetable(), INPUTS)
    inputs = inputs_from_manifest(prepared.manifest)
    when, day = inputs["when"], inputs["day"]
    assert (when.bins_column, day.bins_column) == (8, 6)  # after the cycles' pairs: 4 with the hour, 3 for a date
    for info in (when, day):
        assert len(info.bins) > 40 and info.bins[0] == 0.0 and info.bins[-1] == 1.0
        assert all(b > a for a, b in zip(info.bins, info.bins[1:])), info.name
    torch.manual_seed(0)
    model = MLP(inputs, 2)
    assert model.numeric_embeddings.weight.shape[0] == 3  # basket, then the two times
    # Each time's embedding replaces its one scaled number; the cycles and the missing indicator stay dense.
    dense = when.shape[0] - 1 + day.shape[0] - 1
    assert model.net[0].in_features == 3 * DEFAULT_DIM + dense
    codecs = codecs_for(inputs, read_encoders(prepared.dataset_dir, prepared.manifest))
    frame = pa.Table.from_pandas(timetable(rows=64, seed=1), preserve_index=False)
    batch = {name: torch.from_numpy(codecs[name].encode(frame[name])) for name in ("when", "day", "basket")}
    before = model(batch)
    with torch.no_grad():
        model.numeric_embeddings.steps[1] += 0.5  # the order time's steps, at zero from the start
    assert (model(batch) - before).abs().max() > 1e-3
    state = {key: value for key, value in codecs["when"].fit().items() if key != "edges"}
    old = DatetimeCodec("when")
    old.load(state)
    assert old.info().bins is None and MLP({"when": old.info()}, 2).binned == {}
    # The column a time split is by: no bins (its val, test and served rows lie past them); the others keep theirs.
    (tmp_path / "by_time").mkdir()
    frame = timetable().dropna(subset=["when"])
    split = prepare(tmp_path / "by_time", frame, INPUTS, "data.split={by: time, column: when}")
    by_time = inputs_from_manifest(split.manifest)
    assert split.manifest.extra["split"]["column"] == "when" and split.manifest.splits["test"].rows > 0
    assert by_time["when"].bins is None and len(by_time["day"].bins) > 40
    assert read_encoders(split.dataset_dir, split.manifest)["when"]["state"]["edges"] is None
    assert list(MLP(by_time, 2).binned) == ["day"]


def test_drift_compares_the_time_of_day_weekday_and_month(tmp_path):
    for folder in "abc":
        (tmp_path / folder).mkdir()
    first = prepare(tmp_path / "a", timetable(seed=0), INPUTS)
    before = first.manifest
    again = prepare(tmp_path / "b", timetable(seed=1), INPUTS).manifest
    shifted = prepare(tmp_path / "c", timetable(seed=1, hour_shift=7), INPUTS).manifest
    same = {drift.feature: drift.psi for drift in compare(before, again).features}
    moved = {drift.feature: drift.psi for drift in compare(before, shifted).features}
    assert {"when:hour", "when:day_of_week", "when:month", "day:day_of_week", "day:month"} <= set(moved)
    assert "day:hour" not in moved  # a date has no time of day
    assert moved["when:hour"] > 0.25 > same["when:hour"], (moved, same)
    # A scored table's statistics are the train split's, measured the same way (batch scoring's drift).
    codecs = codecs_for(inputs_from_manifest(before), read_encoders(first.dataset_dir, before))
    train = pa.concat_tables([pq.read_table(path) for path in before.split_files(first.dataset_dir, "train")])
    tally = DriftTally({"when": codecs["when"]})
    for batch in train.to_batches(max_chunksize=100):
        tally.update(batch)
    assert tally.stats["when"] == before.extra["drift_stats"]["inputs"]["when"]


def test_a_model_learns_the_time_of_day_and_scores_raw_rows_as_its_evaluation(tmp_path):
    frame = timetable(rows=1500)
    prepared = prepare(tmp_path, frame, "data.inputs={when: datetime, text: datetime, basket: numeric}")
    dataset = prepared.dataset_dir
    model_path = train_typed_model(dataset, tmp_path / "model.pt", steps=300, lr=0.02, hidden=32)
    evaluated = evaluate_split(model_path, dataset, return_predictions=True)
    assert evaluated.metrics["test_roc_auc"] > 0.9, evaluated.metrics  # only the time of day says "late"
    baselines = evaluate_baselines(model_path, dataset, "test")
    assert baselines.reference["test_roc_auc"] > 0.9, baselines.notes  # boosting reads the hour too
    # The test rows as the source has them, read back by key: pandas (zoned datetime64), pyarrow, Arrow dtypes.
    test = pa.concat_tables([pq.read_table(path) for path in read_manifest(dataset).split_files(dataset, "test")])
    keys = test["order_id"].to_pylist()
    source = tmp_path / "orders.parquet"
    read_back = {
        "pandas": pd.read_parquet(source),
        "pandas arrow": pd.read_parquet(source, dtype_backend="pyarrow"),
        "pyarrow": pq.read_table(source).to_pandas(),
    }
    predictor = Predictor.from_checkpoint(model_path)
    expected = np.asarray(read_manifest(dataset).label_mapping)[evaluated.predictions]
    for how, rows in read_back.items():
        rows = rows.set_index("order_id").loc[keys]
        assert str(rows["when"].dtype).startswith(("datetime64", "timestamp")), (how, rows["when"].dtype)
        np.testing.assert_array_equal(predictor.predict(rows[predictor.features]), expected, err_msg=how)
    # An Arrow batch, as batch scoring hands one to its ranks, and the times sent as UTC text: the same answers.
    batch = pq.read_table(source).to_pandas().set_index("order_id").loc[keys].reset_index()
    columns = predictor.score_columns(pa.Table.from_pandas(batch[predictor.features], preserve_index=False))
    np.testing.assert_array_equal(columns["label"], expected)
    as_text = batch.assign(when=batch["when"].dt.tz_convert("UTC").dt.strftime("%Y-%m-%dT%H:%M:%SZ"))
    as_text["when"] = as_text["when"].where(batch["when"].notna(), None)
    np.testing.assert_array_equal(predictor.predict(as_text[predictor.features]), expected)
    bad = as_text.head(2).copy()
    bad["when"] = ["2024-05-01T10:00:00Z", "tomorrow"]
    with pytest.raises(ValueError, match="input rows cannot be encoded: datetime column 'when' holds 'tomorrow'"):
        predictor.predict(bad[predictor.features])
