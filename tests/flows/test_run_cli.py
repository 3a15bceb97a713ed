"""`ddpflow run` and `ddpflow register` as a user runs them: real subprocesses, real Prefect servers, tiny data.

Every way a run ends (it finishes, a signal, its parent dies) must leave no process
behind: torchrun, its ranks and the temporary Prefect server all carry the run's
PREFECT_HOME in their environment, so "nothing left" is "no process with that
PREFECT_HOME". With the project's stack up, the run uses the stack's server.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from ddpflow.launch.supervisor import LOCK_FILE, PID_FILE
from ddpflow.services import stack as local_stack
from ddpflow.tracking.runs import RESUMED_BY_TAG, RESUMED_FROM_TAG
from devtools.ports import free_port
from tests.flows.cli_runs import cli_env
from tests.flows.serve_cli import as_from_a_terminal
from tests.flows.terminal import TerminalRun
from training.core.fileio import TRAIN
from training.core.layout import FINAL_MODEL, PREEMPTED

REPO = Path(__file__).resolve().parents[2]
TRAINING_LINE = TRAIN  # a rank's own log line: the ranks are up and training
GONE_WITHIN_S = 30.0
# Enough work that only a signal ends the run while the test watches.
ENDLESS = {
    "data.source": "synthetic://classification?rows=20000&features=8&classes=3&seed=2",
    "train.epochs": 1000,
    "train.early_stopping_patience": None,  # nor early stopping
    "train.batch_size": 64,
}


def ddpflow(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )


def write_config(project: Path, config: dict) -> str:
    (project / "run.yaml").write_text(yaml.safe_dump(config))
    return "run.yaml"


def processes_with_home(prefect_home: Path) -> list[psutil.Process]:
    """Every process whose environment carries this PREFECT_HOME: the CLI, its server, torchrun, ranks."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PREFECT_HOME") == str(prefect_home) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until_none_left(prefect_home: Path, within_s: float = GONE_WITHIN_S) -> list[str]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = processes_with_home(prefect_home)
        if not left:
            return []
        time.sleep(0.5)
    return [f"{p.pid} {' '.join(p.cmdline()[:8])}" for p in processes_with_home(prefect_home)]


def is_temporary_server(proc: psutil.Process) -> bool:
    try:
        return "prefect.server.api.server:create_app" in proc.cmdline()
    except psutil.Error:
        return False


class LiveRun:
    """A command started in the background; its stdout and stderr collected as they come."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]):
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=as_from_a_terminal,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.popen.stdout, self.out), (self.popen.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for_line(self, marker: str, within_s: float = 300) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if any(marker in line for line in self.out + self.err):
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"no {marker!r} line within {within_s} s:\n{self.output[-4000:]}")

    def finish(self, within_s: float = 60) -> int:
        code = self.popen.wait(timeout=within_s)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    @property
    def output(self) -> str:
        return "".join(self.out + self.err)

    @property
    def last_error_line(self) -> str:
        return "".join(self.err).strip().splitlines()[-1]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def error_lines(output: str) -> list[str]:
    """Lines a person reads as an error: a traceback, or a log record at ERROR level (Prefect's or its server's)."""
    return [line for line in output.splitlines() if "Traceback" in line or re.search(r"\bERROR\b", line)]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """One project directory for the module: its Prefect database is created once, later servers start warm."""
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def first_run(make_config, project) -> tuple[dict, str, subprocess.CompletedProcess]:
    """The module's first `ddpflow run` (a temporary server): its config, its config file, its result.
    It registers the model, so the gate's concurrency limit of its name exists in the project's Prefect
    database from then on: later runs of the same model name reuse it."""
    stale = local_stack.StackState(prefect_url=f"http://127.0.0.1:{free_port()}", mlflow_url="http://127.0.0.1:1")
    stale.write(project / ".ddpflow" / "stack.json")
    config = make_config()
    run_config = write_config(project, config)
    result = ddpflow(["run", "--config", run_config, "--set", "train.epochs=1", "--json"], project)
    return config, run_config, result


@pytest.mark.torchrun
@pytest.mark.server  # a temporary Prefect server
def test_run_and_register_use_a_temporary_server_and_leave_nothing_behind(first_run, project):
    """The normal way out; and a stack.json whose server is gone is passed over with one line."""
    prefect_home = project / ".ddpflow" / "prefect"
    config, run_config, result = first_run
    stale_url = json.loads((project / ".ddpflow" / "stack.json").read_text())["prefect_url"]
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)  # stdout holds only the summary; Prefect logs to stderr
    assert summary["decision"] == "promoted" and str(summary["model_version"]) == "1"
    assert Path(summary["run_dir"], "model.pt").is_file()
    assert summary["selection"]["selected_epoch"] == 0 and summary["selection"]["epochs_trained"] == 1
    run = MlflowClient(config["mlflow"]["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.data.params["train.epochs"] == "1", "--set overrides the file"
    assert prefect_home.is_dir(), "PREFECT_HOME defaults to <project>/.ddpflow/prefect"
    assert summary["prefect_server"] == "temporary"
    assert [line for line in result.stderr.splitlines() if "does not answer" in line] == [
        f"ddpflow: {project / '.ddpflow' / 'stack.json'} names a Prefect server at {stale_url} "
        "that does not answer; using a temporary Prefect server"
    ]
    assert "Error logging to API" not in result.stderr, "logs are sent before the server stops"
    assert not list(Path(summary["run_dir"]).glob("*.lock")) and not (Path(summary["run_dir"]) / PID_FILE).exists()
    assert wait_until_none_left(prefect_home, within_s=10) == []

    registered = ddpflow(["register", "--run-id", summary["mlflow_run_id"], "--config", run_config, "--json"], project)
    assert registered.returncode == 0, registered.stderr[-4000:]
    decision = json.loads(registered.stdout)
    assert decision["already_registered"] is True and decision["decision"] == "promoted"
    assert decision["prefect_server"] == "temporary"
    assert wait_until_none_left(prefect_home, within_s=10) == []


def test_run_with_a_bad_value_exits_2_with_the_field_on_the_last_line(tmp_path):
    result = ddpflow(["run", "--set", "train.epochs=-1", "--json"], tmp_path)
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error:") and "train.epochs" in last_line, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr


# Rank 0 pauses 4 s before step 5 (0-based) of the first epoch, once per run directory (training/loop/hooks.py):
# a SIGTERM sent then reaches ranks at a known step, so they save after it, 6 steps into the epoch, although no
# step checkpoints are configured. The pause does not change the weights.
PAUSE_IN_EPOCH_1 = "pause:rank=0:epoch=0:step=5:seconds=4"
PREEMPT_GRACE_S = 30.0  # train.preempt_grace_s's default


@pytest.mark.torchrun
@pytest.mark.server  # a temporary Prefect server
def test_sigterm_saves_the_current_step_stops_everything_and_the_same_command_resumes_to_the_uninterrupted_weights(
    first_run, make_config, project
):
    """SIGTERM to `ddpflow run` mid-epoch (kill, a scheduler, a container runtime, a spot reclaim): the ranks save
    a step checkpoint at the step they are in, within train.preempt_grace_s; the run ends KILLED and tagged
    preempted, nothing is left running, exit 143; then the same command resumes at that step and ends on the
    weights of the module's uninterrupted first run (the same config: one epoch)."""
    prefect_home = project / ".ddpflow" / "prefect"
    assert first_run[2].returncode == 0, first_run[2].stderr[-4000:]
    reference = Path(json.loads(first_run[2].stdout)["run_dir"]) / FINAL_MODEL
    config = make_config()
    argv = [sys.executable, "-m", "flows.cli", "run", "--config", write_config(project, config), "--set"]
    argv.append("train.epochs=1")  # as the first run
    run = LiveRun(argv, project, {**cli_env(), "DDPFLOW_FAULT": PAUSE_IN_EPOCH_1})
    run_root = Path(config["train"]["run_root"])
    try:
        deadline = time.monotonic() + 300
        while not list(run_root.glob("*/.fault-pause-done")) and run.popen.poll() is None:
            assert time.monotonic() < deadline, run.output[-4000:]
            time.sleep(0.1)
        started = processes_with_home(prefect_home)
        assert any(is_temporary_server(p) for p in started), "the scan must see the temporary server"
        assert any("ddpflow.launch.agent" in " ".join(p.cmdline()) for p in started), "... and torchrun"
        sent = time.monotonic()
        run.popen.send_signal(signal.SIGTERM)
        assert run.finish() == 143, run.output[-4000:]
        took_s = time.monotonic() - sent
    finally:
        run.kill()
    assert run.last_error_line == "error: terminated by SIGTERM"
    assert took_s < PREEMPT_GRACE_S, run.output[-4000:]
    (run_dir,) = run_root.iterdir()
    record = json.loads((run_dir / PREEMPTED).read_text())
    assert (record["signal"], record["epoch"], record["step"]) == ("SIGTERM", 0, 6), record
    assert Path(record["checkpoint"]) == run_dir / "checkpoints" / "step-e00000-s00000006.pt"
    assert Path(record["checkpoint"]).is_file() and not (run_dir / FINAL_MODEL).exists()
    (log,) = (project / ".ddpflow" / "logs").glob(f"run-*-{run.popen.pid}.log")  # SIGTERM: nobody at a console
    assert f"re-run the same command to resume from epoch 1, step 6 (run directory {run_dir})" in log.read_text()
    assert wait_until_none_left(prefect_home) == []
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    (killed,) = client.search_runs([experiment.experiment_id])
    assert killed.info.status == "KILLED"  # not FAILED
    tags = killed.data.tags
    assert (tags["ddpflow.preempted"], tags["ddpflow.preempted_epoch"], tags["ddpflow.preempted_step"]) == (
        "true",
        "0",
        "6",
    )

    resumed = ddpflow([*argv[3:], "--json"], project)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = json.loads(resumed.stdout)
    assert Path(summary["run_dir"]) == run_dir
    assert "at step 6 of epoch 0" in resumed.stderr, resumed.stderr[-4000:]  # the ranks' "resumed from ..." line
    got, want = (torch.load(path, weights_only=True)["model"] for path in (run_dir / FINAL_MODEL, reference))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    finished = client.get_run(summary["mlflow_run_id"])
    assert finished.info.status == "FINISHED" and finished.data.tags[RESUMED_FROM_TAG] == killed.info.run_id
    assert wait_until_none_left(prefect_home, within_s=10) == []


# Rank 1 pauses 4 s before step 2 (0-based) of epoch 2 (1-based), once per run directory: Ctrl-C then comes
# while the ranks are at a known step, and they save after it (3 steps into epoch 2) before stopping.
PAUSE_IN_EPOCH_2 = "pause:rank=1:epoch=1:step=2:seconds=4"
CTRL_C_LINES = 8  # at most this many lines from Ctrl-C to the end
CTRL_C_EXIT_S = 20.0  # "a few seconds" (about 3 s here), with room for a loaded 2-core machine


@pytest.mark.torchrun
@pytest.mark.server  # the session's Prefect harness (its state is read after the command ends)
def test_ctrl_c_in_a_terminal_cancels_the_flow_run_in_a_few_lines_and_the_same_command_resumes_cleanly(
    first_run, make_config, project, prefect_harness
):
    """Ctrl-C typed in the terminal that runs `ddpflow run` (a pty: SIGINT to the foreground group, as a person's
    key sends it): the ranks save where they are, exit 130 within seconds, at most 8 lines, none of them ERROR
    and no traceback, the flow run and its train task run Cancelled (not Crashed), and the last line says how to
    resume (the epoch and step); then the same command resumes to the end: no lock or PID file left, the two
    MLflow runs name each other, and this second registration of the model's name prints no server traceback
    (the gate's limit is reused, not re-created)."""
    prefect_home = project / ".ddpflow" / "prefect"
    model_name = first_run[0]["registry"]["model_name"]
    assert first_run[2].returncode == 0, first_run[2].stderr[-4000:]
    config = make_config(**{"train.epochs": 2, "registry.model_name": model_name})
    argv = ["run", "--config", write_config(project, config)]
    env = {**cli_env(), "DDPFLOW_FAULT": PAUSE_IN_EPOCH_2}
    run = TerminalRun([sys.executable, "-m", "flows.cli", *argv], project, {**env, "PREFECT_API_URL": prefect_harness})
    run_root = Path(config["train"]["run_root"])
    try:
        deadline = time.monotonic() + 300
        while not list(run_root.glob("*/.fault-pause-done")) and run.popen.poll() is None:
            assert time.monotonic() < deadline, run.text()[-4000:]
            time.sleep(0.2)
        pressed = time.monotonic()
        run.ctrl_c()
        assert run.finish() == 130, run.text()[-4000:]
        took_s = time.monotonic() - pressed
    finally:
        run.kill()
    after = run.lines_after_the_key()
    shown = "\n".join(after)
    assert len(after) <= CTRL_C_LINES, shown
    assert took_s < CTRL_C_EXIT_S, shown
    assert error_lines(run.text()) == [] and "SignalException" not in run.text(), run.text()[-6000:]
    (run_dir,) = run_root.iterdir()
    assert after[-1] == f"ddpflow: re-run the same command to resume from epoch 2, step 3 (run directory {run_dir})"
    assert (run_dir / "checkpoints" / "step-e00001-s00000003.pt").is_file()
    assert wait_until_none_left(prefect_home) == []
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    (killed,) = client.search_runs([experiment.experiment_id])
    flow_run_id = killed.data.tags["prefect.flow_run_id"]
    assert after[-2] == f"ddpflow: stopped by Ctrl-C; flow run {cancelled_flow_run_name(flow_run_id)!r} cancelled"
    assert run_states(flow_run_id) == {"flow run": "CANCELLED", "prepare-data": "COMPLETED",
                                       "measure-data-drift": "COMPLETED", "fit-reference": "COMPLETED",
                                       "train-model": "CANCELLED"}  # fmt: skip

    resumed = ddpflow([*argv, "--json"], project, env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert error_lines(resumed.stderr) == [], resumed.stderr[-6000:]  # the gate's limit: no IntegrityError
    summary = json.loads(resumed.stdout)
    assert Path(summary["run_dir"]) == run_dir and (run_dir / FINAL_MODEL).is_file()
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / PID_FILE).exists()
    runs = {r.info.status: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["FINISHED", "KILLED"]
    assert runs["FINISHED"].info.run_id == summary["mlflow_run_id"]
    assert runs["FINISHED"].data.tags[RESUMED_FROM_TAG] == runs["KILLED"].info.run_id
    assert runs["KILLED"].data.tags[RESUMED_BY_TAG] == runs["FINISHED"].info.run_id
    assert wait_until_none_left(prefect_home, within_s=10) == []


def run_states(flow_run_id: str) -> dict[str, str]:
    """The flow run's state type and each of its task runs' (by task name), through the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        states = {"flow run": client.read_flow_run(flow_run_id).state.type.value}
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return states | {task.name.rsplit("-", 1)[0]: task.state.type.value for task in tasks}


def cancelled_flow_run_name(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name


PARENT = """
import subprocess, sys
subprocess.Popen(sys.argv[1:])  # inherits this process's stdout: the test reads the run's lines
print("started", flush=True)
import time; time.sleep(3600)
"""


@pytest.mark.torchrun
@pytest.mark.server  # a temporary Prefect server
def test_the_parent_dying_stops_the_run_and_everything_it_started(make_config, project):
    """A wrapper (a script, a supervisor) SIGKILLed: the run gets SIGHUP from Linux and cleans up, as it does
    when the terminal it runs in closes."""
    prefect_home = project / ".ddpflow" / "prefect"
    config = make_config(**ENDLESS)
    run_config = write_config(project, config)
    argv = [sys.executable, "-c", PARENT, sys.executable, "-m", "flows.cli", "run", "--config", run_config]
    wrapper = LiveRun(argv, project, cli_env())
    try:
        wrapper.wait_for_line(TRAINING_LINE)
        (cli,) = [p for p in psutil.Process(wrapper.popen.pid).children() if "flows.cli" in p.cmdline()]
        assert any(is_temporary_server(p) for p in processes_with_home(prefect_home))
        wrapper.popen.kill()
        cli.wait(timeout=60)  # not our child: psutil cannot read its status, its last line says it
        wrapper.finish()  # the run wrote to the wrapper's pipes: read to their end
    finally:
        wrapper.kill()
    assert wrapper.last_error_line == "error: terminated by SIGHUP"  # the parent-death signal
    assert wait_until_none_left(prefect_home) == []
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    assert [r.info.status for r in client.search_runs([experiment.experiment_id])] == ["KILLED"]  # not FAILED
