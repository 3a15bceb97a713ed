"""The gate through the real flow: a champion whose files are gone fails the pipeline without moving
@champion, and the recovery command the error names works as written (`ddpflow register --run-id`).

Real components: the session's Prefect test harness, 2 gloo ranks, the session's SQLite
MLflow store, and the `ddpflow` CLI as a subprocess on the harness's server (PREFECT_API_URL: a
temporary server of its own would cost 10-20 s; tests/flows/test_run_cli.py covers that one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.tracking.gate import ChampionUnreadableError
from ddpflow.tracking.registry import MODEL_PT_IN_MODEL
from tests.flows.cli_runs import cli_env

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def unreadable(prefect_harness, make_config):
    """A first run makes the champion; its model.pt is then lost; a second run meets it at the gate."""
    from flows.pipeline import train_pipeline

    config = make_config(**{"train.epochs": 1})
    first = train_pipeline(config=config)
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    name = config["registry"]["model_name"]
    root = client.get_model_version_download_uri(name, str(first["model_version"]))
    Path(unquote(urlparse(f"{root.rstrip('/')}/{MODEL_PT_IN_MODEL}").path)).unlink()
    with pytest.raises(ChampionUnreadableError) as raised:
        train_pipeline(config=config)
    return config, client, first, str(raised.value)


def alias_run(client: MlflowClient, name: str, alias: str) -> str:
    return client.get_model_version_by_alias(name, alias).run_id


def test_an_unreadable_champion_fails_the_run_and_never_moves_the_champion(unreadable):
    config, client, first, message = unreadable
    name = config["registry"]["model_name"]
    candidate = client.get_model_version(name, "2")
    assert f"{name} champion v1 could not be read" in message, message
    assert f"ddpflow register --run-id {candidate.run_id}" in message
    assert alias_run(client, name, "champion") == first["mlflow_run_id"]
    assert alias_run(client, name, "challenger") == candidate.run_id
    run = client.get_run(candidate.run_id)
    assert run.info.status == "FAILED"  # the pipeline reports FAILED, and @champion did not move
    assert run.data.tags["registry.decision"] == "challenger"
    assert run.data.tags["registry.champion_status"].startswith("unreadable")


def test_the_recovery_command_in_the_error_replaces_the_champion(unreadable, tmp_path):
    from prefect.settings import get_current_settings

    config, client, first, message = unreadable
    name = config["registry"]["model_name"]
    command = message.rsplit("with this model: ", 1)[1]  # "MLFLOW_TRACKING_URI=... ddpflow register ... --set ..."
    environment, _, arguments = command.partition(" ddpflow ")
    variable, _, uri = environment.partition("=")
    assert variable == "MLFLOW_TRACKING_URI" and uri == config["mlflow"]["tracking_uri"]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *arguments.split(), "--json"],
        cwd=tmp_path,
        env={
            **cli_env(str(get_current_settings().api.url), tmp_path / "prefect-home"),
            "MLFLOW_TRACKING_URI": uri,
        },
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["decision"] == "promoted" and str(summary["model_version"]) == "2"
    assert "was unreadable" in summary["reason"]
    assert client.get_model_version_by_alias(name, "champion").version in ("2", 2)
    assert alias_run(client, name, "previous-champion") == first["mlflow_run_id"]
