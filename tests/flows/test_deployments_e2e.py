"""End to end through the real stack: `ddpflow stack up` (Prefect server with its event and trigger services,
work pool, `prefect deploy --all` from the real prefect.yaml, process worker, MLflow server); deployment runs
through the worker, cancellation, new data starting a training through the deployment trigger, batch scoring
through score-nightly and a new champion's trigger, `ddpflow run` in the stack's project, the UIs, then
`ddpflow stack down`.

One stack for the module: it costs 30-60 s to start on 2 cores, so every test that needs a running stack is
here. Every store is in a temp dir, which is also the stack's project directory (its state in
``<tmp>/.ddpflow``): the MLflow SQLite store (the worker's MLFLOW_TRACKING_URI), the prepared data and the
run directories (flow-run parameter overrides). Tests keep apart by model name, run root and source.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow import MlflowClient

from ddpflow.watch import EVENT, variable_name
from devtools.ports import free_port
from devtools.waiting import wait_until
from tests.flows.script_variants import tutorial_text, with_three_lines
from tests.flows.test_mixed_inputs import INPUTS as MIXED_INPUTS
from tests.flows.test_mixed_inputs import churn_table
from tests.flows.test_run_cli import LiveRun, cli_env, write_config

pytestmark = [pytest.mark.server, pytest.mark.torchrun]  # the stack; its runs train

MODEL_NAME = "ddpflow-e2e"
MIXED_MODEL_NAME = "ddpflow-e2e-mixed"  # its own model: the gate never compares it with the numeric champion
SCRIPT_MODEL_NAME = "ddpflow-e2e-script"  # a training script's model
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_TIMEOUT_S = 420


def ddpflow(*args: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


class Stack:
    """A running stack started by `ddpflow stack up`, and how to talk to it."""

    def __init__(self, repo: Path, tmp: Path, env: dict[str, str], up: dict[str, Any]):
        self.repo, self.tmp, self.env, self.up = repo, tmp, env, up
        self.state_dir = tmp / ".ddpflow"  # tmp is a project: `ddpflow run` there finds this stack
        self.mlflow_uri = f"sqlite:///{tmp / 'mlflow' / 'mlflow.db'}"
        self.prefect_url = up["prefect_ui"]
        self.mlflow_url = up["mlflow_ui"]
        self.run_root = tmp / "runs"
        self.stack_args = ("--project", str(repo), "--state-dir", str(self.state_dir))

    @property
    def cli_env(self) -> dict[str, str]:
        """What a user's shell has after `eval "$(ddpflow stack env)"`: `stack up` says it (`--json`: its env)."""
        return {**self.env, **self.up["env"]}

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=self.repo,
            env=self.cli_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        return response.json() if response.content else None

    def request(self, method: str, path: str, attempts: int = 6, **kwargs: Any) -> httpx.Response:
        """One call of the server's API, retried on 503 as Prefect's own client retries it: the server answers 503
        while its SQLite database is busy (a loaded machine: the whole suite beside it)."""
        for attempt in range(attempts):
            response = httpx.request(method, f"{self.prefect_url}/api{path}", timeout=30, **kwargs)
            if response.status_code != 503 or attempt == attempts - 1:
                return response.raise_for_status()
            time.sleep(float(response.headers.get("Retry-After", 2**attempt)))
        raise AssertionError("unreachable")

    def deployment(self, name: str) -> dict[str, Any]:
        return self.api("GET", f"/deployments/name/train-pipeline/{name}")

    def tiny_run_params(self, *extra: str) -> str:
        """The manual deployment's own config, shrunk, with every path in the temp dir; ``extra`` overrides win."""
        overrides = [
            "data.source=synthetic://classification?rows=2000&features=8&classes=3&seed=1",
            f"data.root={self.tmp / 'shards'}",
            f"train.run_root={self.run_root}",
            "train.epochs=1",
            "train.nproc_per_node=1",  # DDP itself is tested elsewhere; this is the path through the worker
            f"registry.model_name={MODEL_NAME}",
            f"mlflow.artifact_location={self.tmp / 'mlflow' / 'mlartifacts'}",
            *extra,
        ]
        return json.dumps({"overrides": overrides})

    def submit_manual_run(self, *extra: str) -> str:
        """`prefect deployment run train-pipeline/manual`, as a user types it."""
        result = self.prefect("deployment", "run", "train-pipeline/manual", "--params", self.tiny_run_params(*extra))
        assert result.returncode == 0, result.stdout + result.stderr
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout)
        assert match, result.stdout
        return match.group(1)

    def create_flow_run(self, deployment: str, parameters: dict[str, Any]) -> str:
        """The flow run `prefect deployment run` creates, through the API: the worker runs it the same way, and no
        CLI process (4-8 s of imports) starts. For tests whose subject is not the CLI."""
        # Prefect's own client, as `prefect deployment run` uses: it retries the server's 503 ("busy": SQLite under
        # load), which a bare HTTP call saw in a loaded suite run.
        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(f"{self.prefect_url}/api") as client:
            found = client.read_deployment_by_name(deployment)
            return str(client.create_flow_run_from_deployment(found.id, parameters=parameters).id)

    def wait_for_terminal(self, flow_run_ids: list[str], timeout_s: float = RUN_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        runs: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            runs = {run_id: self.api("GET", f"/flow_runs/{run_id}") for run_id in flow_run_ids}
            if all(run["state_type"] in TERMINAL for run in runs.values()):
                return runs
            time.sleep(0.5)
        states = {run_id: (run["state_type"], run["state_name"]) for run_id, run in runs.items()}
        pytest.fail(f"flow runs not finished after {timeout_s} s: {states}; worker log: {self.log_tail('worker')}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.state_dir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"

    def mlflow_runs_by_flow_run(self) -> dict[str, Any]:
        client = MlflowClient(tracking_uri=self.mlflow_uri)
        experiments = client.search_experiments()
        runs = client.search_runs([e.experiment_id for e in experiments])
        return {run.data.tags.get("prefect.flow_run_id"): run for run in runs}

    def champion_version(self) -> str | None:
        client = MlflowClient(tracking_uri=self.mlflow_uri)
        try:
            return str(client.get_model_version_by_alias(MODEL_NAME, "champion").version)
        except Exception:
            return None

    def api_update(self, path: str, body: dict[str, Any]) -> None:
        self.request("PATCH", path, json=body)

    def recorded_pids(self) -> dict[str, int]:
        return {
            name: info["pid"]
            for name, info in json.loads((self.state_dir / "stack.json").read_text())["processes"].items()
        }


@pytest.fixture(scope="module")
def stack(repo_root: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("stack")
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # A queued run (collision strategy ENQUEUE) retries for a slot after this; default 30 s.
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    args = ("--project", str(repo_root), "--state-dir", str(tmp / ".ddpflow"), "--mlflow-dir", str(tmp / "mlflow"))
    result = ddpflow(
        "stack",
        "up",
        *args,
        "--prefect-port",
        str(free_port()),
        "--mlflow-port",
        str(free_port()),
        "--json",
        env=env,
        cwd=repo_root,
    )
    assert result.returncode == 0, f"stack up failed:\n{result.stdout}\n{result.stderr}"
    running = Stack(repo_root, tmp, env, json.loads(result.stdout))
    try:
        assert running.up["env"] == {  # `ddpflow stack env`'s: what a user's shell needs for `prefect`
            "PREFECT_HOME": str(tmp / ".ddpflow" / "prefect"),
            "PREFECT_API_URL": f"{running.prefect_url}/api",
        }
        yield running
    finally:
        try:
            stack_down_leaves_no_process_alive(running)
        finally:
            ddpflow("stack", "down", *running.stack_args, env=env, cwd=repo_root, timeout=120)  # a no-op if down


def stack_down_leaves_no_process_alive(stack: Stack) -> None:
    """`ddpflow stack down`, checked where it runs: at the end of the module, whatever order the tests ran in
    (a failure here shows as an error at the last test's teardown)."""
    pids = stack.recorded_pids()
    assert set(pids) == {"prefect-server", "mlflow", "worker"}
    # Children too (uvicorn/gunicorn workers, flow-run processes).
    family = {pid: [c.pid for c in psutil.Process(pid).children(recursive=True)] for pid in pids.values()}
    result = ddpflow("stack", "down", *stack.stack_args, "--json", env=stack.env, cwd=stack.repo, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["stopped"]) == ["mlflow", "prefect-server", "worker"]
    survivors = [
        pid
        for parent, children in family.items()
        for pid in (parent, *children)
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert survivors == []
    assert not (stack.state_dir / "stack.json").exists()
    status = json.loads(ddpflow("stack", "status", *stack.stack_args, "--json", env=stack.env, cwd=stack.repo).stdout)
    assert status["running"] is False


def test_deploy_all_creates_both_deployments_from_prefect_yaml(stack: Stack) -> None:
    nightly, manual = stack.deployment("nightly"), stack.deployment("manual")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["schedules"][0]["schedule"]["timezone"] == "UTC"
    assert nightly["schedules"][0]["active"] is True
    assert manual["schedules"] == []
    for deployment, strategy in ((nightly, "CANCEL_NEW"), (manual, "ENQUEUE")):
        assert deployment["work_pool_name"] == "ddpflow-local"
        assert deployment["entrypoint"] == "flows/pipeline.py:train_pipeline"
        assert deployment["global_concurrency_limit"]["limit"] == 1
        assert deployment["concurrency_options"]["collision_strategy"] == strategy
        # `{{ $PWD }}` is rendered at deploy time into the project root.
        assert deployment["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(stack.repo)}}
        ]
    assert nightly["parameters"] == {"config_file": "configs/nightly.yaml"}
    assert manual["parameters"] == {"config_file": "configs/manual.yaml"}


def test_deploy_all_again_updates_in_place(stack: Stack) -> None:
    before = stack.deployment("nightly")
    result = stack.prefect("--no-prompt", "deploy", "--all")
    assert result.returncode == 0, result.stdout + result.stderr
    after = stack.deployment("nightly")
    assert after["id"] == before["id"]
    assert [s["slug"] for s in after["schedules"]] == ["nightly-0200-utc"]


def mixed_table_overrides(running: Stack) -> tuple[str, ...]:
    """A small mixed table (numeric, 3 categoricals, a hashed id, a vector) as a Parquet file, and the
    ``data.inputs`` override that names its inputs, as a user passes them in the deployment's parameters."""
    source = running.tmp / "churn.parquet"
    pq.write_table(churn_table(rows=600), source)
    return (
        f"data.source={source}",
        "data.label=churned",
        "data.key=customer_id",
        f"data.inputs={json.dumps(MIXED_INPUTS)}",
        f"registry.model_name={MIXED_MODEL_NAME}",
        "train.epochs=5",  # 600 rows, 1 rank: one epoch of the default settings does not beat guessing (the gate)
        "train.lr=0.01",
    )


def test_two_manual_runs_at_once_complete_in_turn_and_register_models(stack: Stack) -> None:
    """`prefect deployment run` x2 through the worker: the limit queues the second, each keeps its own files.
    The second trains the mixed table (typed inputs train through a deployment) on the inputs its parameters
    name."""
    flow_run_ids = [stack.submit_manual_run(), stack.submit_manual_run(*mixed_table_overrides(stack))]
    runs = stack.wait_for_terminal(flow_run_ids, timeout_s=2 * RUN_TIMEOUT_S)
    failed = {
        run["name"]: (run["state_name"], (run["state"] or {}).get("message"))
        for run in runs.values()
        if run["state_type"] != "COMPLETED"
    }
    assert not failed, f"{failed}\n{stack.log_tail('worker')}"
    # `manual` is ENQUEUE with limit 1: none is cancelled, they run one after another.
    spans = sorted((run["start_time"], run["end_time"]) for run in runs.values())
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:])), f"runs overlapped: {spans}"

    # One MLflow run per flow run, each FINISHED, with its artifacts in the temp store (not the project).
    mlflow_runs = stack.mlflow_runs_by_flow_run()
    ours = [mlflow_runs[run_id] for run_id in flow_run_ids]
    assert len({run.info.run_id for run in ours}) == 2
    assert all(run.info.status == "FINISHED" and str(stack.tmp) in run.info.artifact_uri for run in ours)
    # Each run got its own directory, with its own model.
    run_dirs = [d for d in stack.run_root.iterdir() if d.is_dir()]
    assert len(run_dirs) == 2 and all((d / "model.pt").is_file() and (d / "config.json").is_file() for d in run_dirs)
    # The registry has new versions, each from one of these runs, and a champion.
    client = MlflowClient(tracking_uri=stack.mlflow_uri)
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert versions and {v.run_id for v in versions} <= {run.info.run_id for run in ours}
    assert client.get_model_version_by_alias(MODEL_NAME, "champion").run_id in {run.info.run_id for run in ours}
    assert_trained_on_the_mixed_inputs(stack, ours[1].info.run_id)


def assert_trained_on_the_mixed_inputs(running: Stack, mlflow_run_id: str) -> None:
    """The mixed run's champion takes the raw mixed columns: its signature is the inputs the parameters named."""
    import mlflow
    from mlflow.types import DataType

    from ddpflow.tracking.runs import use_tracking_uri

    champion = MlflowClient(tracking_uri=running.mlflow_uri).get_model_version_by_alias(MIXED_MODEL_NAME, "champion")
    assert champion.run_id == mlflow_run_id
    with use_tracking_uri(running.mlflow_uri):
        schema = mlflow.models.get_model_info(f"models:/{MIXED_MODEL_NAME}@champion").signature.inputs
    assert sorted(schema.input_names()) == sorted(MIXED_INPUTS)
    types = {spec.name: spec.type for spec in schema.inputs}
    assert types["country"] == DataType.string and types["merchant_id"] == DataType.string
    assert types["tenure"] == DataType.double and "Array" in str(types["embedding"])


def wait_for_training(run_root: Path, within_s: float = 180) -> tuple[Path, list[int]]:
    """The run directory once an epoch is done, and every PID of the run: the flow-run process
    (launcher), torchrun, its ranks and anything below them."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for pid_file in run_root.glob("*/torchrun.pid"):
            metrics = pid_file.parent / "metrics.jsonl"
            if not (metrics.is_file() and metrics.read_text().strip()):
                continue
            record = json.loads(pid_file.read_text())
            try:
                below = [p.pid for p in psutil.Process(record["torchrun_pid"]).children(recursive=True)]
            except psutil.NoSuchProcess:
                below = []
            return pid_file.parent, sorted(
                {record["launcher_pid"], record["torchrun_pid"], *record["descendants"], *below}
            )
        time.sleep(0.5)
    pytest.fail(f"no training under way in {run_root} after {within_s} s")


def still_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_training_script_runs_through_the_manual_deployment_like_any_config(stack: Stack) -> None:
    """`prefect deployment run train-pipeline/manual --params '{"config_file": ...}'` with a config whose
    train.script is a user's own DDP script (with ddpflow's three lines): the worker runs it on 2 ranks, its MLflow
    run names the script, and its model becomes the champion."""
    project = stack.tmp / "script-project"
    project.mkdir()
    (project / "tracked.py").write_text(with_three_lines(tutorial_text()))
    config = {
        "train": {
            "script": str(project / "tracked.py"),
            "script_args": ["2", "1", "--snapshot_path", str(project / "snapshot.pt")],
            "nproc_per_node": 2,
            "run_root": str(stack.run_root / "scripts"),
        },
        "registry": {"model_name": SCRIPT_MODEL_NAME},
        "mlflow": {"artifact_location": str(stack.tmp / "mlflow" / "mlartifacts")},
    }
    (project / "script.yaml").write_text(yaml.safe_dump(config))
    params = json.dumps({"config_file": str(project / "script.yaml")})
    result = stack.prefect("deployment", "run", "train-pipeline/manual", "--params", params)
    assert result.returncode == 0, result.stdout + result.stderr
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout).group(1)
    (run,) = stack.wait_for_terminal([flow_run_id]).values()
    assert run["state_type"] == "COMPLETED", f"{run['state']}\n{stack.log_tail('worker')}"
    mlflow_run = stack.mlflow_runs_by_flow_run()[flow_run_id]
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["train.script"] == str(project / "tracked.py")
    assert [m.step for m in MlflowClient(stack.mlflow_uri).get_metric_history(mlflow_run.info.run_id, "test_mse")] == [
        0,
        1,
    ]
    champion = MlflowClient(tracking_uri=stack.mlflow_uri).get_model_version_by_alias(SCRIPT_MODEL_NAME, "champion")
    assert champion.run_id == mlflow_run.info.run_id


def test_cancelling_a_worker_run_kills_every_process_and_keeps_the_champion(stack: Stack) -> None:
    """`prefect flow-run cancel` on a deployment run that is training (2 ranks) under the process worker."""
    client = MlflowClient(tracking_uri=stack.mlflow_uri)
    champion_before = stack.champion_version()
    run_root = stack.tmp / "runs-cancelled"
    parameters = stack.tiny_run_params(
        "data.source=synthetic://classification?rows=20000&features=8&classes=3&seed=2",
        f"train.run_root={run_root}",
        "train.epochs=1000",  # far more than the test waits for: only the cancel can end it
        "train.early_stopping_patience=null",  # not early stopping either
        "train.nproc_per_node=2",
        "train.batch_size=64",
    )
    flow_run_id = stack.create_flow_run("train-pipeline/manual", json.loads(parameters))
    run_dir, pids = wait_for_training(run_root)
    assert len(pids) >= 4, pids  # the flow-run process, torchrun, 2 ranks

    result = stack.prefect("flow-run", "cancel", flow_run_id)
    assert result.returncode == 0, result.stdout + result.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        still_alive(pids) or stack.api("GET", f"/flow_runs/{flow_run_id}")["state_type"] != "CANCELLED"
    ):
        time.sleep(0.5)
    run = stack.api("GET", f"/flow_runs/{flow_run_id}")
    assert run["state_type"] == "CANCELLED", (run["state_name"], stack.log_tail("worker"))
    assert still_alive(pids) == [], stack.log_tail("worker")

    assert not (run_dir / "model.pt").exists() and (run_dir / "checkpoints" / "last.pt").is_file()
    assert stack.champion_version() == champion_before
    mlflow_run = stack.mlflow_runs_by_flow_run()[flow_run_id]
    assert mlflow_run.info.status == "KILLED"  # stopped from outside, not a failure
    assert client.search_model_versions(f"name='{MODEL_NAME}' and run_id='{mlflow_run.info.run_id}'") == []


# --- new data starts a training: watch-data, its event, the deployment trigger ----------------------
# `watch-data/every-10-minutes` runs three times through the worker, on an unseen source (recorded, no event),
# the same source (no event), and the source with rows appended (`ddpflow.data.changed`); the deployment
# trigger of `train-pipeline/on-new-data` then starts exactly one training, with that config, which completes.

WATCH_MODEL_NAME = "ddpflow-watch-e2e"
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
        "registry": {"model_name": WATCH_MODEL_NAME},
        "mlflow": {"artifact_location": str(running.tmp / "mlflow" / "mlartifacts")},
    }
    path = running.tmp / "watched.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_watch(running: Stack, config_file: Path) -> dict[str, Any]:
    flow_run_id = running.create_flow_run("watch-data/every-10-minutes", {"config_file": str(config_file)})
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
    # The run saw "unchanged": it writes the variable only on a change (a first look or new data).
    assert stack.api("GET", f"/variables/name/{variable}")["value"] == first_seen
    # That it emitted nothing, and nothing was started, is checked below, once the appended rows' event has
    # arrived and its training has finished: an event from this earlier run would have arrived by then too.

    write_rows(source, 50, seed=1)  # new rows land
    run_watch(stack, config_file)
    try:
        triggered = wait_until(lambda: flow_runs_of(stack, on_new_data["id"]), TRIGGER_WAIT_S, "the trigger's run")
    except TimeoutError as error:
        pytest.fail(f"{error}: no training started by the trigger: {stack.log_tail('prefect-server')}")
    assert len(triggered) == 1, triggered
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
    versions = MlflowClient(tracking_uri=stack.mlflow_uri).search_model_versions(f"name='{WATCH_MODEL_NAME}'")
    assert [v.run_id for v in versions] == [mlflow_run.info.run_id]
    assert [run["id"] for run in flow_runs_of(stack, on_new_data["id"])] == [training["id"]]  # one event, one run


# --- `ddpflow run` in the stack's project uses the stack's server ----------------------------------


def test_run_uses_the_projects_running_stack_and_starts_no_server(make_config, stack: Stack) -> None:
    """`ddpflow run` in a project whose stack is up (its stack.json in <project>/.ddpflow) runs the flow on the
    stack's Prefect server and starts no server of its own."""
    project, prefect_api_url = stack.tmp, f"{stack.prefect_url}/api"
    config = make_config()
    run = LiveRun(
        # One epoch: what is checked is which server the run uses and what it starts.
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            write_config(project, config),
            "--set",
            "train.epochs=1",
            "--json",
        ],
        project,
        cli_env(),  # no PREFECT_API_URL
    )
    started_by_the_run: set[str] = set()
    try:
        while run.popen.poll() is None:  # everything the run starts, while it runs
            try:
                started_by_the_run |= {
                    " ".join(child.cmdline()) for child in psutil.Process(run.popen.pid).children(recursive=True)
                }
            except psutil.Error:
                pass
            time.sleep(0.5)
        assert run.finish() == 0, run.output[-4000:]
    finally:
        run.kill()
    assert any("ddpflow.launch.agent" in argv for argv in started_by_the_run), "the scan must see torchrun"
    assert [argv for argv in started_by_the_run if "uvicorn" in argv or " server start" in argv] == []

    summary = json.loads("".join(run.out))  # stdout holds only the summary
    assert summary["prefect_server"] == "stack" and summary["prefect_api_url"] == prefect_api_url
    flow_run = httpx.get(f"{prefect_api_url}/flow_runs/{summary['flow_run_id']}", timeout=30).json()
    assert flow_run["state_type"] == "COMPLETED" and flow_run["name"] == summary["flow_run"]
    assert summary["prefect_run_url"] == f"{stack.prefect_url}/runs/flow-run/{summary['flow_run_id']}"


def test_both_uis_answer(stack: Stack) -> None:
    for url in (stack.prefect_url, stack.mlflow_url):
        response = httpx.get(url, timeout=30, follow_redirects=True)
        assert response.status_code == 200, url
        assert "<html" in response.text.lower()
    # The UI's scripts call the API where the server says it is: this stack's port, not 4200.
    assert httpx.get(f"{stack.prefect_url}/ui-settings", timeout=30).json()["api_url"] == f"{stack.prefect_url}/api"
    status = ddpflow("stack", "status", *stack.stack_args, "--json", env=stack.env, cwd=stack.repo)
    summary = json.loads(status.stdout)
    assert summary["running"] and summary["prefect_healthy"] and summary["mlflow_healthy"]


def test_the_stack_listens_on_loopback_only(stack: Stack) -> None:
    """Nothing the stack started accepts connections from other machines."""
    listening = []
    for pid in stack.recorded_pids().values():
        root = psutil.Process(pid)
        for proc in (root, *root.children(recursive=True)):
            try:
                listening += [
                    (proc.pid, conn.laddr.ip, conn.laddr.port)
                    for conn in proc.net_connections(kind="inet")
                    if conn.status == psutil.CONN_LISTEN
                ]
            except psutil.NoSuchProcess:
                pass
    assert listening, "no listening socket found: the scan is broken"
    assert [entry for entry in listening if entry[1] not in ("127.0.0.1", "::1")] == []


# --- batch scoring through the deployments: score-nightly and the new-champion trigger ---------------
# A scoring project (what a user's checkout holds for it: configs/score.yaml as shipped, flows/, and data/) that the
# two score-pipeline deployments run in, as if deployed from it (their working directory, the only change): the
# shipped config's relative source and output, and the trigger's relative output, land in it. ONE launch of every
# run (`scoring_runs`), checked by two tests: the project's model (configs/score.yaml's registry.model_name)
# promoted by the register task in a process of its own, whose event starts score-on-new-champion; and
# score-nightly on the project's table, an image folder and a text table, each with its own model's @champion.
# They run beside one another on the worker (score-nightly's runs one after another: its concurrency limit).

SCORE_DEPLOYMENTS = ("score-nightly", "score-on-new-champion")
TODAY_FILES, TODAY_ROWS = 3, 200  # data/today/: 3 files, so both ranks of the shipped config score
REGISTER_CHAMPION = Path(__file__).resolve().parent / "register_champion.py"
NIGHTLY_KINDS = {  # scored by score-nightly with overrides: (model, source in the project, the model's data.key)
    "images": ("ddpflow-e2e-images", "data/images/", "path"),
    "reviews": ("ddpflow-e2e-reviews", "data/reviews.parquet", "id"),
}


def scoring_model_config(running: Stack, model_name: str, **data: Any):
    from training.core.config import PipelineConfig

    return PipelineConfig.model_validate({
        "data": data, "registry": {"model_name": model_name, "metric": "test_accuracy"},
        "mlflow": {"tracking_uri": running.mlflow_uri, "experiment": "ddpflow-e2e-scoring",
                   "artifact_location": str(running.tmp / "mlflow" / "mlartifacts")},
    })  # fmt: skip


def prepared(settings: list[str]) -> Path:
    from training.core.config import load_config
    from training.prepare.dataset import prepare_dataset

    return prepare_dataset(load_config(None, settings).data).dataset_dir


def pipeline_run(running: Stack, model_name: str, dataset: Path, **data: Any) -> tuple[Any, str]:
    """(the config, the MLflow run) of a pipeline run that trained on ``dataset``: what the register task gates."""
    from ddpflow.tracking.runs import start_pipeline_run
    from tests.ddpflow.tracking.test_registry import DDP, PREFECT
    from training.core.manifest import read_manifest

    config = scoring_model_config(running, model_name, **data)
    manifest = read_manifest(dataset)
    return config, start_pipeline_run(config, model_name, PREFECT, manifest.fingerprint, manifest, DDP, dataset)


def register_here(running: Stack, model_name: str, dataset: Path, model_path: Path) -> str:
    """An untrained model of the dataset's inputs (image_cnn, transformer) registered as NAME@champion in the
    stack's MLflow, through the gate (no event): its version."""
    from ddpflow.tracking.registration import register_candidate
    from tests.flows.test_batch_scoring import untrained_model

    model_path.parent.mkdir(parents=True)
    untrained_model(dataset, model_path)
    config, run_id = pipeline_run(running, model_name, dataset)
    decision = register_candidate(config, run_id, str(model_path), str(dataset), {"test_accuracy": 0.9},
                                  running.mlflow_uri)  # fmt: skip
    assert decision.decision == "promoted", decision
    return str(decision.version)


def register_in_a_flow(running: Stack, work: Path) -> dict[str, Any]:
    """The project's model (ddpflow-demo: a quick model of the churn table, data.key customer_id) through the
    register task in a process of its own, which emits ddpflow.champion.moved, after the event of another model's
    promotion, which the project's trigger must not follow: the register task's decision."""
    from tests.manifest_datasets import train_typed_model
    from training.inference.evaluate import evaluate_split

    pq.write_table(churn_table(rows=600, seed=0), work / "churn.parquet")
    data = {"source": str(work / "churn.parquet"), "root": str(work / "churn-shards"), "label": "churned",
            "key": "customer_id", "inputs": MIXED_INPUTS}  # fmt: skip
    dataset = prepared([f"data.{key}={json.dumps(value) if key == 'inputs' else value}" for key, value in data.items()])
    model_path = train_typed_model(dataset, work / "churn" / "model.pt", steps=100, lr=0.01)
    config, run_id = pipeline_run(running, "ddpflow-demo", dataset, **data)
    request = {"config": config.model_dump(mode="json"), "run_id": run_id, "model_path": str(model_path),
               "dataset": str(dataset), "metrics": evaluate_split(model_path, dataset).metrics,
               "tracking_uri": running.mlflow_uri, "other_model": "ddpflow-e2e-other"}  # fmt: skip
    registered = subprocess.run([sys.executable, str(REGISTER_CHAMPION), json.dumps(request)], cwd=running.repo,
                                env=running.cli_env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert registered.returncode == 0, registered.stderr[-4000:]
    return json.loads(registered.stdout.strip().splitlines()[-1])


def scoring_project_dir(running: Stack) -> tuple[Path, pa.Table]:
    """The project: configs/score.yaml as shipped, flows/, data/today/ (the churn table in 3 files), data/images/
    (an image folder), data/reviews.parquet (a text table); (its directory, today's table)."""
    from image_data import write_image_folder

    project = running.tmp / "scoring-project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "score.yaml").write_text((running.repo / "configs" / "score.yaml").read_text())
    (project / "flows").symlink_to(running.repo / "flows")
    (project / "data" / "today").mkdir(parents=True)
    table = churn_table(rows=TODAY_FILES * TODAY_ROWS, seed=5)
    for index in range(TODAY_FILES):
        pq.write_table(table.slice(index * TODAY_ROWS, TODAY_ROWS), project / "data" / "today" / f"day-{index}.parquet")
    write_image_folder(project / "data" / "images", per_class=5, size=12)
    pq.write_table(review_table(60).slice(0, 45), project / "data" / "reviews.parquet")
    return project, table


def review_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    words = np.array(["late", "parcel", "great", "broken", "fast", "refund", "thanks", "never", "again"])
    return pa.table({"id": np.arange(rows, dtype=np.int64) + 500,
                     "review": [" ".join(rng.choice(words, size=rng.integers(2, 9))) for _ in range(rows)],
                     "colour": ["red", "blue"] * (rows // 2), "stars": rng.integers(1, 6, size=rows)})  # fmt: skip


@pytest.fixture(scope="module")
def scoring_runs(stack: Stack):
    """Every scoring run of the project, launched once: the image and text models registered and their nightly
    runs submitted first (they score while the project's model trains), then the project's model registered
    through the register task (its event: the trigger's run), then `prefect deployment run
    score-pipeline/score-nightly` as a user types it (the shipped config: ddpflow-demo@champion on data/today/)."""
    from image_data import write_image_folder

    project, table = scoring_project_dir(stack)
    deployed = {name: stack.api("GET", f"/deployments/name/score-pipeline/{name}") for name in SCORE_DEPLOYMENTS}
    for deployment in deployed.values():  # as if deployed from the project: `prefect deploy` renders {{ $PWD }}
        steps = [{"prefect.deployments.steps.set_working_directory": {"directory": str(project)}}]
        stack.api_update(f"/deployments/{deployment['id']}", {"pull_steps": steps})
    try:
        work = stack.tmp / "scoring-models"
        work.mkdir()
        pq.write_table(review_table(60), work / "reviews.parquet")
        inputs = json.dumps({"review": {"kind": "text", "tokenizer": {"vocab_size": 40}}, "colour": "categorical"})
        datasets = {
            "images": prepared([f"data.source={write_image_folder(work / 'shapes', per_class=6, size=12)}",
                                f"data.root={work / 'shards'}"]),
            "reviews": prepared([f"data.source={work / 'reviews.parquet'}", f"data.root={work / 'shards'}",
                                 "data.label=stars", "data.key=id", f"data.inputs={inputs}"]),
        }  # fmt: skip
        versions, nightly = {}, {}
        for kind, (model_name, source, _key) in NIGHTLY_KINDS.items():
            versions[kind] = register_here(stack, model_name, datasets[kind], work / kind / "model.pt")
            overrides = [f"registry.model_name={model_name}", f"score.source={source}",
                         f"score.output=data/scores/{kind}", "score.nproc_per_node=1"]  # fmt: skip
            nightly[kind] = stack.create_flow_run("score-pipeline/score-nightly", {"overrides": overrides})
        decision = register_in_a_flow(stack, work)
        result = stack.prefect("deployment", "run", "score-pipeline/score-nightly")
        assert result.returncode == 0, result.stdout + result.stderr
        nightly["today"] = re.search(r"UUID:\s*([0-9a-f-]{36})", result.stdout).group(1)
        yield {"dir": project, "table": table, "versions": versions, "decision": decision, "nightly": nightly,
               "deployments": deployed}  # fmt: skip
    finally:
        for deployment in deployed.values():
            stack.api_update(f"/deployments/{deployment['id']}", {"pull_steps": deployment["pull_steps"]})


def scores_in(output: Path) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(part) for part in sorted(output.glob("part-*.parquet"))], ignore_index=True)


def assert_completed(running: Stack, runs: dict[str, dict[str, Any]]) -> None:
    failed = {run["name"]: (run["state_name"], (run["state"] or {}).get("message")) for run in runs.values()
              if run["state_type"] != "COMPLETED"}  # fmt: skip
    assert not failed, f"{failed}\n{running.log_tail('worker', 80)}"


def test_a_new_champion_of_the_projects_model_scores_the_table_once_through_the_trigger(
    stack: Stack, scoring_runs: dict
) -> None:
    """The register task promoted the project's first model (ddpflow-demo v1) and emitted ddpflow.champion.moved;
    score-on-new-champion's trigger starts ONE run, with that version, into data/scores/ddpflow-demo-v1 of the
    project, on the shipped config's ranks (auto: 1 on a machine without GPUs): every row once, the model's key
    kept (no score.keep anywhere). A promotion of another model (emitted first) starts none: the project's source
    is not its input."""
    project, table, decision = scoring_runs["dir"], scoring_runs["table"], scoring_runs["decision"]
    assert (decision["decision"], decision["version"]) == ("promoted", "1"), decision
    on_new_champion = scoring_runs["deployments"]["score-on-new-champion"]
    try:
        triggered = wait_until(lambda: flow_runs_of(stack, on_new_champion["id"]), TRIGGER_WAIT_S, "the trigger's run")
    except TimeoutError as error:
        pytest.fail(f"{error}: no scoring started by the trigger: {stack.log_tail('prefect-server')}")
    runs = stack.wait_for_terminal([run["id"] for run in triggered])
    assert_completed(stack, runs)
    (run,) = runs.values()
    # The event's version and output over the deployment's config_file.
    assert run["parameters"] == {"config_file": "configs/score.yaml", "model": "ddpflow-demo/1",
                                 "output": "data/scores/ddpflow-demo-v1"}  # fmt: skip
    output = project / "data" / "scores" / "ddpflow-demo-v1"
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["model"] == {"name": "ddpflow-demo", "version": "1", "uri": "models:/ddpflow-demo/1"}
    assert manifest["rows"] == manifest["scored"] == TODAY_FILES * TODAY_ROWS and manifest["world_size"] == 1
    assert manifest["keep"] == ["customer_id"]  # the model's data.key: configs/score.yaml keeps nothing else
    assert manifest["source"]["url"] == str(project / "data" / "today")  # the project's, not the checkout's
    assert scores_in(output)["customer_id"].tolist() == table["customer_id"].to_pylist()  # every row once
    # The other model's event, emitted first, started nothing (nor did the module's earlier promotions).
    assert [run["id"] for run in flow_runs_of(stack, on_new_champion["id"])] == [run["id"]]


def test_score_nightly_scores_a_table_an_image_folder_and_a_text_table_through_the_worker(
    stack: Stack, scoring_runs: dict
) -> None:
    """score-pipeline/score-nightly through the worker: with no parameters (`prefect deployment run`), the shipped
    configs/score.yaml on the project's table with ddpflow-demo@champion; with overrides (relative paths: the
    project's), an image folder and a text table, each scored by its own model's @champion, keeping its key."""
    project, versions = scoring_runs["dir"], scoring_runs["versions"]
    runs = stack.wait_for_terminal(list(scoring_runs["nightly"].values()))
    assert_completed(stack, runs)
    scores = project / "data" / "scores"
    today = json.loads((scores / "today" / "manifest.json").read_text())
    assert today["model"] == {"name": "ddpflow-demo", "version": "1", "uri": "models:/ddpflow-demo@champion"}
    assert today["rows"] == TODAY_FILES * TODAY_ROWS and today["output_kind"] == "probabilities"
    nightly = scores_in(scores / "today")
    assert nightly["customer_id"].tolist() == scoring_runs["table"]["customer_id"].to_pylist()
    if (scores / "ddpflow-demo-v1" / "manifest.json").is_file():  # the trigger's run: the same version's scores
        pd.testing.assert_frame_equal(nightly, scores_in(scores / "ddpflow-demo-v1"))
    images = project / "data" / "images"
    expected_keys = {
        "images": sorted(path.relative_to(images).as_posix() for path in images.rglob("*.png")),
        "reviews": list(range(500, 545)),
    }
    for kind, (model_name, _source, key) in NIGHTLY_KINDS.items():
        manifest = json.loads((scores / kind / "manifest.json").read_text())
        assert manifest["model"]["name"] == model_name and manifest["model"]["version"] == versions[kind]
        assert manifest["keep"] == [key] and manifest["rows"] == len(expected_keys[kind])
        scored = scores_in(scores / kind)
        assert scored[key].tolist() == expected_keys[kind], kind  # every image / review once, in order
        probabilities = scored[[name for name in scored.columns if name.startswith("probability_")]]
        assert probabilities.shape[1] >= 2 and np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
