"""The local stack: Prefect server, work pool, deployments, worker, MLflow server (plain Python).

    up(project)             start all on 127.0.0.1, deploy prefect.yaml   (`ddpflow stack up`)
    status(project)         what runs, and where                          (`ddpflow stack status`)
    down(project)           stop exactly what `up` started                (`ddpflow stack down`)
    running_prefect_api()   the stack's Prefect API if it answers: `ddpflow run` uses it
    shell_env(project)      PREFECT_HOME and PREFECT_API_URL for a shell's `prefect` (`ddpflow stack env`)

The command line (flows/cli.py) parses the arguments and prints; nothing here does either.

Everything binds to loopback. State lives in the project:

    .ddpflow/prefect/      PREFECT_HOME, with the server's SQLite database
    .ddpflow/logs/         one log per process
    .ddpflow/stack.json    PIDs, ports and URLs of what `up` started
    mlflow.db, mlartifacts/   the MLflow store: the same one `ddpflow run`
                              uses by default, so local and scheduled runs
                              share one registry (and one champion)

The worker runs flows with ``MLFLOW_TRACKING_URI=sqlite:///<project>/mlflow.db``,
the very file the MLflow server shows. Flows write to it directly (as
``ddpflow run`` does), so experiments keep plain-path artifact locations that
every client can read; through the server's HTTP API a new experiment would get
an ``mlflow-artifacts:/`` location that a SQLite client cannot resolve, and a
later ``ddpflow run`` without the stack could not log into it.
Processes are started from argument lists (no shell) in their own session,
so a Ctrl-C in the terminal that ran ``up`` does not reach them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddpflow.launch.process_tree import session_members, stop_processes
from training.core.fileio import atomic_write_text

HOST = "127.0.0.1"
WORK_POOL = "ddpflow-local"
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000
# Under CPU load a cold Prefect server takes 5-30 s to answer.
READY_TIMEOUT_S = 120.0
# Worker poll interval: run latency through a worker is mostly this.
WORKER_QUERY_SECONDS = "2"
# Stop order: the worker first (it hands runs back), then the servers.
STOP_ORDER = ("worker", "mlflow", "prefect-server")


class StackError(RuntimeError):
    """The stack could not be started or stopped; the message says which part."""


@dataclass(frozen=True)
class StackLayout:
    """Where one stack keeps its state; tests point it at a temp dir."""

    project: Path
    state_dir: Path
    mlflow_dir: Path

    @classmethod
    def for_project(
        cls, project: str | Path, state_dir: str | Path | None = None, mlflow_dir: str | Path | None = None
    ) -> StackLayout:
        project = Path(project).resolve()
        return cls(
            project=project,
            state_dir=Path(state_dir).resolve() if state_dir else project / ".ddpflow",
            mlflow_dir=Path(mlflow_dir).resolve() if mlflow_dir else project,
        )

    @property
    def prefect_home(self) -> Path:
        return self.state_dir / "prefect"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def stack_file(self) -> Path:
        return self.state_dir / "stack.json"

    @property
    def mlflow_backend_uri(self) -> str:
        return f"sqlite:///{self.mlflow_dir / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.mlflow_dir / "mlartifacts"


@dataclass
class StackState:
    """What `up` started: written to stack.json after every process it starts."""

    prefect_url: str
    mlflow_url: str
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_url}/api"

    def to_json(self) -> str:
        return json.dumps(
            {"prefect_url": self.prefect_url, "mlflow_url": self.mlflow_url, "processes": self.processes}, indent=2
        )

    @classmethod
    def read(cls, path: Path) -> StackState | None:
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(prefect_url=raw["prefect_url"], mlflow_url=raw["mlflow_url"], processes=raw.get("processes", {}))

    def write(self, path: Path) -> None:
        atomic_write_text(path, self.to_json())  # a half-written stack.json would lose PIDs


def base_env(layout: StackLayout) -> dict[str, str]:
    """Environment for every stack process: state in the project, no telemetry."""
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(layout.prefect_home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONUNBUFFERED="1",
        # prefect.yaml's pull step is `set_working_directory: {{ $PWD }}`, which
        # `prefect deploy` renders from this variable: a shell sets it, Popen's
        # cwd= does not.
        PWD=str(layout.project),
    )
    return env


def client_env(layout: StackLayout, state: StackState) -> dict[str, str]:
    """Environment for Prefect CLI calls against this stack's server."""
    return {**base_env(layout), "PREFECT_API_URL": state.prefect_api_url}


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: connections in TIME_WAIT from a stack that just
        # stopped do not make the port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log: Path, lines: int = 20) -> str:
    if not log.is_file():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def start_process(
    name: str, argv: list[str], layout: StackLayout, env: Mapping[str, str], state: StackState
) -> psutil.Process:
    """Start one stack process in its own session, log to .ddpflow/logs/<name>.log, record its PID."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.logs / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            argv,
            cwd=layout.project,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    process = psutil.Process(popen.pid)
    # create_time guards `down` against a PID the OS has since reused.
    state.processes[name] = {"pid": popen.pid, "create_time": process.create_time(), "argv": argv, "log": str(log_path)}
    state.write(layout.stack_file)
    return process


def wait_until_ready(
    name: str, url: str, process: psutil.Process, log: Path, timeout_s: float = READY_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            raise StackError(f"{name} exited before {url} answered; last lines of {log}:\n{_log_tail(log)}")
        if http_ok(url):
            return
        time.sleep(0.5)
    raise StackError(f"{name} did not answer {url} within {timeout_s:.0f} s; see {log}")


def run_cli(argv: list[str], layout: StackLayout, env: Mapping[str, str], what: str) -> str:
    """Run a short Prefect CLI command to completion; its output goes to the logs too."""
    result = subprocess.run(argv, cwd=layout.project, env=dict(env), capture_output=True, text=True, timeout=300)
    layout.logs.mkdir(parents=True, exist_ok=True)
    with (layout.logs / "cli.log").open("a") as log:
        log.write(f"$ {' '.join(argv)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        output = f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        raise StackError(f"{what} failed (exit {result.returncode}): {' '.join(argv)}\n{output}")
    return result.stdout


def prefect_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def ensure_work_pool(layout: StackLayout, env: Mapping[str, str], pool: str = WORK_POOL) -> None:
    """Create the process work pool unless it exists (keeps settings made in the UI)."""
    inspect = subprocess.run(
        prefect_argv("work-pool", "inspect", pool),
        cwd=layout.project,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if inspect.returncode == 0:
        return
    run_cli(prefect_argv("work-pool", "create", pool, "--type", "process"), layout, env, f"creating work pool {pool}")


def deploy_all(layout: StackLayout, env: Mapping[str, str]) -> str:
    """`prefect --no-prompt deploy --all` from the project's prefect.yaml."""
    if not (layout.project / "prefect.yaml").is_file():
        raise StackError(f"{layout.project / 'prefect.yaml'} does not exist")
    return run_cli(prefect_argv("--no-prompt", "deploy", "--all"), layout, env, "prefect deploy --all")


def up(
    project: str | Path = ".",
    *,
    prefect_port: int = DEFAULT_PREFECT_PORT,
    mlflow_port: int = DEFAULT_MLFLOW_PORT,
    state_dir: str | Path | None = None,
    mlflow_dir: str | Path | None = None,
    worker_env: Mapping[str, str] | None = None,
) -> StackState:
    """Start server + MLflow, create the pool, deploy, start the worker. On failure, stop what started."""
    layout = StackLayout.for_project(project, state_dir, mlflow_dir)
    existing = StackState.read(layout.stack_file)
    if existing and any(_alive(info) for info in existing.processes.values()):
        raise StackError(f"a stack is already running (see {layout.stack_file}); run `ddpflow stack down` first")
    for name, port in (("Prefect server", prefect_port), ("MLflow server", mlflow_port)):
        if not port_is_free(port):
            raise StackError(
                f"port {port} on {HOST} for the {name} is in use; pick another with --prefect-port/--mlflow-port"
            )

    layout.prefect_home.mkdir(parents=True, exist_ok=True)
    layout.mlflow_artifacts.mkdir(parents=True, exist_ok=True)
    state = StackState(prefect_url=f"http://{HOST}:{prefect_port}", mlflow_url=f"http://{HOST}:{mlflow_port}")
    state.write(layout.stack_file)
    try:
        _start_all(layout, state, prefect_port, mlflow_port, worker_env or {})
    except BaseException:
        down(project, state_dir=state_dir)
        raise
    return state


def prefect_server_argv(port: int) -> list[str]:
    return prefect_argv("server", "start", "--host", HOST, "--port", str(port))


def mlflow_server_argv(layout: StackLayout, port: int) -> list[str]:
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", layout.mlflow_backend_uri,
        "--artifacts-destination", str(layout.mlflow_artifacts),
        "--host", HOST, "--port", str(port), "--workers", "1",
    ]  # fmt: skip


def worker_argv() -> list[str]:
    return prefect_argv("worker", "start", "--pool", WORK_POOL, "--name", "ddpflow-local-worker")


def _start_all(
    layout: StackLayout, state: StackState, prefect_port: int, mlflow_port: int, worker_env: Mapping[str, str]
) -> None:
    env = base_env(layout)
    # The UI asks the server where its API is; without this it says 4200
    # whatever --port is.
    server_env = {**env, "PREFECT_UI_API_URL": state.prefect_api_url}
    # Both servers start together: their start-up times overlap.
    server = start_process("prefect-server", prefect_server_argv(prefect_port), layout, server_env, state)
    mlflow_env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow = start_process("mlflow", mlflow_server_argv(layout, mlflow_port), layout, mlflow_env, state)
    wait_until_ready("prefect-server", f"{state.prefect_api_url}/health", server, layout.logs / "prefect-server.log")
    cli = client_env(layout, state)
    ensure_work_pool(layout, cli)
    deploy_all(layout, cli)
    wait_until_ready("mlflow", f"{state.mlflow_url}/health", mlflow, layout.logs / "mlflow.log")
    flow_env = {
        **cli,
        "PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS,
        "MLFLOW_TRACKING_URI": layout.mlflow_backend_uri,
        **worker_env,
    }
    start_process("worker", worker_argv(), layout, flow_env, state)


def _process(info: Mapping[str, Any]) -> psutil.Process | None:
    """The recorded process if it still runs and is the same one (not a reused PID)."""
    try:
        process = psutil.Process(int(info["pid"]))
        if abs(process.create_time() - float(info["create_time"])) > 1.0 or process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
        return None


def _alive(info: Mapping[str, Any]) -> bool:
    return _process(info) is not None


def stop_process(name: str, info: Mapping[str, Any], grace_s: float = 10.0) -> bool:
    """Stop one recorded process, then whatever it left in its session. True if it was running."""
    process = _process(info)
    if process is None:
        return False
    if name == "worker":
        # A background Prefect worker ignores the first SIGTERM (it forwards a
        # SIGINT to itself): a first TERM, ~3 s, then the ordinary stop below.
        _terminate_once(process, wait_s=3.0)
    stop_processes([process], grace_s)
    # Started with start_new_session, so the session id is the recorded PID:
    # flow-run processes or server children that outlived their parent get no grace.
    stop_processes(session_members(int(info["pid"])), grace_s=0.0)
    return True


def _terminate_once(process: psutil.Process, wait_s: float) -> None:
    try:
        process.terminate()
        process.wait(timeout=wait_s)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


def down(project: str | Path = ".", *, state_dir: str | Path | None = None) -> list[str]:
    """Stop what stack.json records, worker first; then remove stack.json. Returns the names stopped."""
    layout = StackLayout.for_project(project, state_dir)
    state = StackState.read(layout.stack_file)
    if state is None:
        return []
    stopped = []
    for name in sorted(state.processes, key=lambda n: STOP_ORDER.index(n) if n in STOP_ORDER else -1):
        if stop_process(name, state.processes[name]):
            stopped.append(name)
    layout.stack_file.unlink(missing_ok=True)
    return stopped


def status(project: str | Path = ".", *, state_dir: str | Path | None = None) -> dict[str, Any]:
    """Which recorded processes run, their PIDs and the URLs to open."""
    layout = StackLayout.for_project(project, state_dir)
    state = StackState.read(layout.stack_file)
    if state is None:
        return {"running": False, "state": str(layout.stack_file) + " (none)"}
    processes = {
        name: {"pid": info["pid"], "alive": _alive(info), "log": info.get("log")}
        for name, info in state.processes.items()
    }
    return {
        "running": all(p["alive"] for p in processes.values()) and bool(processes),
        "prefect_ui": state.prefect_url,
        "prefect_api": state.prefect_api_url,
        "prefect_healthy": http_ok(f"{state.prefect_api_url}/health"),
        "mlflow_ui": state.mlflow_url,
        "mlflow_healthy": http_ok(f"{state.mlflow_url}/health"),
        "processes": processes,
        "state": str(layout.stack_file),
    }


def shell_env(project: str | Path = ".", *, state_dir: str | Path | None = None) -> dict[str, str]:
    """What a shell needs for its ``prefect`` commands to reach this project's stack: the stack's Prefect home
    (profiles, settings) and API. A StackError when no stack is recorded."""
    layout = StackLayout.for_project(project, state_dir)
    state = StackState.read(layout.stack_file)
    if state is None:
        raise StackError(f"no stack is running for {layout.project} ({layout.stack_file} does not exist)")
    return {"PREFECT_HOME": str(layout.prefect_home), "PREFECT_API_URL": state.prefect_api_url}


def running_prefect_api(project: str | Path = ".", *, state_dir: str | Path | None = None) -> tuple[str | None, str]:
    """The Prefect API URL of this project's stack, if stack.json names one and it answers /api/health.

    Returns ``(api_url, "")`` for a running stack, ``(None, "")`` when there is no
    stack.json, and ``(None, why)`` when there is one whose server does not answer
    (a stack that crashed, or was stopped without `ddpflow stack down`).
    """
    layout = StackLayout.for_project(project, state_dir)
    try:
        state = StackState.read(layout.stack_file)
    except (OSError, ValueError, KeyError) as error:
        return None, f"{layout.stack_file} is unreadable ({error})"
    if state is None:
        return None, ""
    if not http_ok(f"{state.prefect_api_url}/health"):
        return None, f"{layout.stack_file} names a Prefect server at {state.prefect_url} that does not answer"
    return state.prefect_api_url, ""
