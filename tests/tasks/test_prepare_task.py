"""The Prefect task around prepare: logs cache hit / prepared, publishes a table artifact, never retries."""

from __future__ import annotations

import json

import pytest

from training.core.config import load_config
from training.prepare.dataset import DataError


def test_prepare_task_logs_and_publishes_an_artifact(prefect_harness, tmp_path):
    from prefect import flow
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tasks.prepare import prepare_data

    config = load_config(
        None, ["data.source=synthetic://classification?rows=3000&features=4&classes=2&seed=0", f"data.root={tmp_path}"]
    )

    @flow
    def prepare_twice(config):
        from prefect.runtime import flow_run

        return prepare_data(config), prepare_data(config), flow_run.id

    first, second, flow_run_id = prepare_twice(config)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert first.dataset_dir == second.dataset_dir

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    messages = [log.message for log in logs]
    assert any(message.startswith(f"prepared dataset {first.fingerprint}") for message in messages), messages
    assert any(message.startswith(f"cache hit: dataset {first.fingerprint}") for message in messages), messages

    artifact = Artifact.get("prepared-dataset")
    table = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert [row["split"] for row in table] == ["train", "val", "test"]
    assert [row["rows"] for row in table] == [first.manifest.rows(split) for split in ("train", "val", "test")]


def test_prepare_task_fails_once_on_bad_input(prefect_harness, tmp_path):
    """Bad input fails the same way every time: the task runs once, with no retry, and fails with the cause."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks.prepare import prepare_data

    config = load_config(None, [f"data.source={tmp_path / 'missing.parquet'}", f"data.root={tmp_path}"])
    flow_runs = []

    @flow
    def prepare_only(config):
        from prefect.runtime import flow_run

        flow_runs.append(flow_run.id)
        return prepare_data(config)

    with pytest.raises(DataError, match="missing.parquet.*no such file"):
        prepare_only(config)
    with get_client(sync_client=True) as client:
        [task_run] = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_runs)))
        states = [state.name for state in client.read_task_run_states(task_run.id)]
    assert task_run.run_count == 1 and states[-1] == "Failed", states
    assert not {"AwaitingRetry", "Retrying"} & set(states), states


def test_prepare_task_names_every_column_left_out_in_its_log_and_an_artifact(prefect_harness, tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from prefect import flow
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tasks.prepare import prepare_data

    rows = 600
    rng = np.random.default_rng(1)
    source = tmp_path / "churn.parquet"
    table = {
        "tenure": rng.normal(size=rows),
        "country": rng.choice(["no", "se"], rows),
        "label": rng.integers(0, 2, rows),
    }
    table["merchant_id"] = [f"m{i}" for i in range(rows)]
    pq.write_table(pa.table(table), source)
    config = load_config(None, [f"data.source={source}", f"data.root={tmp_path / 'shards'}"])

    @flow
    def prepare_once(config):
        from prefect.runtime import flow_run

        return prepare_data(config), flow_run.id

    prepared, flow_run_id = prepare_once(config)
    assert prepared.manifest.features == ["tenure"]
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    messages = [log.message for log in logs]
    assert any("'country'" in m and "data.inputs.country: categorical" in m for m in messages), messages
    assert any(m.startswith("prepared dataset") and "inputs: 1 numeric," in m for m in messages), messages
    assert any("'merchant_id'" in m and "data.inputs.merchant_id: {kind: hashed" in m for m in messages), messages
    artifact = Artifact.get("prepared-dataset-left-out")
    left = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert {row["column"]: row["data.inputs entry"].split(",")[0] for row in left} == {
        "country": "categorical",
        "merchant_id": "{kind: hashed",
    }
