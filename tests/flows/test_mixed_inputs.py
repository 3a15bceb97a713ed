"""A mixed table (numeric + 3 categoricals + a hashed id + a vector) through `ddpflow run` end to end, one
torchrun launch: it beats the majority class where its numeric columns cannot (the label is a function of a
categorical), and the champion's pyfunc, given raw rows (strings, lists, an unseen category), predicts what
the evaluation scored. Its numeric inputs hold every numeric source type (int8..int64, uint8..uint32, bool,
float32, float64, a nullable integer with nulls): the source's own rows, read back with pandas or pyarrow
and unchanged, score in process and over HTTP, through `ddpflow serve`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.waiting import wait_until
from tests.flows.cli_runs import cli_env, run_promoted
from tests.flows.serve_cli import start_serve

REPO = Path(__file__).resolve().parents[2]
ROWS = 3000
# Numeric inputs of every source type a table brings (the noise the label does not depend on).
NUMERIC_TYPES = {
    "tenure": "float64",
    "hour": "int64",
    "visits": "int32",
    "rooms": "int16",
    "floor": "int8",
    "age": "uint8",
    "year": "uint16",
    "views": "uint32",
    "mobile": "bool",
    "spend": "float32",
    "children": "Int64",  # pandas' nullable integer: int64 in Parquet, nulls among its values
    "amount": "Int64",  # heavy-tailed (lognormal, a few of 10^12), nulls among its values
}
# What the served model's signature declares for each (MLflow's column types): the source's kind, at the width
# that takes both the source's own frame and a hand-built one (pandas' int64 and float64).
DECLARED = dict.fromkeys(("hour", "visits", "rooms", "floor", "age", "year", "views"), "long")
DECLARED |= {"tenure": "double", "spend": "double", "mobile": "boolean"}
# An integer with nulls in the train split: MLflow's long refuses every null and its double an int64 column, so
# it is declared any (its nulls imputed, with a missing indicator: training/inference/serving.py).
DECLARED["children"] = DECLARED["amount"] = "any"
INPUTS = {
    **dict.fromkeys(NUMERIC_TYPES, "numeric"),
    "country": "categorical",
    "plan": {"kind": "categorical", "min_count": 5},
    "device": "categorical",
    "merchant_id": {"kind": "hashed", "buckets": 211},
    "embedding": "vector",
}


def churn_table(rows: int = ROWS, seed: int = 0) -> pa.Table:
    """``churned`` is 1 for two of five countries (40 % of rows): the majority class is 0 at about 60 %.
    Built from pandas, so a reader gets its dtypes back (the nullable integer as ``Int64``)."""
    rng = np.random.default_rng(seed)
    country = rng.choice(["no", "se", "dk", "fi", "is"], size=rows)
    numbers = {
        "tenure": rng.normal(size=rows),  # noise: alone, no better than the majority class
        "hour": rng.integers(0, 24, size=rows),
        "visits": rng.integers(0, 1000, size=rows),
        "rooms": rng.integers(1, 12, size=rows),
        "floor": rng.integers(-2, 40, size=rows),
        "age": rng.integers(18, 90, size=rows),
        "year": rng.integers(1950, 2026, size=rows),
        "views": rng.integers(0, 5_000_000, size=rows),
        "mobile": rng.random(rows) < 0.3,
        "spend": rng.gamma(2.0, 30.0, size=rows),
        "children": pd.array(np.where(rng.random(rows) < 0.05, None, rng.integers(0, 5, size=rows)), "Int64"),
        "amount": pd.array(np.where(rng.random(rows) < 0.05, None, heavy_tailed(rng, rows)), "Int64"),
    }
    frame = pd.DataFrame(
        {
            "customer_id": np.arange(rows),
            **{name: pd.Series(values).astype(NUMERIC_TYPES[name]) for name, values in numbers.items()},
            "country": country,
            "plan": rng.choice(["basic", "pro", "team"], size=rows),
            "device": rng.choice(["ios", "android", "web"], size=rows),
            "merchant_id": [f"m-{i % 500:04d}" for i in rng.permutation(rows)],
            "embedding": [rng.normal(size=4).tolist() for _ in range(rows)],
            "churned": np.isin(country, ["no", "dk"]).astype(np.int64),
        }
    )
    return pa.Table.from_pandas(frame, preserve_index=False)


def heavy_tailed(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Amounts as real tables hold them: lognormal whole numbers, one row in 200 of 10^12."""
    amount = np.round(rng.lognormal(4.0, 2.0, size=rows)).astype(np.int64)
    amount[::200] = 10**12
    return amount


def read_back(source: Path) -> dict[str, pd.DataFrame]:
    """The source as a user reads it back: pandas and pyarrow, with numpy, nullable and Arrow dtypes."""
    return {
        "pandas": pd.read_parquet(source),
        "pyarrow": pq.read_table(source).to_pandas(),
        "pandas nullable": pd.read_parquet(source, dtype_backend="numpy_nullable"),
        "pandas arrow": pd.read_parquet(source, dtype_backend="pyarrow"),
    }


def model_uri(config: dict) -> str:
    return f"models:/{config['registry']['model_name']}@champion"


@pytest.mark.torchrun
def test_a_mixed_table_trains_through_ddpflow_run_and_serves_raw_rows(prefect_harness, make_config, tmp_path):
    import mlflow
    from mlflow.types import DataType

    from ddpflow.tracking.runs import use_tracking_uri
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    source = tmp_path / "churn.parquet"
    pq.write_table(churn_table(), source)
    config = make_config(
        **{
            "data.source": str(source),
            "data.label": "churned",
            "data.key": "customer_id",
            "data.inputs": INPUTS,
            "train.epochs": 3,
            "train.batch_size": 64,
        }
    )
    summary, run_dir, dataset = run_promoted(tmp_path, config, prefect_harness)
    manifest = read_manifest(dataset)
    test = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    majority = max(np.mean(test["churned"] == 0), np.mean(test["churned"] == 1))
    accuracy = summary["test_metrics"]["test_accuracy"]
    assert accuracy > majority + 0.2, f"test accuracy {accuracy:.3f} vs the majority class's {majority:.3f}"

    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True).predictions
    expected = np.asarray(manifest.label_mapping)[evaluated]
    # The source's own rows (the test split's, by key), read back and unchanged: every dtype as the source has it.
    sources = {how: frame.set_index("customer_id").loc[test["customer_id"]] for how, frame in read_back(source).items()}
    assert sources["pandas"]["children"].dtype == "Int64" and sources["pandas"]["hour"].dtype == np.int64
    for how, rows in sources.items():
        np.testing.assert_array_equal(np.asarray(served.predict(rows[list(INPUTS)])), expected, err_msg=how)
    # The inputs in the manifest's order (the config's: yaml.safe_dump sorted it), source types in the schema.
    assert served.metadata.get_input_schema().input_names() == manifest.input_names()
    assert sorted(manifest.input_names()) == sorted(INPUTS)
    schema = {spec.name: spec.type for spec in served.metadata.get_input_schema().inputs}
    assert schema["country"] == DataType.string and "Array" in str(schema["embedding"])
    assert {name: getattr(schema[name], "name", "any") for name in NUMERIC_TYPES} == DECLARED  # AnyType: no name
    assert test["children"].isna().any() and manifest.dropped_rows == 0  # nulls are values: rows kept, served
    raw = sources["pandas"][list(INPUTS)]
    # The same rows built by hand from Python values: pandas' own int64 and float64 for every number.
    by_hand = pd.DataFrame({name: raw[name].tolist() for name in INPUTS})
    assert by_hand["visits"].dtype == np.int64 and by_hand["spend"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(served.predict(by_hand)), expected)
    # The scores, not only the labels: the served probabilities rank the test rows as the evaluation did (its
    # ROC AUC), through the default encoding (robust scaling, the numeric embeddings' bins) and the nulls.
    from sklearn.metrics import roc_auc_score

    assert raw["amount"].isna().any() and raw["amount"].max() >= 10**12
    assert read_manifest(dataset).feature_clip[0]  # robust scaling, the default
    probability = served.predict(raw, params={"output": "probabilities"})["probability_1"].to_numpy()
    auc = roc_auc_score(test["churned"], probability)
    assert auc == pytest.approx(summary["test_metrics"]["test_roc_auc"], abs=1e-6)
    unseen = raw.head(3).copy()
    unseen["country"] = "atlantis"  # never seen in training: scored as unknown, never an error
    scored = served.predict(unseen, params={"output": "probabilities"})
    assert isinstance(scored, pd.DataFrame) and list(scored.columns) == ["label", "probability_0", "probability_1"]
    np.testing.assert_allclose(scored[["probability_0", "probability_1"]].sum(axis=1), 1.0, rtol=1e-5)

    # `ddpflow serve` (MLflow's scoring server) answers /invocations with the source's rows over HTTP.
    serve_over_http(config, served, raw.head(20), expected[:20], tmp_path)


def serve_over_http(config: dict, served, rows: pd.DataFrame, expected: np.ndarray, tmp_path: Path) -> None:
    """`ddpflow serve NAME`: its printed curl answers; JSON integers and floats both score a numeric input;
    Ctrl-C and SIGTERM end it (130, 143) with nothing left running, and so does SIGKILL."""
    name, tracking_uri = config["registry"]["model_name"], config["mlflow"]["tracking_uri"]
    server = start_serve(name, tracking_uri, tmp_path)
    try:
        curl = subprocess.run(["bash", "-c", server.curl_line()], capture_output=True, text=True, timeout=60)
        # The printed curl: one row of the model's own input example (the test split's first row).
        assert json.loads(curl.stdout)["predictions"] == expected[:1].tolist(), curl.stdout + curl.stderr
        as_json = json.loads(rows.to_json(orient="split", index=False))  # int64 as JSON integers, bools as true
        np.testing.assert_array_equal(np.asarray(server.post({"dataframe_split": as_json})), expected)
        floats = rows.astype(dict.fromkeys(NUMERIC_TYPES, "float64"))  # every number as a JSON float: 7.0
        as_floats = json.loads(floats.to_json(orient="split", index=False))
        np.testing.assert_array_equal(np.asarray(server.post({"dataframe_split": as_floats})), expected)
        whole = rows.round({"tenure": 0, "spend": 0})  # JSON integers for the float64 and float32 inputs: 31
        as_ints = json.loads(whole.astype({"tenure": "int64", "spend": "int64"}).to_json(orient="split", index=False))
        in_process = np.asarray(served.predict(whole.astype({"spend": "float32"})))
        np.testing.assert_array_equal(np.asarray(server.post({"dataframe_split": as_ints})), in_process)
    finally:
        status = server.stop(signal.SIGINT)
    assert status == 130, server.stderr.read_text()[-3000:]
    assert server.started and server.left_running() == []
    terminated = start_serve(f"{name}@champion", tracking_uri, tmp_path)
    assert terminated.stop(signal.SIGTERM) == 143, terminated.stderr.read_text()[-3000:]
    assert terminated.started and terminated.left_running() == []
    killed = start_serve(name, tracking_uri, tmp_path)  # killed outright: no cleanup of its own can run
    assert killed.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_until(lambda: killed.left_running() == [], 60, "the server of a SIGKILLed ddpflow serve to stop")
    missing = subprocess.run(
        [sys.executable, "-m", "flows.cli", "serve", f"{name}/99", "--tracking-uri", tracking_uri],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith(f"error: {name!r} has no version 99"), missing.stderr
