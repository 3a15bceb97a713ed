"""A user's own DDP training script through `ddpflow run` (train.script): real torchrun with 2 gloo ranks, the
session's Prefect harness, MLflow on SQLite. The script is the PyTorch DDP tutorial's way of writing one
(tests/scripts/ddp_tutorial.py); the variants add the lines a user would (tests/flows/script_variants.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from mlflow import MlflowClient

from tests.flows.cli_runs import cli_env
from tests.flows.script_variants import (
    TUTORIAL,
    failing_on_rank_one,
    killed_once,
    sha256,
    tutorial_text,
    with_three_lines,
)
from tests.flows.serve_cli import as_from_a_terminal

pytestmark = pytest.mark.torchrun

STOPPABLE = TUTORIAL.with_name("stoppable.py")
REPO = Path(__file__).resolve().parents[2]
PREEMPT_GRACE_S = 20.0


def script_config(project: Path, tracking_uri: str, script: str, args: list[str], **train) -> dict:
    unique = uuid.uuid4().hex[:8]
    return {
        "train": {
            "script": script,  # relative: the directory `ddpflow run` starts in
            "script_args": args,
            "nproc_per_node": 2,
            "backend": "gloo",
            "run_root": str(project / "runs"),
            "max_restarts": 0,
            "timeout_s": 300,
            "preempt_grace_s": PREEMPT_GRACE_S,
            **train,
        },
        "registry": {"model_name": f"script-{unique}"},
        "mlflow": {"tracking_uri": tracking_uri, "experiment": f"scripts-{unique}"},
    }


def run_cli(project: Path, config: dict, prefect_api_url: str, *extra: str) -> subprocess.CompletedProcess:
    (project / "run.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "run.yaml", *extra],
        cwd=project, env=cli_env(prefect_api_url), capture_output=True, text=True, timeout=540,
    )  # fmt: skip


def mlflow_run(config: dict):
    client = MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(config["mlflow"]["experiment"])
    (found,) = client.search_runs([experiment.experiment_id])
    return client, found


def artifacts(client: MlflowClient, run_id: str, path: str = "") -> list[str]:
    names = []
    for item in client.list_artifacts(run_id, path):
        names += artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return names


@pytest.fixture(scope="module")
def zero_edits(tmp_path_factory, tracking_uri, prefect_harness):
    """The tutorial script, unmodified, through `ddpflow run --json`: 2 epochs, a snapshot every epoch."""
    project = tmp_path_factory.mktemp("zero-edits")
    (project / "ddp_tutorial.py").write_text(tutorial_text())
    config = script_config(project, tracking_uri, "ddp_tutorial.py", ["2", "1", "--batch_size", "64"])
    return project, config, run_cli(project, config, prefect_harness, "--json")


@pytest.fixture(scope="module")
def three_lines(tmp_path_factory, tracking_uri, prefect_harness):
    """The same script with ddpflow's three lines (import, report, log_model)."""
    project = tmp_path_factory.mktemp("three-lines")
    (project / "tracked.py").write_text(with_three_lines(tutorial_text()))
    config = script_config(project, tracking_uri, "tracked.py", ["2", "1"])
    return project, config, run_cli(project, config, prefect_harness, "--json")


def test_an_unmodified_script_runs_tracked_and_has_nothing_to_register(zero_edits):
    project, config, done = zero_edits
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert (summary["decision"], summary["model_version"]) == ("tracked", None)
    assert summary["reason"] == "the script logged no model (ddpflow.log_model), so there is nothing to register"
    # Every rank's lines streamed with its rank; each rank's own log files in the run directory.
    assert "[rank 1] [GPU1] Epoch 1 | Steps: 16" in done.stderr and "[rank 0] [GPU0] Epoch 1" in done.stderr
    run_dir = Path(summary["run_dir"])
    for rank in (0, 1):
        (log,) = run_dir.glob(f"logs/*/attempt_0/{rank}/stdout.log")
        assert f"[GPU{rank}] Epoch 1 | Steps: 16" in log.read_text()
    assert (project / "snapshot.pt").is_file()  # the script's own relative path: where `ddpflow run` started
    client, run = mlflow_run(config)
    assert run.info.status == "FINISHED"
    params = run.data.params
    script = project / "ddp_tutorial.py"
    assert (params["train.script"], params["train.script_sha256"]) == (str(script), sha256(script))
    assert json.loads(params["train.script_args"]) == ["2", "1", "--batch_size", "64"]
    assert run.data.tags["prefect.flow_run_id"] == summary["flow_run_id"]
    assert run.data.tags["registry.decision"] == "tracked"
    logged = artifacts(client, run.info.run_id)
    assert "script/ddp_tutorial.py" in logged
    assert {path.rsplit("/", 2)[-2:][0] for path in logged if path.endswith("stdout.log")} == {"0", "1"}


def test_three_added_lines_register_a_champion_that_predicts_as_the_script_does_without_it(three_lines):
    project, config, done = three_lines
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert (summary["decision"], summary["model_version"]) == ("promoted", "1"), summary
    assert summary["reason"].startswith("first model: no champion yet (test_mse=")
    assert "the rule against guessing (registry.min_lift) could not apply" in summary["warning"]
    client, run = mlflow_run(config)
    history = client.get_metric_history(run.info.run_id, "test_mse")
    assert [metric.step for metric in history] == [0, 1]  # each report at its step
    assert summary["test_metrics"]["test_mse"] == pytest.approx(history[-1].value)
    # The served model, in a process that cannot import the script (another directory, nothing of the project's
    # on its path), answers as the script's own model does: its snapshot of the last epoch.
    x = np.random.default_rng(0).random((7, 20), dtype=np.float32)
    np.save(project / "x.npy", x)
    code = (
        "import importlib.util, sys, mlflow, numpy as np\n"
        "assert importlib.util.find_spec('tracked') is None\n"
        f"mlflow.set_tracking_uri({config['mlflow']['tracking_uri']!r})\n"
        f"model = mlflow.pyfunc.load_model('models:/{config['registry']['model_name']}@champion')\n"
        f"np.save({str(project / 'served.npy')!r}, model.predict(np.load({str(project / 'x.npy')!r})))\n"
    )
    elsewhere = project / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    served = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert served.returncode == 0, served.stderr[-3000:]
    snapshot = torch.load(project / "snapshot.pt", weights_only=True)
    net = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    net.load_state_dict(snapshot["MODEL_STATE"])
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.load(project / "served.npy"), expected, atol=1e-5)


def test_the_same_file_still_runs_under_a_bare_torchrun(tmp_path):
    (tmp_path / "tracked.py").write_text(with_three_lines(tutorial_text()))
    env = {k: v for k, v in cli_env().items() if k != "DDPFLOW_JOB"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, "tracked.py", "2", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if "ddpflow:" in line]
    assert len(said) == 2 and "report() records nothing" in said[0] and "log_model() exports nothing" in said[1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["snapshot.pt", "tracked.py"]


def test_a_failing_script_is_one_error_with_its_rank_exit_code_and_traceback(tmp_path, tracking_uri, prefect_harness):
    (tmp_path / "failing.py").write_text(failing_on_rank_one(tutorial_text()))
    config = script_config(tmp_path, tracking_uri, "failing.py", ["3", "1"])
    done = run_cli(tmp_path, config, prefect_harness)
    assert done.returncode == 2, done.stderr[-4000:]  # the user's own error
    lines = done.stderr.splitlines()
    # Exit code 1, or -6 where torch's teardown of the script's live gloo group aborts the process after its
    # traceback ("terminate called without an active exception"): the error names the script's exception either way.
    error = r"error: rank 1 failed with exit code (1|-6): ValueError: bad batch in epoch 1 \(its log: "
    assert re.match(error, lines[-1]), lines[-1]
    start = max(i for i, line in enumerate(lines) if line == "Traceback (most recent call last):")
    shown = lines[start:-1]  # the script's traceback, printed once just before the error line
    assert 3 <= len(shown) <= 15 and shown[-1] == "ValueError: bad batch in epoch 1", "\n".join(lines[-20:])
    assert all("failing.py" in line for line in shown if line.startswith("  File "))
    # No traceback of ddpflow's own (Prefect's records of the failed task and flow stay in the log file and the
    # UI); the ranks' own lines stream as they came, each behind its rank.
    assert [line for line in lines if line.startswith("Traceback")] == ["Traceback (most recent call last):"]
    assert "Retry" not in done.stderr  # the script's error would come again: torchrun's restarts are its retries
    client, run = mlflow_run(config)
    assert run.info.status == "FAILED"
    assert any(path.endswith("1/stderr.log") for path in artifacts(client, run.info.run_id))
    (log,) = Path(config["train"]["run_root"]).glob("*/logs/*/attempt_0/1/stderr.log")  # kept
    assert "ValueError: bad batch in epoch 1" in log.read_text()


def test_a_killed_rank_is_restarted_by_torchrun_and_the_script_resumes_from_its_snapshot(
    tmp_path, tracking_uri, prefect_harness
):
    (tmp_path / "killed.py").write_text(killed_once(tutorial_text()))
    config = script_config(tmp_path, tracking_uri, "killed.py", ["3", "1"], max_restarts=1)
    done = run_cli(tmp_path, config, prefect_harness, "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert (summary["decision"], summary["restarts"]) == ("tracked", 1)
    assert "Resuming training from snapshot at Epoch 1" in done.stderr
    assert "[rank 1] [GPU1] Epoch 2 | Steps: 32" in done.stderr


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _start(project: Path, config: dict, prefect_api_url: str) -> subprocess.Popen:
    (project / "run.yaml").write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "--config", "run.yaml"],
        cwd=project, env=cli_env(prefect_api_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1, preexec_fn=as_from_a_terminal,
    )  # fmt: skip


def _read_until(process: subprocess.Popen, marker: str, within_s: float = 240) -> list[str]:
    lines, deadline = [], time.monotonic() + within_s
    for line in process.stdout:
        lines.append(line)
        if marker in line or time.monotonic() > deadline:
            break
    assert any(marker in line for line in lines), "".join(lines[-60:])
    return lines


def test_sigterm_stops_the_whole_tree_within_the_grace_and_a_saving_script_resumes_where_it_stopped(
    tmp_path, tracking_uri, prefect_harness
):
    """SIGTERM to `ddpflow run`: a plain script (no handler of its own) is stopped with its whole tree; a script
    that calls ddpflow.should_stop() saves in checkpoint_dir() and returns; the same command resumes it there."""
    (tmp_path / "stoppable.py").write_text(STOPPABLE.read_text())
    config = script_config(tmp_path, tracking_uri, "stoppable.py", ["--steps", "200", "--sleep", "0.1"])
    process = _start(tmp_path, config, prefect_harness)
    try:
        _read_until(process, "step 5 done")
        tree = _tree(process.pid)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output = process.stdout.read()
        assert process.wait(timeout=PREEMPT_GRACE_S + 30) == 143, output[-4000:]
        took = time.monotonic() - sent
    finally:
        process.kill()
    assert took < PREEMPT_GRACE_S, output[-3000:]
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    saved = int(output.split("stopping: saved step ")[1].split()[0])
    (log,) = (tmp_path / ".ddpflow" / "logs").glob(f"run-*-{process.pid}.log")  # SIGTERM: nobody at a console
    assert "re-run the same command to resume from what the script saved in" in log.read_text()
    client, killed = mlflow_run(config)
    assert killed.info.status == "KILLED" and killed.data.tags["ddpflow.preempted"] == "true"

    again = run_cli(tmp_path, config, prefect_harness, "--json")  # the same command: resumes where it stopped
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at step {saved}" in again.stderr
    summary = json.loads(again.stdout)
    assert summary["decision"] == "promoted" and summary["test_metrics"]["test_loss"] < 1.0


def test_sigterm_stops_a_script_that_does_not_catch_it_and_leaves_nothing(tmp_path, tracking_uri, prefect_harness):
    (tmp_path / "ddp_tutorial.py").write_text(tutorial_text())
    config = script_config(tmp_path, tracking_uri, "ddp_tutorial.py", ["500", "100", "--batch_size", "4"])
    process = _start(tmp_path, config, prefect_harness)
    try:
        _read_until(process, "Epoch 0 | Steps")
        tree = _tree(process.pid)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output = process.stdout.read()
        assert process.wait(timeout=PREEMPT_GRACE_S + 30) == 143, output[-4000:]
    finally:
        process.kill()
    assert time.monotonic() - sent < PREEMPT_GRACE_S
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert mlflow_run(config)[1].info.status == "KILLED"


def test_a_loop_over_ddpflow_dataset_sees_each_row_once_and_its_model_is_evaluated_gated_and_served(
    tmp_path, tracking_uri, prefect_harness
):
    """With a data section: prepare as for ddpflow's own models, the script's loop over ddpflow.dataset("train")
    with a plain DistributedSampler, its model (the model contract) exported, evaluated by ddpflow on the test split
    with its baselines, gated, and served on the source's raw rows through the dataset's encoders."""
    import mlflow
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ddpflow.script.data import PreparedSplit
    from ddpflow.tracking.runs import use_tracking_uri
    from tests.flows.test_mixed_inputs import INPUTS, churn_table, read_back
    from training.core.manifest import read_manifest
    from training.inference.model_file import load_model_checkpoint

    source = tmp_path / "churn.parquet"
    pq.write_table(churn_table(rows=3000), source)
    (tmp_path / "table_loop.py").write_text(TUTORIAL.with_name("table_loop.py").read_text())
    config = script_config(tmp_path, tracking_uri, "table_loop.py", ["--epochs", "3"])
    config["data"] = {
        "source": "churn.parquet",  # relative, as train.script: where `ddpflow run` starts
        "label": "churned",
        "key": "customer_id",
        "inputs": INPUTS,
        "root": str(tmp_path / "shards"),
    }
    done = run_cli(tmp_path, config, prefect_harness, "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["decision"] == "promoted", summary
    dataset = Path(summary["dataset_dir"])
    manifest = read_manifest(dataset)
    assert summary["test_metrics"]["test_samples"] == manifest.rows("test")  # ddpflow's exact evaluation
    assert summary["test_metrics"]["test_accuracy"] > 0.8  # the label is two of five countries
    assert "guessing" in summary["baselines"]["comparison"]  # its baselines (a vector input: no reference model)
    assert summary["baselines"]["trivial"]["test_accuracy"] < 0.7

    # Each row of the train split once per epoch across the ranks (a DistributedSampler pads to a multiple of 2).
    run_dir = Path(summary["run_dir"])
    seen = [json.loads((run_dir / "checkpoints" / f"seen-rank{r}.json").read_text()) for r in (0, 1)]
    rows = manifest.rows("train")
    for epoch in range(3):
        together = seen[0][epoch] + seen[1][epoch]
        assert set(together) == set(range(rows)) and len(together) == rows + rows % 2

    # Served: the source's own rows of the test split, read back every way a user reads them, answer as the
    # exported model does on the prepared test rows.
    test = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    model, _ = load_model_checkpoint(run_dir / "model.pt")
    prepared = PreparedSplit(dataset, "test")
    with torch.no_grad():
        expected = np.asarray(manifest.label_mapping)[model(prepared.batch(0, len(prepared))).argmax(dim=1).numpy()]
    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
    for how, frame in read_back(source).items():
        rows_of_test = frame.set_index("customer_id").loc[test["customer_id"]][list(INPUTS)]
        np.testing.assert_array_equal(np.asarray(served.predict(rows_of_test)), expected, err_msg=how)
    assert isinstance(served.predict(rows_of_test.head(3), params={"output": "probabilities"}), pd.DataFrame)


def test_a_sweep_over_a_script_parameter_prunes_a_trial_from_its_reports_and_registers_the_best(
    tmp_path, tracking_uri, prefect_harness
):
    """`ddpflow sweep` over train.script_params.lr: four trials of the script (1 rank each), judged by the val_loss
    it reports; the median pruner stops the fourth (lr 1e-6 barely learns) through its should_stop(), and only the
    best trial's model goes through the gate."""
    (tmp_path / "stoppable.py").write_text(STOPPABLE.read_text())
    args = ["--steps", "24", "--report_every", "4", "--sleep", "0.1"]
    config = script_config(tmp_path, tracking_uri, "stoppable.py", args, nproc_per_node=1)
    lrs = [0.05, 0.02, 0.1, 1e-6]  # each learns faster than the median of those before it, but the last
    config["sweep"] = {
        "trials": 4,
        "objective": "val_loss",
        "sampler": "random",
        "pruner": "median",
        "startup_trials": 2,
        "name": f"script-sweep-{uuid.uuid4().hex[:6]}",
        "space": {"train.script_params.lr": {"choices": lrs}},
        "enqueue": [{"train.script_params.lr": lr} for lr in lrs],  # a known order
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "sweep", "--config", "sweep.yaml", "--json"],
        cwd=tmp_path, env=cli_env(prefect_harness), capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["trials"] == {"complete": 3, "pruned": 1, "failed": 0}, done.stderr[-3000:]
    assert "trial 3 {'script_params.lr': 1e-06}: pruned at step 3 " in done.stderr
    # Its should_stop() turned True: it saved and returned early, and logged no model.
    trial_3 = Path(config["train"]["run_root"]).glob("sweeps/*/trials/*-trial-003")
    (trial_3,) = list(trial_3)
    assert (trial_3 / "checkpoints" / "state.pt").is_file() and not (trial_3 / "script" / "model.pt2").exists()
    assert summary["best_params"]["train.script_params.lr"] in (0.05, 0.1, 0.02)
    assert (summary["decision"], summary["model_version"]) == ("promoted", "1")
    client = MlflowClient(tracking_uri)
    version = client.get_model_version(config["registry"]["model_name"], "1")
    assert version.run_id == summary["best_run_id"]
    best_lr = summary["best_params"]["train.script_params.lr"]
    assert client.get_run(summary["best_run_id"]).data.params["train.script_params.lr"] == str(best_lr)


def test_the_shipped_example_runs_as_documented_and_its_model_answers_the_printed_curl(
    tmp_path, tracking_uri, prefect_harness
):
    """examples/train_ddp.yaml from a project root (docs/scripts.md): the example script is registered at
    @champion, and `ddpflow serve` of it answers its printed curl over HTTP with what the pyfunc answers."""
    import shutil

    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri
    from tests.flows.serve_cli import start_serve

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    config = yaml.safe_load((tmp_path / "examples" / "train_ddp.yaml").read_text())
    config["train"].update(script_args=["--epochs", "2"], run_root=str(tmp_path / "runs"))
    config["mlflow"].update(tracking_uri=tracking_uri, experiment=f"example-{uuid.uuid4().hex[:6]}")
    config["registry"]["model_name"] = name = f"example-{uuid.uuid4().hex[:6]}"
    done = run_cli(tmp_path, config, prefect_harness, "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert (summary["decision"], summary["gate_metric"]) == ("promoted", "test_accuracy")
    assert summary["test_metrics"]["test_accuracy"] > 0.8
    server = start_serve(name, tracking_uri, tmp_path)
    try:
        curl = subprocess.run(["bash", "-c", server.curl_line()], capture_output=True, text=True, timeout=60)
        answered = json.loads(curl.stdout)["predictions"]
        body = json.loads(server.curl_line().split(" -d ", 1)[1].strip("'"))
        assert len(body["inputs"]) == 1  # one row of the model's own example
        with use_tracking_uri(tracking_uri):
            in_process = mlflow.pyfunc.load_model(f"models:/{name}@champion").predict(
                np.asarray(body["inputs"], dtype=np.float32)
            )
        np.testing.assert_allclose(answered, in_process, rtol=1e-5)
    finally:
        assert server.stop(signal.SIGINT) == 130
    assert server.left_running() == []
