"""An image folder (3 shapes x 20 PNGs of 16x16, drawn with Pillow) through `ddpflow run` end to end, one
torchrun launch of 2 ranks with decode workers: it trains the built-in CNN (train.model auto), evaluates with
a grid of misclassified images, registers a champion whose pyfunc takes the image bytes or their base64 text,
in process and over HTTP (`mlflow models serve`), and answers what the evaluation scored."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from image_data import SHAPES, image_table, write_image_folder

from tests.flows.cli_runs import cli_env, run_promoted

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.torchrun
def test_an_image_folder_trains_registers_and_serves_images(prefect_harness, make_config, tmp_path):
    import mlflow
    from mlflow import MlflowClient
    from mlflow.types import DataType

    from ddpflow.tracking.runs import use_tracking_uri
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    root = write_image_folder(tmp_path / "shapes", per_class=20)
    config = make_config(
        **{
            "data.source": str(root),  # train.model left at its default, auto: the image model
            "train.model_kwargs": {"width": 8, "blocks": [1, 1], "groups": 4},
            # Enough to beat guessing: the gate rejects a model that does not (3 epochs at lr 0.01 did not).
            "train.epochs": 8,
            "train.lr": 0.03,
            "train.batch_size": 8,
            "train.num_workers": 1,  # auto gives a rank of 1 core none
        }
    )
    summary, run_dir, dataset = run_promoted(tmp_path, config, prefect_harness)
    manifest = read_manifest(dataset)
    assert manifest.key == "path" and manifest.label_mapping == sorted(SHAPES)
    assert [(entry["name"], entry["kind"]) for entry in manifest.inputs] == [("image", "image")]
    assert torch.load(run_dir / "model.pt", weights_only=True)["model_spec"]["model"] == "image_cnn"
    run = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.data.params["train.model"] == "image_cnn", "the run records the model auto picked"

    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True)
    artifacts = {a.path for a in MlflowClient(summary["tracking_uri"]).list_artifacts(summary["mlflow_run_id"], "eval")}
    wrong = int((evaluated.predictions != evaluated.targets).sum())
    assert ("eval/misclassified.png" in artifacts) == (wrong > 0), (artifacts, wrong)

    test = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    expected = np.asarray(manifest.label_mapping)[evaluated.predictions]
    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
    schema = {spec.name: spec.type for spec in served.metadata.get_input_schema().inputs}
    assert schema == {"image": DataType.binary}
    as_bytes = pd.DataFrame({"image": list(test["image"])})
    np.testing.assert_array_equal(np.asarray(served.predict(as_bytes)), expected)
    as_text = pd.DataFrame({"image": [base64.b64encode(image).decode() for image in test["image"]]})
    scored = served.predict(as_text, params={"output": "probabilities"})
    np.testing.assert_array_equal(scored["label"].to_numpy(), expected)
    np.testing.assert_allclose(scored[[f"probability_{s}" for s in sorted(SHAPES)]].sum(axis=1), 1.0, rtol=1e-5)

    # Over HTTP: JSON carries the PNGs as base64; the served model decodes and scores them as evaluation did.
    np.testing.assert_array_equal(np.asarray(invocations(config, as_text, tmp_path)), expected)


@pytest.mark.torchrun
def test_a_parquet_struct_column_with_a_categorical_trains_and_serves_through_ddpflow_run(
    prefect_harness, make_config, tmp_path
):
    """Hugging Face's {bytes, path} struct, beside a categorical: one model through the batch dict."""
    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    source = tmp_path / "photos.parquet"
    pq.write_table(image_table(90, struct=True), source)
    config = make_config(
        **{
            "data.source": str(source),
            "data.label": "shape",
            "data.key": "id",
            "data.inputs": {"photo": {"kind": "image", "size": 12}, "colour": "categorical"},
            "train.model": "auto",
            "train.model_kwargs": {"width": 8, "blocks": [1, 1], "groups": 4},
            "train.epochs": 2,
            "train.batch_size": 8,
        }
    )
    summary, run_dir, dataset = run_promoted(tmp_path, config, prefect_harness)
    manifest = read_manifest(dataset)
    assert {entry["name"]: entry["kind"] for entry in manifest.inputs} == {"photo": "image", "colour": "categorical"}
    test = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True)
    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
    frame = pd.DataFrame({"photo": list(test["photo"]), "colour": test["colour"]})
    np.testing.assert_array_equal(
        np.asarray(served.predict(frame)), np.asarray(manifest.label_mapping)[evaluated.predictions]
    )


def invocations(config: dict, rows: pd.DataFrame, tmp_path: Path) -> list:
    """The champion served by ``mlflow models serve`` over loopback HTTP, answering ``rows``."""
    from devtools.model_server import invocations as served_invocations

    model_uri = f"models:/{config['registry']['model_name']}@champion"
    return served_invocations(model_uri, config["mlflow"]["tracking_uri"], rows, tmp_path, cli_env())
