"""ddpflow/launch/slurm/ on a real two-node Slurm cluster (tests/slurm_cluster.py), with stand-in ranks.

The ranks are tests/ranks/dummy_rank.py (no torch import), so a job costs the two torchrun
agents' start-up; what is trained does not matter here (tests/flows/test_pipeline_slurm.py trains).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launch_helpers import DUMMY_RANK, make_manifest
from slurm_cluster import processes_mentioning, skip_or_fail_in_ci, wait_until

import ddpflow.launch.command
from ddpflow.launch.failure import LaunchInterrupted, LaunchTimeout, RankFailed
from ddpflow.launch.slurm.commands import SlurmSetupError
from ddpflow.launch.slurm.launcher import SlurmLine
from ddpflow.launch.stage import TrainRequest, TrainResult, run_train_stage
from training.core.config import DEFAULT_EPOCHS, PipelineConfig

pytestmark = pytest.mark.torchrun
RUN_SLURM_LAUNCHER = Path(__file__).resolve().parents[2] / "ranks" / "run_slurm_launcher.py"


def slurm_config(train: dict | None = None, slurm: dict | None = None) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "train": {
                "launcher": "slurm", "nnodes": 2, "nproc_per_node": 1, "batch_size": 10,
                "max_restarts": 0, "timeout_s": 180, **(train or {}),
            },
            "slurm": {"poll_interval_s": 0.5, **(slurm or {})},
        }
    )  # fmt: skip


def train_on_slurm(config: PipelineConfig, dataset_dir: Path, run_dir: Path, **events) -> TrainResult:
    """The train stage through the launcher registry, as the Prefect task runs it (train.launcher: slurm)."""
    return run_train_stage(TrainRequest(config, dataset_dir, run_dir, **events))


def jobs_of(cluster, run_dir: Path) -> list[str]:
    """The jobs Slurm knows that run this run directory's batch script."""
    script = str(run_dir / "slurm" / "job.sh")
    return [job_id for job_id in cluster.job_ids() if cluster.job(job_id).get("Command") == script]


def assert_nothing_left(cluster, run_dir: Path, job_id: str) -> None:
    """Within 30 s: Slurm says nothing of the job runs, and no process names the run directory."""
    wait_until(lambda: cluster.job(job_id).get("JobState") in ("CANCELLED", "COMPLETED", "FAILED"), 30, "job end")
    try:
        wait_until(lambda: not processes_mentioning(str(run_dir)), 30, "the job's processes to end")
    except TimeoutError:
        pytest.fail(
            f"still running 30 s after the stop: {[p.info['cmdline'] for p in processes_mentioning(str(run_dir))]}"
        )


# ----------------------------------------------------------------------------- a job that completes


@pytest.fixture(scope="module")
def completed(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("completed")
    run_dir = tmp / "run"
    lines, jobs = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ddpflow.launch.command, "RANK_ENTRYPOINT", str(DUMMY_RANK))
        result = train_on_slurm(
            slurm_config(), make_manifest(tmp / "fp123"), run_dir, on_line=lines.append, on_job=jobs.append
        )
    return run_dir, result, lines, jobs


def test_a_two_node_job_completes_and_streams_every_rank_labelled_with_its_node(completed, slurm_cluster):
    run_dir, result, lines, jobs = completed
    assert result.model_path == str(run_dir / "model.pt") and Path(result.model_path).is_file()
    # The stand-in's last epoch line (train.epochs, the default), from rank 0 of a world of two nodes x one rank.
    last = DEFAULT_EPOCHS - 1
    assert result.metrics == {"epoch": last, "val_loss": 1 / (last + 1), "world_size": 2} and result.restarts == 0
    [job_id] = jobs
    job = slurm_cluster.job(job_id)
    assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2" and job["NodeList"] == "n[1-2]", job

    done = [line for line in lines if isinstance(line, SlurmLine) and line.text.endswith(" done")]
    # One rank per node; the label carries the GLOBAL rank (both local ranks are 0) and the node.
    assert sorted((line.rank, line.text) for line in done) == [(0, "rank 0 done"), (1, "rank 1 done")], done
    assert {line.node for line in done} == {"n1", "n2"}
    assert all(str(line) == f"[{line.node} rank {line.rank}] {line.text}" for line in done)
    assert any(str(line).startswith("[slurm] submitted job ") for line in lines)


def test_the_job_is_recorded_in_the_run_directory_for_people_and_for_reattaching(completed):
    run_dir, _, _, jobs = completed
    record = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert record["job_id"] == jobs[0]
    assert record["sbatch"][:2] == ["sbatch", "--parsable"] and record["sbatch"][-1] == str(
        run_dir / "slurm" / "job.sh"
    )
    assert "--nodes=2" in record["sbatch"] and "--ntasks-per-node=1" in record["sbatch"]
    end = json.loads((run_dir / "slurm" / jobs[0] / "end.json").read_text())
    assert end["exit_code"] == 0 and end["how"] == "finished", "the job wrote its own end"
    script = (run_dir / "slurm" / "job.sh").read_text()
    assert "srun --ntasks-per-node=1" in script and '--rdzv-id "job-$SLURM_JOB_ID"' in script
    assert 'PET_RDZV_CONF="is_host=$(( SLURM_NODEID == 0 ))"' in script
    assert (run_dir / "slurm" / jobs[0] / "n1" / "logs").is_dir() and (run_dir / "slurm" / jobs[0] / "n2").is_dir()


def test_a_run_directory_whose_job_completed_is_not_run_again(completed, slurm_cluster):
    run_dir, first, _, jobs = completed
    lines = []
    again = train_on_slurm(slurm_config(), run_dir.parent / "fp123", run_dir, on_line=lines.append)
    assert again.model_path == first.model_path
    assert jobs_of(slurm_cluster, run_dir) == jobs, "no second job"
    assert any("already COMPLETED" in line.text for line in lines)


# ----------------------------------------------------------------------------- failures


def test_a_failing_rank_is_reported_with_its_node_rank_and_exception(slurm_cluster, stand_in_rank, tmp_path):
    stand_in_rank.setenv("DUMMY_RANK_MODE", "raise")  # rank 1 raises at its first step; sbatch passes the env on
    with pytest.raises(RankFailed) as failure:
        train_on_slurm(slurm_config(), make_manifest(tmp_path / "fp123"), tmp_path / "run", on_line=print)
    message = str(failure.value)
    assert failure.value.rank == 1 and failure.value.exitcode == 1
    assert "ended FAILED on n[1-2]: node n" in message, message
    assert "rank 1 failed with exit code 1: ValueError: dummy failure on rank 1 at step 0" in message, message
    assert Path(failure.value.log_file).is_file() and str(tmp_path / "run" / "slurm") in failure.value.log_file


def test_a_node_that_cannot_see_the_dataset_stops_the_job_naming_the_node_and_the_path(
    slurm_cluster, stand_in_rank, tmp_path
):
    if slurm_cluster.hidden_from_n2 is None:
        skip_or_fail_in_ci("this machine cannot make the private mount namespace that hides a folder from n2")
    dataset = make_manifest(slurm_cluster.hidden_from_n2 / "fp-hidden")  # here and on n1, not on n2
    lines = []
    with pytest.raises(SlurmSetupError) as failure:
        train_on_slurm(slurm_config(), dataset, tmp_path / "run", on_line=lines.append)
    message = str(failure.value)
    assert f"node n2 cannot see {dataset / 'manifest.json'}" in message, message
    assert "node n1" not in message and "shared filesystem" in message
    assert not [line for line in lines if getattr(line, "rank", None) is not None], "no rank started"


@pytest.mark.parametrize(
    ("train", "slurm", "says"),
    [
        (
            {},
            {"partition": "nope"},
            "slurm.partition: 'nope' does not exist on this cluster; it has ['debug', 'short']",
        ),
        ({"nnodes": 3}, {}, "train.nnodes: 3 nodes asked for, but partition 'debug' has 2"),
        ({}, {"sbatch_args": ["--mem=999999"]}, "sbatch refused the job (exit 1): sbatch: error:"),
    ],
)
def test_a_job_slurm_cannot_run_fails_before_anything_is_submitted(
    slurm_cluster, stand_in_rank, tmp_path, train, slurm, says
):
    with pytest.raises(SlurmSetupError) as failure:
        train_on_slurm(slurm_config(train, slurm), make_manifest(tmp_path / "fp123"), tmp_path / "run")
    assert says in str(failure.value), str(failure.value)
    assert isinstance(failure.value, ValueError), "not retried: it would fail the same way"
    # (A submission sbatch refuses still leaves a FAILED record in Slurm: nothing of it ever ran.)
    assert not slurm_cluster.active_job_ids() and not (tmp_path / "run" / "slurm" / "job.json").exists()


def test_missing_slurm_commands_are_named_before_anything_is_submitted(slurm_cluster, stand_in_rank, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    stand_in_rank.setenv("PATH", str(empty))
    with pytest.raises(SlurmSetupError, match=r"not found on PATH: sbatch, scontrol, scancel"):
        train_on_slurm(slurm_config(), make_manifest(tmp_path / "fp123"), tmp_path / "run")
    assert not (tmp_path / "run" / "slurm").exists()


# ----------------------------------------------------------------------------- stopping


def test_a_pending_reason_is_said_and_the_timeout_cancels_the_pending_job(slurm_cluster, stand_in_rank, tmp_path):
    # Partition "short" allows 1 minute: a job asking for 5 stays PENDING (PartitionTimeLimit) forever.
    config = slurm_config({"timeout_s": 4}, {"partition": "short", "time_limit": "00:05:00"})
    lines = []
    with pytest.raises(LaunchTimeout) as failure:
        train_on_slurm(config, make_manifest(tmp_path / "fp123"), tmp_path / "run", on_line=lines.append)
    message = str(failure.value)
    assert "train.timeout_s=4s while Slurm job" in message and "PENDING (PartitionTimeLimit" in message, message
    said = [line for line in lines if "is PENDING: PartitionTimeLimit" in line.text]
    assert len(said) == 1 and said[0].is_torchrun_warning, "said once, at warning level"
    [job_id] = jobs_of(slurm_cluster, tmp_path / "run")
    assert slurm_cluster.job(job_id)["JobState"] == "CANCELLED"


def test_cancellation_runs_scancel_and_nothing_of_the_job_is_left(slurm_cluster, stand_in_rank, tmp_path):
    stand_in_rank.setenv("DUMMY_RANK_MODE", "hang")
    run_dir = tmp_path / "run"
    started = set()

    def on_line(line):
        if line.text.startswith("rank ") and " started " in line.text:
            started.add(line.rank)

    def cancelled():
        return "flow run X was cancelled (Cancelling)" if started == {0, 1} else None

    with pytest.raises(LaunchInterrupted, match=r"flow run X was cancelled \(Cancelling\); cancelled Slurm job \d+"):
        train_on_slurm(
            slurm_config(), make_manifest(tmp_path / "fp123"), run_dir, on_line=on_line, should_cancel=cancelled,
            cancel_check_s=0.2,
        )  # fmt: skip
    [job_id] = jobs_of(slurm_cluster, run_dir)
    assert slurm_cluster.job(job_id)["JobState"] == "CANCELLED", "confirmed before the launch returned"
    assert_nothing_left(slurm_cluster, run_dir, job_id)


def start_launcher(tmp_path: Path, config: PipelineConfig, **env: str) -> tuple[subprocess.Popen, Path]:
    """The Slurm launcher in a process of its own (stand-in ranks); its output in tmp_path/launcher.out."""
    config_json = tmp_path / "config.json"
    config_json.write_text(config.model_dump_json())
    run_dir = tmp_path / "run"
    with open(tmp_path / "launcher.out", "w") as out:  # the child keeps its own copy of the file
        process = subprocess.Popen(
            [
                sys.executable,
                str(RUN_SLURM_LAUNCHER),
                str(config_json),
                str(make_manifest(tmp_path / "fp123")),
                str(run_dir),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
    return process, run_dir


def launcher_output(tmp_path: Path) -> str:
    return (tmp_path / "launcher.out").read_text()


def test_sigterm_to_the_launcher_cancels_the_job_and_nothing_is_left(slurm_cluster, tmp_path):
    process, run_dir = start_launcher(tmp_path, slurm_config(), DUMMY_RANK_MODE="hang")
    try:
        both = lambda: "rank 0 started" in launcher_output(tmp_path) and "rank 1 started" in launcher_output(tmp_path)  # noqa: E731
        wait_until(both, 120, f"both ranks to start: {launcher_output}")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM, "the default SIGTERM still ends the process"
    finally:
        if process.poll() is None:
            process.kill()
    [job_id] = jobs_of(slurm_cluster, run_dir)
    assert_nothing_left(slurm_cluster, run_dir, job_id)


def test_a_killed_launcher_is_reattached_to_its_running_job_not_resubmitted(slurm_cluster, stand_in_rank, tmp_path):
    # The stand-in ranks print 40 lines, one every 0.25 s: the job outlives the first launcher.
    stand_in_rank.setenv("DUMMY_RANK_LINES", "40")
    stand_in_rank.setenv("DUMMY_RANK_INTERVAL", "0.25")
    process, run_dir = start_launcher(tmp_path, slurm_config())
    try:
        wait_until(lambda: "rank 0 step 1" in launcher_output(tmp_path), 120, "the ranks to step")
        process.kill()  # as an OOM kill or a lost worker would: no finally, no scancel
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    [job_id] = jobs_of(slurm_cluster, run_dir)
    assert slurm_cluster.job(job_id)["JobState"] == "RUNNING", "the job does not depend on the launcher's process"

    lines, jobs = [], []
    result = train_on_slurm(slurm_config(), tmp_path / "fp123", run_dir, on_line=lines.append, on_job=jobs.append)
    assert jobs == [job_id] and jobs_of(slurm_cluster, run_dir) == [job_id], "no second job"
    assert any(f"reattached to job {job_id}" in line.text for line in lines)
    assert any(line.text == "rank 1 done" for line in lines), "the reattached launcher streams the job's lines"
    assert Path(result.model_path).is_file() and slurm_cluster.job(job_id)["JobState"] == "COMPLETED"
    assert f"JOB {job_id}" in launcher_output(tmp_path).splitlines(), "the killed launcher had submitted it"


# ----------------------------------------------------------------------------- preemption: requeued mid-epoch


# Rank 0 pauses 1 s before step 5 of the epoch, once per run directory (training/loop/hooks.py): the requeue's
# SIGTERM reaches the ranks there, and they save after that step, within the cluster's KillWait of 2 s.
PAUSE = "pause:rank=0:epoch=0:step=5:seconds=1"


# How the job is told: `scontrol requeue` (an admin, or a scheduler preempting with PreemptMode=REQUEUE: TERM to
# every process of the job, KILL after KillWait); the time limit's signal, sbatch --signal=B:USR1@N, which goes
# to the batch script alone (sent here by `scancel --batch --signal=USR1`, as slurmctld sends it).
REQUEUE = ["scontrol", "requeue"]
TIME_LIMIT_SIGNAL = ["scancel", "--batch", "--signal=USR1"]


@pytest.mark.parametrize(("told_by", "signal_name"), [(REQUEUE, "SIGTERM"), (TIME_LIMIT_SIGNAL, "SIGUSR1")])
def test_a_job_requeued_mid_epoch_saves_its_step_and_the_requeued_job_resumes_and_completes(
    slurm_cluster, tmp_path, monkeypatch, told_by, signal_name
):
    """Told mid-epoch, the real ranks on both nodes save a step checkpoint at the step they are in (the batch
    script passes the time limit's signal on to them); the job is requeued (by Slurm, or by itself once its ranks
    saved: sbatch --requeue), the same job runs again, resumes at that step and completes; the launcher follows
    the one job to its end."""
    from training.core.config import load_config
    from training.prepare.dataset import prepare_dataset

    source = "synthetic://classification?rows=4000&features=8&classes=3&seed=0"
    data = load_config(None, [f"data.source={source}", f"data.root={tmp_path / 'shards'}"]).data
    dataset = prepare_dataset(data).dataset_dir
    run_dir = tmp_path / "run"
    train = {"batch_size": 64, "epochs": 1, "model_kwargs": {"hidden": [16]}, "num_threads": 1}
    config = slurm_config({**train, "progress_interval_s": 0.2, "collective_timeout_s": 60})
    monkeypatch.setenv("DDPFLOW_FAULT", PAUSE)  # sbatch hands the environment to the job
    lines, jobs, outcome = [], [], {}

    def train_in_thread() -> None:
        try:
            outcome["result"] = train_on_slurm(config, dataset, run_dir, on_line=lines.append, on_job=jobs.append)
        except BaseException as error:
            outcome["error"] = error

    worker = threading.Thread(target=train_in_thread)
    worker.start()
    wait_until(lambda: (run_dir / ".fault-pause-done").exists() or not worker.is_alive(), 180, "the pause")
    assert jobs, lines
    subprocess.run([*told_by, jobs[0]], check=True, capture_output=True)
    # Slurm holds a requeued job back a while (BeginTime, about 2 minutes here); that wait is Slurm's, not ours.
    wait_until(lambda: slurm_cluster.job(jobs[0]).get("JobState") == "PENDING", 60, "the job to be requeued")
    # Not in the second of the requeue: slurmd refuses a credential of the second its job's last run was revoked
    # in ("Killing non-startable batch JobId=N: Job credential revoked"; the job then FAILED: 3 of 5 runs).
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={jobs[0]}", "StartTime=now"], check=True, capture_output=True)
    worker.join(timeout=300)
    assert "error" not in outcome, (outcome, [str(line) for line in lines][-60:])
    assert Path(outcome["result"].model_path).is_file()
    assert jobs_of(slurm_cluster, run_dir) == jobs, "one job, requeued: not a second one"
    assert slurm_cluster.job(jobs[0])["JobState"] == "COMPLETED"
    output = (run_dir / "slurm" / f"{jobs[0]}.out").read_text()
    saved = re.search(rf"preempted by {signal_name}: saved step (\d+) of epoch 1", output)
    assert saved, output[-4000:]
    assert f"at step {saved[1]} of epoch 0" in output, output[-4000:]  # the requeued job's "resumed from" line
    assert (
        len(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]))
        and not (run_dir / "preempted.json").exists()
    )
