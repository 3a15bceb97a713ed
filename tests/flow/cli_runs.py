"""`ddpflow run` as a user runs it, for the flow tests: a subprocess of the CLI with the test's config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    """This environment without the session's Prefect and MLflow settings: the CLI chooses its own servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded test machine
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_promoted(directory: Path, config: dict) -> tuple[dict, Path, Path]:
    """``ddpflow run --json`` on ``config`` in ``directory``; asserts it succeeded and was promoted.
    Returns (its JSON summary, the run directory, the dataset directory)."""
    (directory / "run.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "run.yaml", "--json"],
        cwd=directory, env=cli_env(), capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["decision"] == "promoted"
    return summary, Path(summary["run_dir"]), Path(summary["dataset_dir"])
