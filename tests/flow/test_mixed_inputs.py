"""A mixed table (numeric + 3 categoricals + a hashed id + a vector) through `ddpflow run` end to end, one
torchrun launch: it beats the majority class where its numeric column cannot (the label is a function of a
categorical), and the champion's pyfunc, given raw rows (strings, lists, an unseen category), predicts what
the evaluation scored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flow.cli_runs import cli_env, run_promoted

from devtools.model_server import invocations

REPO = Path(__file__).resolve().parents[2]
ROWS = 3000
INPUTS = {
    "tenure": "numeric",
    "country": "categorical",
    "plan": {"kind": "categorical", "min_count": 5},
    "device": "categorical",
    "merchant_id": {"kind": "hashed", "buckets": 211},
    "embedding": "vector",
}


def churn_table(rows: int = ROWS, seed: int = 0) -> pa.Table:
    """``churned`` is 1 for two of five countries (40 % of rows): the majority class is 0 at about 60 %."""
    rng = np.random.default_rng(seed)
    country = rng.choice(["no", "se", "dk", "fi", "is"], size=rows)
    return pa.table(
        {
            "customer_id": np.arange(rows),
            "tenure": rng.normal(size=rows),  # noise: alone, no better than the majority class
            "country": country,
            "plan": rng.choice(["basic", "pro", "team"], size=rows),
            "device": rng.choice(["ios", "android", "web"], size=rows),
            "merchant_id": [f"m-{i % 500:04d}" for i in rng.permutation(rows)],
            "embedding": [rng.normal(size=4).tolist() for _ in range(rows)],
            "churned": np.isin(country, ["no", "dk"]).astype(np.int64),
        }
    )


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
    raw = test[list(INPUTS)].copy()  # strings for the categoricals and the id, lists for the vector
    predicted = np.asarray(served.predict(raw))
    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True).predictions
    np.testing.assert_array_equal(predicted, np.asarray(manifest.label_mapping)[evaluated])
    # The inputs in the manifest's order (the config's: yaml.safe_dump sorted it), raw types in the schema.
    assert served.metadata.get_input_schema().input_names() == manifest.input_names()
    assert sorted(manifest.input_names()) == sorted(INPUTS)
    schema = {spec.name: spec.type for spec in served.metadata.get_input_schema().inputs}
    assert schema["country"] == DataType.string and schema["tenure"] == DataType.double
    assert "Array" in str(schema["embedding"])
    unseen = raw.head(3).copy()
    unseen["country"] = "atlantis"  # never seen in training: scored as unknown, never an error
    scored = served.predict(unseen, params={"output": "probabilities"})
    assert isinstance(scored, pd.DataFrame) and list(scored.columns) == ["label", "probability_0", "probability_1"]
    np.testing.assert_allclose(scored[["probability_0", "probability_1"]].sum(axis=1), 1.0, rtol=1e-5)

    # `mlflow models serve` answers /invocations with raw rows over HTTP, as the evaluation scored them.
    rows = raw.head(20)
    answered = invocations(model_uri(config), config["mlflow"]["tracking_uri"], rows, tmp_path, cli_env())
    np.testing.assert_array_equal(np.asarray(answered), np.asarray(manifest.label_mapping)[evaluated[:20]])
