"""New data starts a training, through the real stack (issue 15, part 2).

`ddpflow stack up` (Prefect server with its event and trigger services, `prefect deploy --all` from the
real prefect.yaml, a process worker, MLflow). A CSV source in a temp dir and a config naming it; then,
through the worker: `watch-data/every-10-minutes` runs three times, on an unseen source (recorded, no
event), the same source (no event), and the source with rows appended (`ddpflow.data.changed`), and the
deployment trigger of `train-pipeline/on-new-data` starts exactly one training, with that config, which
completes. One test: the stack costs ~40 s to start and each run through the worker several seconds.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import flow.test_deployments_e2e as deployments_e2e
import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from ddpflow.watch import EVENT, variable_name

pytestmark = pytest.mark.slow

# The deployment tests' stack fixture (`ddpflow stack up` in a temp dir, stopped after the module) and its
# helpers, reused; tests/ is on sys.path (tests/conftest.py). Module-scoped: this module gets its own stack.
stack = deployments_e2e.stack
Stack, RUN_TIMEOUT_S = deployments_e2e.Stack, deployments_e2e.RUN_TIMEOUT_S

MODEL_NAME = "ddpflow-watch-e2e"
TRIGGER_WAIT_S = 120  # event -> automation -> flow run: seconds, unless the machine is very busy


def write_rows(path: Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({f"f{i}": rng.normal(size=rows) for i in range(4)})
    frame["label"] = (frame["f0"] - frame["f2"] > 0).astype(int)
    frame.to_csv(path, mode="a" if path.exists() else "w", header=not path.exists(), index=False)


def watched_config(running: Stack) -> Path:
    source = running.tmp / "incoming" / "sales.csv"
    source.parent.mkdir(parents=True)
    write_rows(source, 2000, seed=0)
    config = {
        "data": {"source": str(source), "label": "label", "root": str(running.tmp / "watch-shards")},
        "train": {"epochs": 1, "nproc_per_node": 1, "batch_size": 128, "run_root": str(running.tmp / "watch-runs")},
        "registry": {"model_name": MODEL_NAME},
        "mlflow": {"artifact_location": str(running.tmp / "mlflow" / "mlartifacts")},
    }
    path = running.tmp / "watched.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_watch(running: Stack, config_file: Path) -> dict[str, Any]:
    params = json.dumps({"config_file": str(config_file)})
    result = running.prefect("deployment", "run", "watch-data/every-10-minutes", "--params", params)
    assert result.returncode == 0, result.stdout + result.stderr
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout).group(1)
    run = running.wait_for_terminal([flow_run_id], timeout_s=240)[flow_run_id]
    assert run["state_type"] == "COMPLETED", (run["state_name"], running.log_tail("worker"))
    return run


def flow_runs_of(running: Stack, deployment_id: str) -> list[dict[str, Any]]:
    return running.api("POST", "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}}})


def changed_events(running: Stack, source: Path) -> list[dict[str, Any]]:
    body = {"filter": {"event": {"name": [EVENT]}, "resource": {"labels": {"ddpflow.source": str(source)}}}}
    return running.api("POST", "/events/filter", json=body)["events"]


def test_new_data_starts_one_training_through_the_trigger_and_unchanged_data_none(stack: Stack) -> None:
    on_new_data = stack.deployment("on-new-data")
    watch = stack.api("GET", "/deployments/name/watch-data/every-10-minutes")
    assert [schedule["schedule"]["interval"] for schedule in watch["schedules"]] == [600.0]
    # `prefect deploy` turned the deployment's trigger into an automation that runs it.
    automations = stack.api("GET", f"/automations/related-to/prefect.deployment.{on_new_data['id']}")
    assert [(a["trigger"]["expect"], a["actions"][0]["deployment_id"]) for a in automations] == [
        ([EVENT], on_new_data["id"])
    ]

    config_file = watched_config(stack)
    source = stack.tmp / "incoming" / "sales.csv"
    variable = variable_name(str(config_file), None)

    run_watch(stack, config_file)  # first look: recorded, nothing emitted
    first_seen = stack.api("GET", f"/variables/name/{variable}")["value"]
    run_watch(stack, config_file)  # unchanged: nothing emitted
    time.sleep(10)  # an event would have reached the server and its trigger by now
    assert changed_events(stack, source) == []
    assert flow_runs_of(stack, on_new_data["id"]) == []

    write_rows(source, 50, seed=1)  # new rows land
    run_watch(stack, config_file)
    deadline = time.monotonic() + TRIGGER_WAIT_S
    while not (triggered := flow_runs_of(stack, on_new_data["id"])) and time.monotonic() < deadline:
        time.sleep(2)
    assert len(triggered) == 1, f"no training started by the trigger: {stack.log_tail('prefect-server')}"
    training = stack.wait_for_terminal([triggered[0]["id"]], timeout_s=RUN_TIMEOUT_S)[triggered[0]["id"]]
    assert training["state_type"] == "COMPLETED", (training["state_name"], stack.log_tail("worker"))
    assert training["parameters"] == {"config_file": str(config_file), "overrides": []}

    # Exactly one event, for the appended rows, carrying the old and new identity.
    events = changed_events(stack, source)
    assert len(events) == 1, events
    payload = events[0]["payload"]
    now_seen = stack.api("GET", f"/variables/name/{variable}")["value"]
    assert payload["previous"]["fingerprint"] == first_seen["fingerprint"] != now_seen["fingerprint"]
    assert payload["current"]["fingerprint"] == now_seen["fingerprint"]
    assert payload["current"]["bytes"] > payload["previous"]["bytes"]
    assert events[0]["resource"]["ddpflow.config"] == str(config_file)
    # The training used the new data and registered a model from it.
    mlflow_run = stack.mlflow_runs_by_flow_run()[training["id"]]
    assert mlflow_run.data.tags["data.fingerprint"] == now_seen["fingerprint"]
    versions = MlflowClient(tracking_uri=stack.mlflow_uri).search_model_versions(f"name='{MODEL_NAME}'")
    assert [v.run_id for v in versions] == [mlflow_run.info.run_id]
    assert [run["id"] for run in flow_runs_of(stack, on_new_data["id"])] == [training["id"]]  # one event, one run
