"""Configs the flow must reject before any process starts, and an unreachable MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.exceptions import ParameterTypeError

from devtools.ports import free_port


def nothing_ran(config) -> None:
    """No run directory, no MLflow run: no torchrun was launched."""
    run_root = Path(config["train"]["run_root"])
    assert not run_root.exists() or not any(run_root.iterdir()), list(run_root.iterdir())
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    assert experiment is None or not client.search_runs([experiment.experiment_id])


@pytest.mark.parametrize(
    ("field", "value", "error", "words"),
    [
        ("train.epochs", -1, ParameterTypeError, ["config.train.epochs", "greater than or equal to 1"]),
        ("train.nproc_per_node", 4096, ValueError, ["train.nproc_per_node", "4096"]),
        ("train.model", "no_such_package.models:build", ValueError, ["train.model", "no_such_package"]),
        ("train.batch_size", 100_000, ValueError, ["train.batch_size", "100000"]),
    ],
)
def test_invalid_config_is_rejected_before_any_process_starts(prefect_harness, make_config, field, value, error, words):
    from flows.pipeline import train_pipeline

    config = make_config(**{field: value})
    with pytest.raises(error) as failure:
        train_pipeline(config=config)
    for word in words:
        assert word in str(failure.value), str(failure.value)
    nothing_ran(config)


def test_unreachable_mlflow_fails_fast_before_preparing_or_training(prefect_harness, make_config, tmp_path):
    from flows.pipeline import train_pipeline

    uri = f"http://127.0.0.1:{free_port()}"
    config = make_config(**{"mlflow.tracking_uri": uri})
    config["data"]["root"] = str(tmp_path / "shards")
    with pytest.raises(Exception) as failure:
        train_pipeline(config=config)
    assert uri in str(failure.value), str(failure.value)
    assert not Path(config["train"]["run_root"]).exists(), "nothing trained"
    assert not (tmp_path / "shards").exists(), "nothing prepared either: the check comes first"
