"""The whole pipeline with ``train.launcher: slurm`` on a real two-node cluster (tests/slurm_cluster.py).

Real training (2 nodes x 1 gloo rank), the session's Prefect harness and MLflow store. One model
name for the module: the first run makes the champion, and the failures after it must leave it alone.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from slurm_cluster import processes_mentioning, wait_until

from ddpflow.launch.slurm.commands import SlurmSetupError
from tests.flows.flow_logs import flow_run_logs
from training.core.config import ConfigError
from training.core.fileio import TRAIN
from training.core.layout import FINAL_MODEL
from training.core.manifest import read_manifest

pytestmark = pytest.mark.torchrun
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config(make_config):
    raw = make_config(**{"train.launcher": "slurm", "train.nnodes": 2, "train.nproc_per_node": 1})
    raw["slurm"] = {"poll_interval_s": 0.5}
    return raw


def jobs_of(cluster, run_dir: str | Path) -> list[str]:
    script = str(Path(run_dir) / "slurm" / "job.sh")
    return [job_id for job_id in cluster.job_ids() if cluster.job(job_id).get("Command") == script]


@pytest.fixture(scope="module")
def champion(prefect_harness, slurm_cluster, config):
    from flows.pipeline import train_pipeline

    return train_pipeline(config=config)


def test_the_flow_trains_on_two_nodes_through_slurm_and_registers_the_champion(champion, config, slurm_cluster):
    assert champion["decision"] == "promoted" and str(champion["model_version"]) == "1"
    test_rows = read_manifest(champion["dataset_dir"]).rows("test")
    assert champion["test_metrics"]["test_samples"] == test_rows, "every test row evaluated, once"
    assert Path(champion["run_dir"], FINAL_MODEL).is_file()

    run = MlflowClient(config["mlflow"]["tracking_uri"]).get_run(champion["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddp.nnodes"] == "2" and run.data.tags["ddp.world_size"] == "2"
    job_id = run.data.tags["slurm.job_id"]
    assert jobs_of(slurm_cluster, champion["run_dir"]) == [job_id]
    job = slurm_cluster.job(job_id)
    assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2" and job["NodeList"] == "n[1-2]", job


def test_every_node_and_rank_reaches_the_prefect_log_labelled(champion):
    logs = flow_run_logs(champion["flow_run_id"], "[n1 rank", "[n2 rank", "[slurm] submitted job")
    assert "[n1 rank" in logs and "[n2 rank" in logs, logs[-3000:]
    assert "epoch 2/2 done" in logs and "[slurm] submitted job" in logs


def test_a_failing_rank_reports_its_root_cause_and_leaves_the_champion(champion, config, slurm_cluster):
    from flows.pipeline import train_pipeline

    failing = copy.deepcopy(config)
    failing["train"]["epochs"] = 3  # another training: a fresh run directory, not the champion's
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", "raise:rank=1:epoch=0")  # sbatch hands the environment to the job
        with pytest.raises(Exception) as failure:
            train_pipeline(config=failing)
    message = str(failure.value)
    assert "rank 1 failed with exit code 1: RuntimeError: injected fault (DDPFLOW_FAULT)" in message, message
    assert "Slurm job" in message and "ended FAILED on n[1-2]: node n" in message, message

    client = MlflowClient(config["mlflow"]["tracking_uri"])
    name = config["registry"]["model_name"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(champion["model_version"])
    failed = client.search_runs(
        [client.get_experiment_by_name(config["mlflow"]["experiment"]).experiment_id],
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )[0]
    assert failed.info.status == "FAILED"
    run_dir = failed.data.tags["ddpflow.run_dir"]
    jobs = jobs_of(slurm_cluster, run_dir)
    # RankFailed is worth one retry: the task submits a second job (resuming), which fails the same way.
    assert len(jobs) == 2 and failed.data.tags["slurm.job_id"] == jobs[-1], (jobs, failed.data.tags)
    assert all(slurm_cluster.job(job)["JobState"] == "FAILED" for job in jobs)


def test_bad_slurm_settings_fail_before_anything_is_prepared_or_submitted(champion, config, slurm_cluster, tmp_path):
    from flows.pipeline import train_pipeline

    bad = copy.deepcopy(config)
    bad["slurm"]["partition"] = "nope"
    bad["data"]["root"] = str(tmp_path / "shards")
    with pytest.raises(SlurmSetupError, match=r"slurm.partition: 'nope' does not exist on this cluster"):
        train_pipeline(config=bad)
    assert not (tmp_path / "shards").exists(), "checked before the data was prepared"
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump(config).replace("poll_interval_s: 0.5", "time_limit: 1:30:00"))
    with pytest.raises(ConfigError, match=r"slurm.time_limit: must be a quoted string"):  # YAML read 1:30:00 as 5400
        train_pipeline(config_file=str(config_file))
    assert slurm_cluster.active_job_ids() == []


def running_flow_run_id(run_root: str) -> str:
    """The running flow run whose config trains under ``run_root``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    with get_client(sync_client=True) as client:
        running = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING"])))
        )
    ours = [run for run in running if (run.parameters.get("config") or {}).get("train", {}).get("run_root") == run_root]
    assert len(ours) == 1, running
    return str(ours[0].id)


def test_cancelling_the_flow_run_cancels_the_job_and_nothing_is_left(champion, config, slurm_cluster, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from flows.pipeline import train_pipeline

    hanging = copy.deepcopy(config)
    hanging["train"]["run_root"] = str(tmp_path / "runs")
    outcome: dict = {}

    def run_flow() -> None:
        try:
            outcome["state"] = train_pipeline(config=hanging, return_state=True)
        except BaseException as error:  # the task's Abort ends the flow: what the test checks is below
            outcome["error"] = error

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", "hang:rank=1:epoch=0")  # rank 1 hangs; rank 0 waits in its all-reduce
        runner = threading.Thread(target=run_flow, daemon=True)
        runner.start()
        run_root = Path(hanging["train"]["run_root"]).resolve()
        marker = wait_until(lambda: next(run_root.glob("*/.fault-hang-done"), None), 180, "rank 1 to hang")
    run_dir = marker.parent
    # The job that hangs: the newest (a job whose agent lost its rendezvous port to another process between the
    # script's pick and torchrun's bind fails at once, and the task's retry submits another).
    job_id = max(jobs_of(slurm_cluster, run_dir), key=int)
    flow_run_id = running_flow_run_id(hanging["train"]["run_root"])
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        runner.join(timeout=60)
        assert not runner.is_alive(), "the flow ended after its cancellation"
        assert slurm_cluster.job(job_id)["JobState"] == "CANCELLED", "scancel confirmed before the task ended"
        wait_until(lambda: not processes_mentioning(str(run_dir)), 30, "no process of the job within 30 s")
        assert client.read_flow_run(flow_run_id).state.is_cancelled(), outcome


def test_a_killed_flow_is_followed_by_a_run_that_reattaches_to_its_job(champion, config, slurm_cluster, tmp_path):
    """The flow's process dies mid-job (SIGKILL: nothing can scancel); the same config run again finds the job."""
    from prefect.settings import PREFECT_API_URL

    from flows.pipeline import train_pipeline

    longer = copy.deepcopy(config)
    longer["train"]["epochs"] = 15  # a job that outlives the first flow and the second one's start
    longer["train"]["run_root"] = str(tmp_path / "runs")
    config_file = tmp_path / "slurm.yaml"
    config_file.write_text(yaml.safe_dump(longer))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    program = "import sys; from flows.pipeline import train_pipeline; train_pipeline(config_file=sys.argv[1])"
    log = tmp_path / "first-flow.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-c", program, str(config_file)], cwd=REPO_ROOT, env=env, stdout=out, stderr=out
        )
    run_root = Path(longer["train"]["run_root"]).resolve()
    try:
        outputs = lambda: "".join(p.read_text(errors="replace") for p in run_root.glob("*/slurm/*.out"))  # noqa: E731
        try:
            # A step line of epoch 1, or its "done" line: progress lines come at most every second.
            wait_until(lambda: f"{TRAIN} epoch 1/15 " in outputs(), 180, "the first flow's job to train")
        except TimeoutError as error:
            pytest.fail(f"{error}; the first flow's output ends:\n{log.read_text()[-4000:]}\njob:\n{outputs()[-2000:]}")
    finally:
        first.kill()
        first.wait(timeout=30)
    [run_dir] = [path for path in run_root.iterdir() if path.is_dir()]
    [job_id] = jobs_of(slurm_cluster, run_dir)
    assert slurm_cluster.job(job_id)["JobState"] == "RUNNING", "the job outlives the flow that submitted it"

    second = train_pipeline(config=longer)
    assert second["run_dir"] == str(run_dir), "the same run directory: its job may still run"
    assert jobs_of(slurm_cluster, run_dir) == [job_id], "no second job"
    assert slurm_cluster.job(job_id)["JobState"] == "COMPLETED"
    assert (
        MlflowClient(config["mlflow"]["tracking_uri"]).get_run(second["mlflow_run_id"]).data.tags["slurm.job_id"]
        == job_id
    )
    assert f"reattached to job {job_id}" in flow_run_logs(second["flow_run_id"], f"reattached to job {job_id}")


def test_a_training_script_runs_as_it_is_on_two_nodes_through_slurm(config, slurm_cluster, prefect_harness, tmp_path):
    """The PyTorch tutorial's way of writing a DDP script (tests/scripts/ddp_tutorial.py), unmodified, as one
    2-node Slurm job: one rank a node, its snapshot where the run started, its run tracked."""
    from flows.pipeline import train_pipeline
    from tests.flows.script_variants import tutorial_text

    (tmp_path / "ddp_tutorial.py").write_text(tutorial_text())
    script_config = {
        "train": {
            **{key: config["train"][key] for key in ("launcher", "nnodes", "nproc_per_node", "backend", "timeout_s")},
            "script": "ddp_tutorial.py",  # relative to where the flow runs: the job starts its ranks there
            "script_args": ["2", "1", "--batch_size", "64"],
            "run_root": str(tmp_path / "runs"),
        },
        "slurm": config["slurm"],
        "registry": {"model_name": f"{config['registry']['model_name']}-script"},
        "mlflow": config["mlflow"],
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        summary = train_pipeline(config=script_config)
    assert summary["decision"] == "tracked", summary
    run = MlflowClient(config["mlflow"]["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["ddp.nnodes"] == "2"
    job = slurm_cluster.job(run.data.tags["slurm.job_id"])
    assert job["JobState"] == "COMPLETED" and job["NodeList"] == "n[1-2]", job
    assert (tmp_path / "snapshot.pt").is_file()
    logs = flow_run_logs(summary["flow_run_id"], "[n1 rank", "[n2 rank")
    assert "Epoch 1 | Steps: 16" in logs and "[n1 rank" in logs and "[n2 rank" in logs, logs[-3000:]
