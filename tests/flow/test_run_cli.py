"""`ddpflow run` as a user runs it: a real subprocess, Prefect's temporary local server, tiny data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient


def cli_env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded test machine
    return env


def ddpflow(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=cli_env(cwd),
        capture_output=True,
        text=True,
        timeout=540,
    )


@pytest.mark.slow
def test_run_json_prints_the_summary_and_keeps_prefect_state_in_the_project(make_config, tmp_path):
    config = make_config()
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    result = ddpflow(["run", "--config", "tiny.yaml", "--set", "train.epochs=1", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)  # stdout holds only the summary; Prefect logs to stderr
    assert summary["decision"] == "promoted"
    assert str(summary["model_version"]) == "1"
    assert Path(summary["run_dir"], "model.pt").is_file()
    run = MlflowClient(config["mlflow"]["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.data.params["train.epochs"] == "1", "--set overrides the file"
    assert (tmp_path / ".ddpflow" / "prefect").is_dir(), "PREFECT_HOME defaults to <project>/.ddpflow/prefect"


def test_run_with_a_bad_value_exits_2_with_the_field_on_the_last_line(tmp_path):
    result = ddpflow(["run", "--set", "train.epochs=-1", "--json"], tmp_path)
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error:") and "train.epochs" in last_line, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
