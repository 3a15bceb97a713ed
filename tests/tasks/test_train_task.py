"""tasks/train.py: the Prefect task, with real torchrun and a real (temporary) Prefect server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from launch_helpers import is_alive, make_manifest, still_alive
from prefect import flow

from ddpflow.launch.failure import RankFailed
from tasks.train import TrainRequest, TrainResult, train_model
from training.core.config import PipelineConfig
from training.core.manifest import read_manifest
from training.resolve import resolve_for_data

TRAIN_FLOW = Path(__file__).resolve().parents[1] / "ranks" / "train_flow.py"


def two_ranks(**train) -> PipelineConfig:
    return PipelineConfig.model_validate({"train": {"nproc_per_node": 2, "batch_size": 10, **train}})


@flow
def train_flow(
    config: PipelineConfig,
    dataset_dir: str,
    run_dir: str,
    mlflow_run_id: str | None = None,
    tracking_uri: str | None = None,
) -> TrainResult:
    request = TrainRequest(config, dataset_dir, run_dir, tracking_uri=tracking_uri, grace_s=2)
    return train_model(request, mlflow_run_id=mlflow_run_id)


def flow_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


@pytest.mark.torchrun
def test_train_model_writes_the_job_streams_rank_lines_and_returns_the_result(prefect_harness, stand_in_rank, tmp_path):
    dataset = make_manifest(tmp_path / "fp123")
    run_dir = tmp_path / "run"
    state = train_flow(two_ranks(epochs=3), str(dataset), str(run_dir), return_state=True)
    result = state.result()
    assert result.model_path == str(run_dir / "model.pt") and Path(result.model_path).is_file()
    # The stand-in's last epoch line (of train.epochs=3, from the job it read), as both ranks saw the world.
    assert result.metrics == {"epoch": 2, "val_loss": 1 / 3, "world_size": 2} and result.restarts == 0
    job = json.loads((run_dir / "train_config.json").read_text())
    assert job["dataset_dir"] == str(dataset) and job["run_dir"] == str(run_dir)
    # config.json holds what the run trained with: the config's `auto` settings resolved for the data.
    resolved = resolve_for_data(two_ranks(epochs=3), read_manifest(dataset), 2)
    assert PipelineConfig.model_validate_json((run_dir / "config.json").read_text()) == resolved
    assert resolved.train.batch_size != "auto" and resolved.train.early_stopping_patience != "auto"
    deadline = time.monotonic() + 20  # logs reach the API in batches
    while (
        not any("[rank 1] rank 1 done" in m for m in flow_logs(state.state_details.flow_run_id))
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert any("[rank 1] rank 1 done" in m for m in flow_logs(state.state_details.flow_run_id))


@pytest.mark.torchrun
def test_epoch_metrics_reach_the_mlflow_run_from_the_task_and_no_rank_is_given_the_run(
    prefect_harness, stand_in_rank, tmp_path, mlflow_store
):
    from mlflow import MlflowClient

    uri, artifacts = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("follow", artifact_location=artifacts)).info.run_id
    run_dir = tmp_path / "run"
    state = train_flow(
        two_ranks(epochs=3), str(make_manifest(tmp_path / "fp123")), str(run_dir), run_id, uri, return_state=True
    )
    assert state.is_completed()
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")]
    assert sorted(history) == [(0, 1.0), (1, 0.5), (2, 1 / 3)]  # every epoch the stand-in wrote, once
    # The task's process mirrors metrics.jsonl; the ranks get the tracking URI, never the run.
    envs = {path.stem: json.loads(path.read_text()) for path in (run_dir / "rank-env").glob("*.json")}
    assert sorted(envs) == ["0", "1"]
    for rank, env in envs.items():
        assert env["MLFLOW_TRACKING_URI"] == uri, rank
        assert [key for key in env if key.startswith("MLFLOW_") and key != "MLFLOW_TRACKING_URI"] == [], rank
        assert [key for key, value in env.items() if run_id in value] == [], f"rank {rank} was given the run"
    for given in ("train_config.json", "config.json"):
        assert run_id not in (run_dir / given).read_text(), f"{given} names the run"


def test_metrics_follower_logs_each_epoch_once_as_lines_land(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    from ddpflow.tracking.metrics import EpochMetricsFollower

    uri, artifacts = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("follow", artifact_location=artifacts)).info.run_id
    metrics = tmp_path / "metrics.jsonl"
    follower = EpochMetricsFollower(metrics, run_id, uri)
    follower.catch_up()  # no file yet: nothing to do
    with metrics.open("a") as handle:
        handle.write(
            json.dumps({"epoch": 0, "train_loss": 2.0}) + "\n" + '{"epoch": 1, "train_lo'
        )  # epoch 1 half-written
    follower.catch_up()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")] == [(0, 2.0)]
    with metrics.open("a") as handle:
        handle.write('ss": 1.5}\n')
    follower.catch_up()
    EpochMetricsFollower(metrics, run_id, uri).catch_up()  # a retried task's follower re-reads the file
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")) == [(0, 2.0), (1, 1.5)]


def test_bad_config_fails_before_any_process_starts_and_is_not_retried(prefect_harness, stand_in_rank, tmp_path):
    dataset = make_manifest(tmp_path / "fp123", train_rows=100)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"train\.batch_size"):
        train_flow(two_ranks(batch_size=60), str(dataset), str(run_dir))  # 100 rows / 2 ranks = 50
    assert not (run_dir / "torchrun.pid").exists() and not (run_dir / "logs").exists()


@pytest.mark.torchrun
def test_a_failing_rank_fails_the_task_with_its_exception_after_one_retry(prefect_harness, stand_in_rank, tmp_path):
    stand_in_rank.setenv("DUMMY_RANK_MODE", "raise")
    dataset = make_manifest(tmp_path / "fp123")
    run_dir = tmp_path / "run"
    with pytest.raises(RankFailed, match=r"rank 1 failed with exit code 1: ValueError: dummy failure on rank 1"):
        train_flow(two_ranks(max_restarts=0), str(dataset), str(run_dir))
    assert len(list((run_dir / "logs").iterdir())) == 2  # the first launch and the retry


@pytest.mark.torchrun
def test_cancelling_the_flow_run_through_the_api_kills_every_process_and_ends_cancelled(prefect_harness, tmp_path):
    """A flow in a plain process (no worker): cancel it via the API, as the UI does."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with stand_in_flow_training(tmp_path) as (flow_process, pids):
        with get_client(sync_client=True) as client:
            run_id = flow_run_of(client, "train-stand-in")
            client.set_flow_run_state(run_id, Cancelling(), force=True)
            alive = still_alive(pids, 30)
            assert alive == [], f"still running 30 s after cancelling: {alive}"
            flow_process.wait(timeout=30)
            final = client.read_flow_run(run_id).state
        assert final.is_cancelled(), final


@contextmanager
def stand_in_flow_training(tmp_path: Path):
    """A flow process whose train_model task runs stand-in ranks that each spawn a child; yields it once the
    whole tree (torchrun, 2 ranks, 2 grandchildren) is up, and kills whatever a failing test left behind."""
    from prefect.settings import PREFECT_API_URL

    dataset = make_manifest(tmp_path / "fp123")
    run_dir = tmp_path / "run"
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value(), DUMMY_RANK_MODE="spawn", DUMMY_RANK_LINES="1")
    flow_process = subprocess.Popen(
        [sys.executable, str(TRAIN_FLOW), str(run_dir), str(dataset)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        pids = wait_for_tree(run_dir, at_least=5)
        yield flow_process, pids
    finally:
        for pid in [flow_process.pid, *pids]:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def wait_for_tree(run_dir: Path, at_least: int, within_s: float = 90) -> list[int]:
    """PIDs of torchrun and everything below it (grandchildren that left the rank's session included)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            root = psutil.Process(json.loads((run_dir / "torchrun.pid").read_text())["torchrun_pid"])
            ranks = root.children(recursive=True)
            pids = [root.pid, *(p.pid for p in ranks), *(c.pid for p in ranks for c in p.children(recursive=True))]
            if len(set(pids)) >= at_least:
                return sorted(set(pids))
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
            pass
        time.sleep(0.3)
    raise AssertionError(f"the run's processes never all started in {run_dir}")


def flow_run_of(client, flow_name: str):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
    running = [run for run in runs if run.state and run.state.is_running()]
    assert len(running) == 1, runs
    return running[0].id


@pytest.mark.torchrun
def test_train_model_runs_the_real_rank_program(prefect_harness, tmp_path):
    """training.train under torchrun, on a tiny prepared dataset: model.pt and the last epoch's metrics come back."""
    from training.prepare.dataset import prepare_dataset

    config = PipelineConfig.model_validate(
        {
            "data": {
                "source": "synthetic://classification?rows=1500&features=4&classes=2&seed=0",
                "root": str(tmp_path / "shards"),
            },
            "train": {"epochs": 1, "batch_size": 64, "nproc_per_node": 2, "model_kwargs": {"hidden": [8]}},
        }
    )
    prepared = prepare_dataset(config.data)
    result = train_flow(config, str(prepared.dataset_dir), str(tmp_path / "run"))
    assert Path(result.model_path).is_file() and result.restarts == 0
    assert result.metrics["epoch"] == 0 and "val_loss" in result.metrics


@pytest.mark.torchrun
def test_sigterm_to_the_flow_process_kills_every_process_through_prefects_handler(prefect_harness, tmp_path):
    """Our handler runs first, then chains to Prefect's SIGTERM bridge: the run ends Crashed, no rank survives."""
    from prefect.client.orchestration import get_client

    with stand_in_flow_training(tmp_path) as (flow_process, pids):
        with get_client(sync_client=True) as client:
            run_id = flow_run_of(client, "train-stand-in")
            flow_process.terminate()
            flow_process.wait(timeout=60)
            assert still_alive(pids, 30) == []
            final = client.read_flow_run(run_id).state
        assert final.is_crashed(), final


def test_a_hanging_tracking_server_never_blocks_the_launcher(tmp_path, caplog, monkeypatch):
    """The follower logs on its own thread: poke() returns at once and close() waits only as long as told."""
    import socket

    from ddpflow.tracking.metrics import EpochMetricsFollower

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # once the server is gone, its thread ends at once

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"epoch": 0, "train_loss": 2.0}) + "\n")
    with socket.socket() as server:  # accepts connections (the kernel's backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        follower = EpochMetricsFollower(metrics, "0" * 32, f"http://127.0.0.1:{server.getsockname()[1]}").start()
        started = time.monotonic()
        follower.poke()
        assert time.monotonic() - started < 0.5
        follower.close(timeout_s=2)
        assert time.monotonic() - started < 10
    assert "not all logged within 2 s" in caplog.text
    assert metrics.read_text().count("train_loss") == 1  # the record is untouched
    # The server gone, the follower's requests fail (no retries) and its thread ends: none of its log lines
    # outlives the test and its captured streams.
    follower.close(timeout_s=60)
    assert "MLflow logging failed for epoch 0" in caplog.text and "within 60 s" not in caplog.text
