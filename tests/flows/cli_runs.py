"""`ddpflow run` as a user runs it, for the flow tests: a subprocess of the CLI with the test's config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def cli_env(prefect_api_url: str | None = None, prefect_home: Path | None = None) -> dict[str, str]:
    """This environment without the session's Prefect and MLflow settings: the CLI chooses its own servers.
    With ``prefect_api_url`` (the session's harness), the CLI uses that server as a user's PREFECT_API_URL,
    and starts none of its own (10-40 s each on 2 cores); ``prefect_home``: the CLI's own PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    if prefect_api_url:
        env["PREFECT_API_URL"] = prefect_api_url
    if prefect_home:
        env["PREFECT_HOME"] = str(prefect_home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded test machine
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_promoted(directory: Path, config: dict, prefect_api_url: str) -> tuple[dict, Path, Path]:
    """``ddpflow run --json`` on ``config`` in ``directory`` against the Prefect server at ``prefect_api_url``
    (the session's harness: these tests are about the data, not the temporary server, which
    tests/flows/test_run_cli.py covers); asserts it succeeded and was promoted.
    Returns (its JSON summary, the run directory, the dataset directory)."""
    (directory / "run.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "run.yaml", "--json"],
        cwd=directory, env=cli_env(prefect_api_url), capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["decision"] == "promoted"
    assert (summary["prefect_server"], summary["prefect_api_url"]) == ("PREFECT_API_URL", prefect_api_url)
    return summary, Path(summary["run_dir"]), Path(summary["dataset_dir"])
