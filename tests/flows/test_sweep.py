"""`ddpflow sweep` end to end, on the CPU with real torchrun, Prefect and MLflow: ONE sweep of four
trials (2 ranks a trial, 2 epochs, a tiny table), stopped by SIGTERM in its second trial and resumed with the
same config through the flow, checked many ways:

- trial 0 (lr 0.01) completes; trial 1 (lr 1e-7: barely learns) is interrupted, then re-run and pruned after
  its first epoch by the median pruner; trial 2 (lr 1e30) diverges (NaN) and is recorded failed with its
  reason while the sweep goes on; trial 3 (lr 0.03) completes;
- the sweep ends at 4 trials in all; prepare ran once; one parent MLflow run holds the children, the table,
  the plot and the best trial;
- only the best trial is scored on the test split and registered: one model version, tagged with the sweep
  and ``ddpflow.trial_run_id``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from ddpflow.sweep.space import load_sweep
from ddpflow.sweep.study import FAIL_REASON, INTERRUPTED, RERUN_OF, STORAGE_FILE, TRIALS_DIR, sweep_dir
from tests.flows.cli_runs import cli_env

pytestmark = pytest.mark.torchrun

GOOD, SLOW, DIVERGES, FAST = 0.01, 1e-7, 1e30, 0.03


@pytest.fixture(scope="module")
def sweep_config(make_config, tmp_path_factory) -> Path:
    raw = make_config(**{"train.nproc_per_node": 2, "train.epochs": 2, "train.model_kwargs": {"hidden": [16]}})
    raw["eval"]["reference"] = False  # the reference model is not what this test is about
    raw["sweep"] = {
        "trials": 4,
        "objective": "val_loss",
        "sampler": "random",
        "pruner": "median",
        "startup_trials": 1,
        "name": "tiny-sweep",
        "space": {"train.lr": {"choices": [GOOD, SLOW, DIVERGES, FAST]}},
        "enqueue": [
            {"train.lr": GOOD},
            {"train.lr": SLOW},
            {"train.lr": DIVERGES},
            {"train.lr": FAST},
        ],  # a known order
    }
    path = tmp_path_factory.mktemp("sweep") / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def interrupted(sweep_config: Path, prefect_harness: str) -> dict:
    """`ddpflow sweep` as a user runs it, sent SIGTERM once its second trial has started."""
    directory = sweep_dir(load_sweep(sweep_config))
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "sweep", "--config", str(sweep_config)],
        cwd=sweep_config.parent, env=cli_env(prefect_harness), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not list((directory / TRIALS_DIR).glob("*trial-001/train_config.json")) and process.poll() is None:
        assert time.monotonic() < deadline, "the second trial never started"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    return {"returncode": process.returncode, "output": output, "directory": directory}


@pytest.fixture(scope="module")
def resumed(interrupted: dict, sweep_config: Path, prefect_harness: str) -> dict:
    """The same config again, through the flow: it continues the same study."""
    from flows.sweep import sweep_pipeline

    summary = sweep_pipeline(config_file=str(sweep_config))
    study = optuna.load_study(study_name="tiny-sweep", storage=f"sqlite:///{interrupted['directory'] / STORAGE_FILE}")
    return {"summary": summary, "study": study, **interrupted}


def _client(summary: dict) -> MlflowClient:
    return MlflowClient(tracking_uri=summary["tracking_uri"], registry_uri=summary["tracking_uri"])


def _children(resumed: dict) -> list:
    summary = resumed["summary"]
    client = _client(summary)
    parent = client.get_run(summary["mlflow_run_id"])
    return client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'"
    )


def _best_lr(resumed: dict) -> float:
    """The lr of the complete trial with the lowest objective (val_loss): GOOD or FAST, whichever learnt more."""
    complete = [t for t in resumed["study"].get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    best = min(complete, key=lambda trial: trial.value).params["train.lr"]
    assert best in (GOOD, FAST)
    return best


def test_sigterm_stops_the_sweep_and_the_same_config_ends_it_at_trials_in_all(resumed):
    assert resumed["returncode"] == 143, resumed["output"][-3000:]
    assert "re-run the same command to continue the sweep" in resumed["output"]
    trials = resumed["study"].get_trials()
    interrupted = [t for t in trials if t.user_attrs.get(INTERRUPTED)]
    counted = [t for t in trials if not t.user_attrs.get(INTERRUPTED)]
    assert [t.params["train.lr"] for t in interrupted] == [SLOW]
    assert len(counted) == 4 == resumed["summary"]["trials"]["complete"] + 2
    rerun = next(t for t in counted if t.user_attrs.get(RERUN_OF) is not None)
    assert rerun.user_attrs[RERUN_OF] == interrupted[0].number and rerun.params["train.lr"] == SLOW
    assert resumed["summary"]["trials"] == {"complete": 2, "pruned": 1, "failed": 1}


def test_a_trial_in_a_bad_region_is_pruned_and_every_rank_stopped_after_its_first_epoch(resumed):
    pruned = next(t for t in resumed["study"].get_trials() if t.state == optuna.trial.TrialState.PRUNED)
    assert pruned.params["train.lr"] == SLOW and pruned.user_attrs["ddpflow.pruned_at_epoch"] == 0
    run_dir = Path(pruned.user_attrs["ddpflow.run_dir"])
    assert (run_dir / "verdicts" / "epoch-0").read_text() == "stop"
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0]  # 2 epochs asked for, 1 trained
    assert (run_dir / "model.pt").is_file()  # it ended as after early stopping, not killed
    run = _client(resumed["summary"]).get_run(pruned.user_attrs["ddpflow.run_id"])
    assert run.data.tags["sweep.state"] == "pruned" and run.info.status == "FINISHED"
    assert run.data.metrics["sweep_objective"] == pruned.intermediate_values[0]


def test_a_diverged_trial_is_recorded_failed_with_its_reason_and_the_sweep_goes_on(resumed):
    failed = [
        t
        for t in resumed["study"].get_trials()
        if t.state == optuna.trial.TrialState.FAIL and not t.user_attrs.get(INTERRUPTED)
    ]
    assert [t.params["train.lr"] for t in failed] == [DIVERGES]
    reason = failed[0].user_attrs[FAIL_REASON]
    assert "non-finite" in reason.lower() or "nan" in reason.lower(), reason
    later = [t for t in resumed["study"].get_trials() if t.number > failed[0].number]
    assert later, "no trial ran after the failed one"
    run = _client(resumed["summary"]).get_run(failed[0].user_attrs["ddpflow.run_id"])
    assert run.info.status == "FAILED" and run.data.tags["sweep.state"] == "failed"
    assert run.data.tags["sweep.fail_reason"] == reason


def test_one_prepare_one_parent_and_a_child_run_per_trial(resumed):
    summary = resumed["summary"]
    shards = Path(summary["dataset_dir"]).parent
    children = _children(resumed)
    assert {run.data.tags["data.fingerprint"] for run in children} == {Path(summary["dataset_dir"]).name}
    assert len(list(shards.iterdir())) >= 1 and Path(summary["dataset_dir"]).is_dir()
    statuses = sorted(run.info.status for run in children)
    assert statuses == ["FAILED", "FINISHED", "FINISHED", "FINISHED", "KILLED"]  # the interrupted attempt: KILLED
    for run in children:
        assert run.data.tags["ddpflow.sweep"] == "tiny-sweep"
        assert float(run.data.params["train.lr"]) in (GOOD, SLOW, DIVERGES, FAST)
        if run.info.status == "FINISHED":  # its per-epoch curve (the diverged one failed in its first epoch)
            history = _client(summary).get_metric_history(run.info.run_id, "val_loss")
            assert [point.step for point in history] in ([0], [0, 1])
    parent = _client(summary).get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.best_run_id"] == summary["best_run_id"]
    assert json.loads(parent.data.tags["sweep.best.train.lr"]) == _best_lr(resumed)
    artifacts = {a.path for a in _client(summary).list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/trials.json", "sweep/trials.csv", "sweep/objective_vs_params.png", "sweep/best.json"} <= artifacts
    table = _client(summary).download_artifacts(parent.info.run_id, "sweep/trials.csv")
    assert len(Path(table).read_text().strip().splitlines()) == 1 + 4


def test_only_the_best_trial_meets_the_test_split_and_the_gate(resumed):
    summary = resumed["summary"]
    client = _client(summary)
    tested = [run for run in _children(resumed) if any(name.startswith("test_") for name in run.data.metrics)]
    assert [run.info.run_id for run in tested] == [summary["best_run_id"]]
    evaluated = sorted(p.parent.parent.name for p in resumed["directory"].glob(f"{TRIALS_DIR}/*/eval/metrics.json"))
    assert len(evaluated) == 1
    assert summary["decision"] == "promoted" and summary["best_params"] == {"train.lr": _best_lr(resumed)}
    versions = client.search_model_versions(f"name = '{summary['model_name']}'")
    assert len(versions) == 1
    assert versions[0].run_id == summary["best_run_id"]
    assert versions[0].tags["ddpflow.sweep"] == "tiny-sweep"
    assert versions[0].tags["ddpflow.trial_run_id"] == summary["best_run_id"]
