"""A table of orders with times as a shop's system writes them (a zoned Parquet timestamp, a naive one with nulls,
a date) through `ddpflow run` end to end, one torchrun launch: declared ``datetime`` and split by time, it trains
on the older rows and is judged on the newest, learns what only the time of day says, and the champion's pyfunc
scores the source's own rows, read back with pandas or pyarrow with their time dtypes, in process and over HTTP
(`ddpflow serve`: the times as ISO strings), as the evaluation scored them."""

from __future__ import annotations

import json
import signal
import subprocess

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.flows.cli_runs import run_promoted
from tests.flows.serve_cli import start_serve

OSLO = "Europe/Oslo"
ROWS = 2400
INPUTS = {"ordered": "datetime", "shipped": "datetime", "day": "datetime", "basket": "numeric"}
# What the served signature declares: MLflow's datetime for naive times and dates; any for a zoned column, whose
# values MLflow's datetime refuses (the model reads them, and ISO text with an offset, itself).
DECLARED = {"ordered": "any", "shipped": "datetime", "day": "datetime", "basket": "double"}


def orders(rows: int = ROWS, seed: int = 0) -> pd.DataFrame:
    """``late`` is 1 for an order placed at night on the shop's clock (22:00-06:00 in Oslo): only the time says so.
    Rows in no time order; ``shipped`` is naive (the warehouse's wall clock) with nulls, ``day`` a date."""
    rng = np.random.default_rng(seed)
    ordered = pd.Timestamp("2024-01-01", tz=OSLO) + pd.to_timedelta(rng.integers(0, 270 * 24 * 60, rows), unit="min")
    ordered = pd.Series(ordered)
    shipped = (ordered.dt.tz_localize(None) + pd.to_timedelta(rng.integers(2, 72, rows), unit="h")).astype(
        "datetime64[us]"
    )
    hour = ordered.dt.hour
    return pd.DataFrame(
        {
            "order_id": np.arange(rows, dtype=np.int64),
            "ordered": ordered,
            "shipped": shipped.where(rng.random(rows) > 0.05),
            "day": ordered.dt.date,
            "basket": rng.gamma(2.0, 20.0, rows),
            "late": ((hour >= 22) | (hour < 6)).astype(np.int64),
        }
    )


@pytest.mark.torchrun
def test_times_train_on_the_past_are_judged_on_the_newest_rows_and_serve_raw(prefect_harness, make_config, tmp_path):
    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    source = tmp_path / "orders.parquet"
    pq.write_table(pa.Table.from_pandas(orders(), preserve_index=False), source)
    config = make_config(
        **{
            "data.source": str(source),
            "data.label": "late",
            "data.key": "order_id",
            "data.inputs": INPUTS,
            "data.split": {"by": "time", "column": "ordered", "val": 0.15, "test": 0.15},
            "train.epochs": 4,
            "train.batch_size": 64,
        }
    )
    summary, run_dir, dataset = run_promoted(tmp_path, config, prefect_harness)
    assert summary["gate_metric"] == "test_roc_auc" and summary["test_metrics"]["test_roc_auc"] > 0.85, summary

    # Judged on its newest rows: every test order was placed after every train and val order.
    manifest = read_manifest(dataset)
    split_of = {
        split: pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, split)]).to_pandas()
        for split in ("train", "val", "test")
    }
    assert split_of["train"]["ordered"].max() < split_of["val"]["ordered"].min()
    assert split_of["val"]["ordered"].max() < split_of["test"]["ordered"].min()
    assert manifest.extra["split"]["test_from"] == str(
        split_of["test"]["ordered"].min().tz_localize(None).to_datetime64().astype("datetime64[us]")
    )

    # The champion's pyfunc on the source's own test rows, read back as a user reads them, dtypes and all.
    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
    declared = {spec.name: getattr(spec.type, "name", "any") for spec in served.metadata.get_input_schema().inputs}
    assert declared == DECLARED
    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True)
    expected = np.asarray(manifest.label_mapping)[evaluated.predictions]
    keys = split_of["test"]["order_id"]
    read_back = {
        "pandas": pd.read_parquet(source),
        "pandas nullable": pd.read_parquet(source, dtype_backend="numpy_nullable"),
        "pyarrow": pq.read_table(source).to_pandas(),
    }
    for how, frame in read_back.items():
        rows = frame.set_index("order_id").loc[keys, list(INPUTS)]
        assert str(rows["ordered"].dtype) == f"datetime64[us, {OSLO}]" and rows["shipped"].isna().any(), how
        np.testing.assert_array_equal(np.asarray(served.predict(rows)), expected, err_msg=how)
    rows = read_back["pandas"].set_index("order_id").loc[keys, list(INPUTS)]
    # The same instants in another zone: read on the shop's clock all the same.
    in_utc = rows.assign(ordered=rows["ordered"].dt.tz_convert("UTC"))
    np.testing.assert_array_equal(np.asarray(served.predict(in_utc)), expected)

    # `ddpflow serve`: its printed curl answers, and the rows as JSON (every time an ISO string) score the same.
    name, tracking_uri = config["registry"]["model_name"], config["mlflow"]["tracking_uri"]
    server = start_serve(name, tracking_uri, tmp_path)
    try:
        curl = subprocess.run(["bash", "-c", server.curl_line()], capture_output=True, text=True, timeout=60)
        assert len(json.loads(curl.stdout)["predictions"]) == 1, curl.stdout + curl.stderr
        body = json.loads(rows.head(40).to_json(orient="split", index=False, date_format="iso"))
        first = dict(zip(body["columns"], body["data"][0], strict=True))  # the zoned time in UTC: "...T08:00:00.000Z"
        assert first["ordered"].endswith("Z") and first["day"].endswith("T00:00:00.000"), first
        np.testing.assert_array_equal(np.asarray(server.post({"dataframe_split": body})), expected[:40])
        # ISO text with the shop's own offset, and the naive times as plain text: the same answers.
        text = rows.head(40).assign(ordered=rows["ordered"].head(40).map(lambda time: time.isoformat()))
        body = json.loads(text.to_json(orient="split", index=False, date_format="iso"))
        assert dict(zip(body["columns"], body["data"][0], strict=True))["ordered"][-6:] in ("+01:00", "+02:00")
        np.testing.assert_array_equal(np.asarray(server.post({"dataframe_split": body})), expected[:40])
    finally:
        status = server.stop(signal.SIGINT)
    assert status == 130, server.stderr.read_text()[-3000:]
    assert server.started and server.left_running() == []
