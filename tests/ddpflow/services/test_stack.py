"""Fast checks of prefect.yaml and the stack's process bookkeeping (no servers)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ddpflow.services import stack
from ddpflow.sweep.space import load_sweep
from training.core.config import load_config


def test_prefect_yaml_deploys_the_pipeline_with_real_configs(repo_root: Path) -> None:
    spec = yaml.safe_load((repo_root / "prefect.yaml").read_text())
    assert spec["build"] is None and spec["push"] is None
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PWD }}"}}]
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {
        "nightly", "manual", "slurm", "tune", "every-10-minutes", "on-new-data", "score-nightly",
        "score-on-new-champion",
    }  # fmt: skip
    for deployment in deployments.values():
        path, _, function = deployment["entrypoint"].partition(":")
        assert f"def {function}(" in (repo_root / path).read_text()
        assert deployment["work_pool"]["name"] == stack.WORK_POOL
        assert deployment["concurrency_limit"]["limit"] == 1
        # The deployment's config must validate, or every scheduled run would fail.
        if "config_file" in deployment.get("parameters", {}):  # on-new-data takes it from its event
            load_config(repo_root / deployment["parameters"]["config_file"])
    assert deployments["nightly"]["schedules"] == [
        {"cron": "0 2 * * *", "timezone": "UTC", "slug": "nightly-0200-utc", "active": True}
    ]
    assert deployments["manual"]["schedules"] == []
    assert deployments["slurm"]["schedules"] == [] and "slurm" in deployments["slurm"]["tags"]
    assert load_config(repo_root / deployments["slurm"]["parameters"]["config_file"]).train.launcher == "slurm"
    # The sweep deployment's section validates as `ddpflow sweep` reads it (docs/sweeps.md).
    assert deployments["tune"]["entrypoint"] == "flows/sweep.py:sweep_pipeline"
    assert load_sweep(repo_root / deployments["tune"]["parameters"]["config_file"]).sweep.trials >= 1
    on_new_champion = deployments["score-on-new-champion"]
    (trigger,) = on_new_champion["triggers"]  # tasks/register.py emits it when @champion moves
    # Only the model configs/score.yaml scores (its registry.model_name): another model's champion scores nothing.
    model_name = load_config(repo_root / on_new_champion["parameters"]["config_file"]).registry.model_name
    assert trigger["expect"] == ["ddpflow.champion.moved"]
    assert trigger["match"] == {"prefect.resource.id": f"ddpflow.model.{model_name}"}
    # The event's version and its own output, over the deployment's config_file (Prefect merges them).
    assert sorted(trigger["parameters"]) == ["model", "output"]


def test_every_deployment_the_stack_activates_runs_on_a_fresh_checkout_and_any_machine(repo_root: Path) -> None:
    """What `ddpflow stack up` activates (a schedule that is active, a trigger that is enabled) must not fail on a
    fresh checkout: its config reads only what the checkout holds or builds (a score.source names files that are
    there: configs/score.yaml scores the checkout's data/today/), and its ranks fit any machine (auto: one per GPU,
    else 1), so a 1-GPU workstation runs the nights a laptop runs."""
    tracked = subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True, text=True, check=True).stdout
    checkout = set(tracked.splitlines())
    spec = yaml.safe_load((repo_root / "prefect.yaml").read_text())
    active = [
        deployment
        for deployment in spec["deployments"]
        if any(schedule.get("active", True) for schedule in deployment.get("schedules") or [])
        or any(trigger.get("enabled", True) for trigger in deployment.get("triggers") or [])
    ]
    assert {d["name"] for d in active} == {"nightly", "every-10-minutes", "on-new-data", "score-nightly",
                                          "score-on-new-champion"}  # fmt: skip
    for deployment in active:
        config_file = deployment.get("parameters", {}).get("config_file", "configs/nightly.yaml")  # on-new-data's
        config = load_config(repo_root / config_file)
        assert config.train.nproc_per_node == "auto", (deployment["name"], config_file)
        if deployment["entrypoint"].startswith("flows/score_pipeline.py"):
            assert config.score.nproc_per_node == "auto", (deployment["name"], config_file)
            source = config.score.source.rstrip("/") + "/"
            assert any(path.startswith(source) for path in checkout), f"{config_file}: {config.score.source}"


def test_up_refuses_a_busy_port_before_starting_anything(tmp_path: Path, repo_root: Path) -> None:
    with socket.socket() as busy:
        busy.bind((stack.HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(stack.StackError, match=f"port {port}"):
            stack.up(repo_root, prefect_port=port, mlflow_port=port, state_dir=tmp_path / "state", mlflow_dir=tmp_path)
    assert not (tmp_path / "state" / "stack.json").exists()


def _record(state_dir: Path, name: str, process: psutil.Process, create_time: float | None = None) -> None:
    state = stack.StackState(prefect_url="http://127.0.0.1:1", mlflow_url="http://127.0.0.1:2")
    state.processes[name] = {
        "pid": process.pid,
        "create_time": create_time or process.create_time(),
        "argv": [],
        "log": "",
    }
    state.write(state_dir / "stack.json")


def test_down_stops_a_recorded_process_and_what_it_left_in_its_session(tmp_path: Path) -> None:
    # A parent that starts a child and exits at once on TERM, leaving the child behind.
    script = (
        "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(120)']); "
        "time.sleep(120)"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = psutil.Process(leader.pid).children()[0]
    _record(tmp_path, "mlflow", psutil.Process(leader.pid))
    assert stack.down(tmp_path, state_dir=tmp_path) == ["mlflow"]
    leader.wait(timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / "stack.json").exists()


def test_down_never_signals_a_reused_pid(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Same PID, different start time: the recorded process is gone and the PID was reused.
        _record(
            tmp_path,
            "worker",
            psutil.Process(bystander.pid),
            create_time=psutil.Process(bystander.pid).create_time() - 100,
        )
        assert stack.down(tmp_path, state_dir=tmp_path) == []
        assert bystander.poll() is None
        status = stack.status(tmp_path, state_dir=tmp_path)
        assert status["running"] is False
    finally:
        bystander.kill()
        bystander.wait()


def test_status_without_a_stack_says_where_it_looked(tmp_path: Path) -> None:
    summary = stack.status(tmp_path, state_dir=tmp_path)
    assert summary == {"running": False, "state": f"{tmp_path / 'stack.json'} (none)"}
    assert not (tmp_path / "stack.json").exists(), "asking wrote nothing"


def test_stack_env_is_the_line_a_shell_evals_to_reach_the_stack(tmp_path: Path) -> None:
    """`eval "$(ddpflow stack env)"`: the stack's Prefect home and API in the shell, a path with a space quoted;
    no stack recorded: exit 1 naming the state file."""
    project = tmp_path / "my project"
    stack.StackState(prefect_url="http://127.0.0.1:4321", mlflow_url="http://127.0.0.1:5432").write(
        project / ".ddpflow" / "stack.json"
    )
    expected = {"PREFECT_HOME": str(project / ".ddpflow" / "prefect"), "PREFECT_API_URL": "http://127.0.0.1:4321/api"}
    assert stack.shell_env(project) == expected
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    shell = 'eval "$("$PYTHON" -m flows.cli stack env)" && echo "$PREFECT_HOME|$PREFECT_API_URL"'
    evaluated = subprocess.run(
        ["bash", "-c", shell], cwd=project, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert evaluated.stdout.strip() == f"{expected['PREFECT_HOME']}|{expected['PREFECT_API_URL']}", evaluated.stderr
    nothing = subprocess.run(
        [sys.executable, "-m", "flows.cli", "stack", "env"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert nothing.returncode == 1 and nothing.stdout == ""
    assert nothing.stderr.strip().splitlines()[-1].startswith("error: no stack is running for"), nothing.stderr
