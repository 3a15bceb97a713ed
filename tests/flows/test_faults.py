"""Faults that must end cleanly: a rank that hangs inside real training, and the
MLflow server going away between evaluation and registration.

Real components only: torchrun with 2 gloo ranks of training.train, a real
`mlflow server` (SQLite store) on a loopback port, the session's Prefect harness.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from launch_helpers import is_alive  # tests/ranks/
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client

from ddpflow.launch.command import launch_env, torchrun_command
from ddpflow.launch.failure import RankFailed
from ddpflow.launch.supervisor import PID_FILE, launch
from ddpflow.tracking.registry import RegistryUnavailable
from ddpflow.tracking.runs import start_pipeline_run
from devtools.ports import free_port
from tasks.evaluate import evaluate_model
from tasks.register import register_model
from training.core.config import PipelineConfig
from training.core.job import TrainJob
from training.core.manifest import read_manifest

COLLECTIVE_TIMEOUT_S = 10  # long enough for 2 ranks to start together on a busy machine


def all_pids_of_the_run(run_dir: Path) -> list[int]:
    record = json.loads((run_dir / PID_FILE).read_text())
    return sorted({record["torchrun_pid"], *record["descendants"]})


# ----------------------------------------------------------------------------- a hang in the real rank program


@pytest.mark.timeout(150)  # the guard: without the collective timeout this test would wait forever
@pytest.mark.torchrun
def test_a_hung_rank_fails_the_launch_through_the_collective_timeout_and_leaves_no_process(dataset_factory, tmp_path):
    """Rank 1 stops before step 2 (no collective); rank 0 waits in DDP's all-reduce until
    train.collective_timeout_s, fails naming the timeout, torchrun stops rank 1."""
    dataset = dataset_factory(rows={"train": 1024, "val": 64, "test": 64})
    run_dir = tmp_path / "run"
    config = PipelineConfig.model_validate(
        {
            "train": {
                "epochs": 1, "batch_size": 32, "nproc_per_node": 2, "backend": "gloo", "max_restarts": 0,
                "collective_timeout_s": COLLECTIVE_TIMEOUT_S, "model_kwargs": {"hidden": [16]},
                "stall_timeout_s": None,  # the gloo timeout alone must end it (watchdog: tests/ddpflow/launch)
            }
        }
    )  # fmt: skip
    job = TrainJob(config=config, dataset_dir=str(dataset), run_dir=str(run_dir)).write(run_dir / "train_config.json")
    env = launch_env(config, run_dir, gpus=0, grace_s=2)
    env["DDPFLOW_FAULT"] = "hang:rank=1:epoch=0:step=2"
    lines: list[str] = []

    with pytest.raises(RankFailed) as caught:
        launch(
            torchrun_command(config, job, gpus=0),
            run_dir,
            env=env,
            on_line=lambda line: lines.append(str(line)),
            grace_s=2,
        )

    error = caught.value
    assert (run_dir / ".fault-hang-done").is_file(), "\n".join(lines[-30:])  # the hang really happened
    assert error.rank == 0, error  # the waiting rank reports it, not the silent one
    assert f"collective timed out after train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}s" in str(error), error
    # gloo's own words stay in the message: "Timed out waiting ...", or "Application timeout caused pair closure"
    # when the flag's all-reduce that runs beside the step is the collective that times out.
    assert re.search(r"\(it stalled or died\): \S", str(error)), error
    pids = all_pids_of_the_run(run_dir)
    assert len(pids) >= 3  # torchrun and its 2 ranks were recorded
    assert [pid for pid in pids if is_alive(pid)] == []
    assert not (run_dir / "model.pt").exists()


# ----------------------------------------------------------------------------- MLflow down at registration


class MlflowServer:
    """`mlflow server` on a loopback port over a SQLite store; stopped and started again on the same store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, within_s: float = 120) -> None:
        argv = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the server writes to it while it runs
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"mlflow server on {self.uri} not healthy after {within_s} s")

    def stop(self) -> None:
        """SIGTERM the server's session (uvicorn and its worker), SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        group = self.proc.pid  # start_new_session: its own group
        os.killpg(group, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.proc.wait(timeout=10)
        try:
            os.killpg(group, signal.SIGKILL)  # a worker that outlived its parent
        except ProcessLookupError:
            pass


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    # MLflow's HTTP client retries each call 7 times with backoff (~4 min when the server is down);
    # the task's own retries are what this test is about.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    root = tmp_path / "mlflow-server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(400)
def test_mlflow_down_at_registration_keeps_the_model_and_registration_finishes_later(
    prefect_harness, mlflow_server, dataset_factory, model_factory, monkeypatch
):
    from flows.registration import register_finished_run

    dataset = dataset_factory(rows={"train": 300, "val": 50, "test": 200})
    model_path = model_factory(dataset, steps=20)
    manifest = read_manifest(dataset)
    uri = mlflow_server.uri
    config = PipelineConfig.model_validate(
        {"mlflow": {"tracking_uri": uri, "experiment": "outage"}, "registry": {"model_name": "outage-model"}}
    )
    quick_retries = register_model.with_options(retry_delay_seconds=0)

    @flow
    def evaluate_then_lose_the_server() -> tuple[str, str, str]:
        run_id = start_pipeline_run(
            config,
            "outage",
            {"flow_run_name": "outage"},
            manifest.fingerprint,
            manifest,
            {"nproc_per_node": 1, "nnodes": 1},
            dataset,
        )
        metrics = evaluate_model(str(model_path), str(dataset), run_id, uri, config)
        mlflow_server.stop()
        state = quick_retries(config, run_id, str(model_path), str(dataset), metrics, uri, return_state=True)
        error = state.result(raise_on_failure=False)
        return run_id, f"{type(error).__name__}: {error}", str(state.state_details.task_run_id)

    run_id, error, task_run_id = evaluate_then_lose_the_server()

    assert error.startswith(RegistryUnavailable.__name__), error
    assert uri in error and f"ddpflow register --run-id {run_id}" in error, error
    with get_client(sync_client=True) as prefect:
        assert prefect.read_task_run(task_run_id).run_count == 4  # the first try and 3 retries
    assert model_path.is_file() and (model_path.parent / "eval" / "metrics.json").is_file()

    mlflow_server.start()  # the same SQLite store and port
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.search_model_versions("name = 'outage-model'") == []  # nothing half-registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what `ddpflow register --run-id` reads
    first = register_finished_run(run_id)
    again = register_finished_run(run_id)
    assert first["decision"] == "promoted" and first["model_version"] == "1" and not first["already_registered"]
    assert again["already_registered"] and again["model_version"] == "1"
    versions = client.search_model_versions("name = 'outage-model'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", run_id)]  # exactly one, from this run
    assert str(client.get_model_version_by_alias("outage-model", "champion").version) == "1"
    # The late registration moved @champion: the event score-on-new-champion waits for, once (not for `again`).
    assert [event["payload"]["version"] for event in champion_moved_events(prefect_harness, "outage-model")] == ["1"]


def champion_moved_events(api_url: str, model_name: str, wait_s: float = 30.0) -> list[dict]:
    """The ``ddpflow.champion.moved`` events of ``model_name`` the Prefect server holds (waiting for the first)."""
    from tasks.register import CHAMPION_MOVED

    body = {"filter": {"event": {"name": [CHAMPION_MOVED]}, "resource": {"id": [f"ddpflow.model.{model_name}"]}}}
    deadline, events = time.monotonic() + wait_s, []
    while not events and time.monotonic() < deadline:
        events = httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
        time.sleep(0.5)
    time.sleep(1.0)  # a second event, had there been one, arrives with the first
    return httpx.post(f"{api_url}/events/filter", json=body, timeout=30).json()["events"]
