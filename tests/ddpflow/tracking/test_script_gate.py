"""The gate for a training script's model without a data section (ddpflow/tracking/registration.py:
``_ReportedRegistration``): judged on the metric it reported, its champion on what the champion's own run
reported, its exported program registered as a pyfunc that needs no script. A real SQLite MLflow store."""

from __future__ import annotations

import json
import math

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from ddpflow.script.export import export_module
from ddpflow.tracking.registration import NO_GUESSING_RULE, register_candidate
from ddpflow.tracking.registry import RegistrationError
from ddpflow.tracking.runs import start_pipeline_run, use_tracking_uri
from ddpflow.tracking.script_models import gate_metric, script_outcome
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write
from training.core.layout import SCRIPT_EXAMPLE, SCRIPT_PROGRAM, SCRIPT_REPORTS

MODEL = "script-gate"


@pytest.fixture
def store(mlflow_store, tmp_path, monkeypatch):
    uri, artifacts = mlflow_store
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    config = PipelineConfig.model_validate(
        {
            "train": {"script": str(tmp_path / "train.py")},
            "registry": {"model_name": MODEL},
            "mlflow": {"tracking_uri": uri, "experiment": "scripts", "artifact_location": artifacts},
        }
    )
    return config, uri


def finished_script(tmp_path, name: str, weight: float, reports: list[dict]) -> tuple:
    """A run directory as a script's ranks leave it: reports and an exported y = weight * x."""
    run_dir = tmp_path / name
    (run_dir / "script").mkdir(parents=True)
    module = torch.nn.Linear(3, 1)
    with torch.no_grad():
        module.weight.fill_(weight)
        module.bias.zero_()
    program, args, outputs = export_module(module.eval(), (torch.ones(2, 3),))
    atomic_write(run_dir / SCRIPT_PROGRAM, lambda handle: handle.write(program))
    atomic_write(run_dir / SCRIPT_EXAMPLE, lambda handle: torch.save({"args": args, "outputs": outputs}, handle))
    lines = [json.dumps({"step": i, "time": 0, "metrics": metrics}) for i, metrics in enumerate(reports)]
    (run_dir / SCRIPT_REPORTS).write_text("\n".join(lines) + "\n")
    return run_dir, script_outcome(run_dir)


def registered(config: PipelineConfig, uri: str, run_dir, outcome) -> dict:
    run_id = start_pipeline_run(config, run_dir.name, {}, None, None, {"nproc_per_node": 2})
    for name, value in outcome.reported.items():
        MlflowClient(uri).log_metric(run_id, name, value)  # as the train task's follower mirrors them
    return register_candidate(config, run_id, str(outcome.program), None, outcome.reported, uri).to_dict()


def test_the_reported_metric_decides_against_the_champions_own_report(store, tmp_path):
    config, uri = store
    first_dir, first = finished_script(tmp_path, "first", 2.0, [{"test_mse": 0.5}, {"test_mse": 0.2, "lr": 0.1}])
    assert first.reported == {"test_mse": 0.2, "lr": 0.1}  # each metric's last value
    decision = registered(config, uri, first_dir, first)
    assert (decision["decision"], decision["metric"], decision["version"]) == ("promoted", "test_mse", "1")
    assert decision["warning"] == NO_GUESSING_RULE
    worse_dir, worse = finished_script(tmp_path, "worse", 3.0, [{"test_mse": 0.3}])
    decision = registered(config, uri, worse_dir, worse)
    assert decision["decision"] == "challenger"
    assert decision["reason"] == "test_mse 0.3 does not beat champion v1's 0.2 by more than 0"  # lower is better
    better_dir, better = finished_script(tmp_path, "better", 4.0, [{"test_mse": 0.1}])
    assert registered(config, uri, better_dir, better)["decision"] == "promoted"
    # The champion is the program alone: served without the script, y = 4x.
    with use_tracking_uri(uri):
        served = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(served.predict(x), 4.0 * x.sum(axis=1, keepdims=True), rtol=1e-6)


def test_a_nan_report_is_rejected_and_an_unnamed_choice_of_metrics_is_not_guessed(store, tmp_path):
    config, uri = store
    run_dir, outcome = finished_script(tmp_path, "nan", 1.0, [{"test_mse": math.nan}])
    decision = registered(config, uri, run_dir, outcome)
    assert decision["decision"] == "rejected" and "NaN" in decision["reason"]
    assert gate_metric(config, {"test_mse": 1.0, "test_mae": 0.5}) == (
        None,
        "the script reported several test_* metrics ['test_mae', 'test_mse']: "
        "name the one to judge by in registry.metric",
    )
    assert gate_metric(config, {"train_loss": 1.0})[0] is None
    named = config.model_copy(update={"registry": config.registry.model_copy(update={"metric": "val_auc"})})
    assert gate_metric(named, {"test_mse": 1.0, "val_auc": 0.7}) == ("val_auc", None)
    with pytest.raises(RegistrationError, match="registry.metric 'val_auc' was never reported"):
        register_candidate(named, "run", "model.pt2", None, {"test_mse": 1.0}, uri)
