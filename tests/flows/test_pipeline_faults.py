"""Failures through the real flow: bad data, a killed rank, restarts exhausted, then a resume.

One model name for the module: the first run (a rank killed once, then restarted)
makes the champion, and every later failure must leave that alias where it is.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddpflow.launch.supervisor import LOCK_FILE, PID_FILE
from ddpflow.tracking.runs import RESUMED_BY_TAG, RESUMED_FROM_TAG
from tests.flows.flow_logs import flow_run_logs
from training.core.errors import DataError
from training.core.fileio import read_metrics_lines
from training.core.layout import FINAL_MODEL, LAST_CHECKPOINT, METRICS

pytestmark = pytest.mark.torchrun

# Helper B's fault hooks (training/loop/hooks.py). kill: rank 1 SIGKILLs itself at epoch 1,
# step 2, once per run dir. raise: rank 1 raises there every time, a permanent error
# that neither torchrun's restarts nor the train task's retry can get past.
KILL_RANK_1 = "kill:rank=1:epoch=1:step=2"
RAISE_IN_RANK_1 = "raise:rank=1:epoch=1:step=2"
# nan: rank 1's model output is NaN at epoch 1, step 2, every time (training/loop/nonfinite.py must stop it there).
NAN_IN_RANK_1 = "nan:rank=1:epoch=1:step=2"


@pytest.fixture(scope="module")
def config(make_config):
    return make_config(**{"train.max_restarts": 1})


@pytest.fixture(scope="module")
def client(config) -> MlflowClient:
    return MlflowClient(config["mlflow"]["tracking_uri"])


@pytest.fixture(scope="module")
def champion_run(prefect_harness, config):
    """A rank is killed mid-epoch; torchrun restarts the group, which resumes from last.pt."""
    from flows.pipeline import train_pipeline

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", KILL_RANK_1)
        return train_pipeline(config=config)


def per_epoch_keys(run_dir: str) -> set[str]:
    lines = [json.loads(line) for line in (Path(run_dir) / METRICS).read_text().splitlines() if line.strip()]
    return {key for line in lines for key, value in line.items() if isinstance(value, (int, float)) and key != "epoch"}


def runs_in(client: MlflowClient, config) -> list:
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    return client.search_runs([experiment.experiment_id]) if experiment else []


def champion_version(client: MlflowClient, config) -> str:
    return str(client.get_model_version_by_alias(config["registry"]["model_name"], "champion").version)


def test_a_killed_rank_is_restarted_and_the_restart_is_recorded(champion_run, config, client):
    assert champion_run["restarts"] >= 1
    assert champion_run["decision"] == "promoted"
    run = client.get_run(champion_run["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddp.restarts"] == str(champion_run["restarts"])
    # Epoch 1 was interrupted and re-run: still exactly one point per epoch.
    keys = per_epoch_keys(champion_run["run_dir"]) & set(run.data.metrics)
    assert keys
    for key in keys:
        history = client.get_metric_history(champion_run["mlflow_run_id"], key)
        assert len(history) == config["train"]["epochs"], (key, [(point.step, point.value) for point in history])


def test_bad_data_fails_at_prepare_and_registers_nothing(champion_run, config, client, tmp_path):
    from flows.pipeline import train_pipeline

    csv = tmp_path / "bad.csv"  # inf: a null or NaN in a numeric input is a value (imputed), inf is not
    csv.write_text("f0,f1,label\n1.0,2.0,0\ninf,3.0,1\n" + "".join(f"{i}.0,{i}.5,{i % 2}\n" for i in range(200)))
    bad = copy.deepcopy(config)
    bad["data"]["source"] = str(csv)
    runs_before = len(runs_in(client, config))
    versions_before = len(client.search_model_versions(f"name='{config['registry']['model_name']}'"))

    with pytest.raises(DataError) as failure:
        train_pipeline(config=bad)
    message = str(failure.value)
    assert "bad.csv" in message and "f0" in message, message

    assert len(runs_in(client, config)) == runs_before, "prepare fails before any MLflow run exists"
    assert len(client.search_model_versions(f"name='{config['registry']['model_name']}'")) == versions_before
    assert champion_version(client, config) == str(champion_run["model_version"])


def epoch_progress(epoch: int, epochs: int) -> str:
    """What training/loop/counting.py: Progress says on every line about 1-based ``epoch``: its steps and its end."""
    return f"epoch {epoch}/{epochs} "


def test_restarts_exhausted_fail_with_the_root_cause_then_the_same_config_resumes(champion_run, config, client):
    from flows.pipeline import train_pipeline

    fragile = copy.deepcopy(config)
    fragile["train"]["max_restarts"] = 0
    epochs = fragile["train"]["epochs"]
    run_root = Path(config["train"]["run_root"]).resolve()
    dirs_before = set(run_root.iterdir())

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", RAISE_IN_RANK_1)
        with pytest.raises(Exception) as failure:
            train_pipeline(config=fragile)
    message = str(failure.value)
    assert "rank 1" in message and "injected fault" in message, f"the root cause, not a peer's gloo error: {message}"

    failed_dirs = set(run_root.iterdir()) - dirs_before
    assert len(failed_dirs) == 1
    failed_dir = failed_dirs.pop()
    assert (failed_dir / LAST_CHECKPOINT).is_file(), "the finished epoch's checkpoint stays on disk"
    assert not (failed_dir / FINAL_MODEL).exists()
    before_fault = read_metrics_lines(failed_dir / METRICS)
    assert [line["epoch"] for line in before_fault] == [0], "epoch 0 finished, the fault hit epoch 1"
    failed_run = max(runs_in(client, config), key=lambda run: run.info.start_time)
    assert failed_run.info.status == "FAILED"
    assert champion_version(client, config) == str(champion_run["model_version"]), (
        "a failed run never moves the champion"
    )

    resumed = train_pipeline(config=fragile)
    assert Path(resumed["run_dir"]) == failed_dir, "the same config resumes the unfinished run instead of starting over"
    assert (failed_dir / FINAL_MODEL).is_file()
    assert not (failed_dir / LOCK_FILE).exists() and not (failed_dir / PID_FILE).exists(), "finished: neither"
    # One story in MLflow: the failed run and the run that finished its work name each other.
    assert client.get_run(resumed["mlflow_run_id"]).data.tags[RESUMED_FROM_TAG] == failed_run.info.run_id
    assert client.get_run(failed_run.info.run_id).data.tags[RESUMED_BY_TAG] == resumed["mlflow_run_id"]
    # It started at the checkpointed epoch: the rank says so, and only the last epoch was trained.
    resumed_line = f"resumed from {failed_dir / LAST_CHECKPOINT} after 1 epoch(s)"
    logs = flow_run_logs(resumed["flow_run_id"], resumed_line, epoch_progress(epochs, epochs))
    assert resumed_line in logs, logs[-3000:]
    assert epoch_progress(epochs, epochs) in logs, logs[-3000:]
    assert epoch_progress(1, epochs) not in logs, f"the first epoch was trained again:\n{logs[-3000:]}"
    after = read_metrics_lines(failed_dir / METRICS)
    assert [line["epoch"] for line in after] == [0, 1] and after[0] == before_fault[0], after


def test_the_run_records_the_epoch_model_pt_holds(champion_run, config, client):
    """train.select: best (the default): the summary, model.pt and the MLflow run name the same epoch."""
    import torch

    selection = champion_run["selection"]
    lines = read_metrics_lines(Path(champion_run["run_dir"]) / METRICS)
    best = min(lines, key=lambda line: line["val_loss"])
    assert selection["selected_epoch"] == best["epoch"] and selection["value"] == best["val_loss"]
    assert selection["epochs_trained"] == selection["epochs"] == config["train"]["epochs"]
    model = torch.load(Path(champion_run["run_dir"]) / FINAL_MODEL, weights_only=True)
    assert model["selected_epoch"] == best["epoch"] and model["metrics"]["val_loss"] == best["val_loss"]
    metrics = client.get_run(champion_run["mlflow_run_id"]).data.metrics
    assert metrics["selected_epoch"] == best["epoch"] and metrics["selected_val_loss"] == best["val_loss"]


def test_a_nan_fails_the_run_at_its_step_and_the_champion_stays(champion_run, config, client):
    from flows.pipeline import train_pipeline

    diverging = copy.deepcopy(config)
    diverging["train"]["max_restarts"] = 0
    diverging["train"]["seed"] = 1  # its own training: no other test's run directory is resumed by it, or it by them
    run_root = Path(config["train"]["run_root"]).resolve()
    dirs_before = set(run_root.iterdir())

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", NAN_IN_RANK_1)
        with pytest.raises(Exception) as failure:
            train_pipeline(config=diverging)
    message = str(failure.value)
    assert "non-finite training values at epoch 1 step 2" in message, message
    assert "the loss was non-finite on rank(s) [1]" in message and "train.lr" in message, message

    (failed_dir,) = set(run_root.iterdir()) - dirs_before
    assert (failed_dir / LAST_CHECKPOINT).is_file() and not (failed_dir / FINAL_MODEL).exists()
    assert [line["epoch"] for line in read_metrics_lines(failed_dir / METRICS)] == [0]
    failed_run = max(runs_in(client, config), key=lambda run: run.info.start_time)
    assert failed_run.info.status == "FAILED"
    assert champion_version(client, config) == str(champion_run["model_version"]), "a diverged run never moves it"
