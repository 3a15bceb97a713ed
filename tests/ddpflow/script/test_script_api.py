"""ddpflow's API for a user's training script (ddpflow/script/), in one process: what each call writes in a run,
what it does under a bare torchrun (no $DDPFLOW_JOB), and the mistakes it names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import ddpflow
from ddpflow.script import run as script_run
from ddpflow.script import stopping
from ddpflow.script.export import export_module
from ddpflow.script.reporting import numbers
from ddpflow.script.run import parse_params
from training.core.layout import JOB_ENV, PREEMPTED, SCRIPT_EXAMPLE, SCRIPT_PROGRAM, SCRIPT_REFUSED, SCRIPT_REPORTS
from training.inference.model_file import exported_module
from training.loop.selection import write_stop


@pytest.fixture
def in_a_run(tmp_path, monkeypatch):
    """This process as rank 0 of a ddpflow run of a training script: its job file named in $DDPFLOW_JOB."""
    run_dir = tmp_path / "run"
    job = {
        "config": {"train": {"script": "train.py", "script_params": {"lr": 0.01, "layers": [2, 3]}}},
        "dataset_dir": None,
        "run_dir": str(run_dir),
        "init_weights": None,
    }
    (tmp_path / "train_config.json").write_text(json.dumps(job))
    monkeypatch.setenv(JOB_ENV, str(tmp_path / "train_config.json"))
    monkeypatch.setenv("RANK", "0")
    script_run.current_run.cache_clear()
    yield run_dir
    script_run.current_run.cache_clear()


def test_import_ddpflow_loads_neither_prefect_nor_mlflow_nor_torch():
    code = (
        "import sys, ddpflow; print(sorted(m for m in ('prefect', 'mlflow', 'torch', 'pydantic') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert set(ddpflow.__all__) == {"report", "log_model", "should_stop", "checkpoint_dir", "dataset", "params"}


def test_report_appends_rank_zeros_lines_and_names_a_metric_that_is_not_a_number(in_a_run, monkeypatch):
    ddpflow.report({"train_loss": torch.tensor(0.5), "step_rows": 256}, step=10)
    ddpflow.report({"test_accuracy": 0.75})
    monkeypatch.setenv("RANK", "1")
    ddpflow.report({"test_accuracy": 0.1})  # another rank's values are not kept
    lines = [json.loads(line) for line in (in_a_run / SCRIPT_REPORTS).read_text().splitlines()]
    assert [(line["step"], line["metrics"]) for line in lines] == [
        (10, {"train_loss": 0.5, "step_rows": 256.0}),
        (1, {"test_accuracy": 0.75}),  # no step given: the reports made before
    ]
    with pytest.raises(TypeError, match="metric 'accuracy' is str 'high', not a number"):
        numbers({"accuracy": "high"})
    with pytest.raises(TypeError, match="takes a dict of metric name -> number, not list"):
        numbers([0.5])


def test_params_and_checkpoint_dir_in_a_run_and_under_a_bare_torchrun(in_a_run, tmp_path, monkeypatch):
    assert ddpflow.params() == {"lr": 0.01, "layers": [2, 3]}
    assert ddpflow.checkpoint_dir() == in_a_run / "checkpoints" and (in_a_run / "checkpoints").is_dir()
    monkeypatch.delenv(JOB_ENV)
    script_run.current_run.cache_clear()
    monkeypatch.chdir(tmp_path)
    assert ddpflow.checkpoint_dir() == tmp_path / "checkpoints"
    # What ddpflow passes as --key value (ddpflow/launch/command.py: script_arguments) reads back the same.
    from ddpflow.launch.command import script_arguments

    argv = script_arguments(["4", "1"], {"lr": 0.01, "name": "wide", "layers": [2, 3], "flag": True})
    assert argv == ["4", "1", "--lr", "0.01", "--name", "wide", "--layers", "[2, 3]", "--flag", "true"]
    assert parse_params(argv) == {"lr": 0.01, "name": "wide", "layers": [2, 3], "flag": True}
    assert parse_params(["--epochs=3", "--verbose", "--out", "x.pt"]) == {"epochs": 3, "out": "x.pt"}


def test_under_a_bare_torchrun_report_and_log_model_say_so_once_on_rank_zero(tmp_path):
    code = (
        "import torch, ddpflow\n"
        "for step in range(3): ddpflow.report({'loss': 1.0}, step=step)\n"
        "ddpflow.log_model(torch.nn.Linear(2, 1), input_example=torch.zeros(1, 2))\n"
        "ddpflow.log_model(torch.nn.Linear(2, 1), input_example=torch.zeros(1, 2))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != JOB_ENV}
    rank0 = subprocess.run([sys.executable, "-c", code], env={**env, "RANK": "0"}, cwd=tmp_path, capture_output=True,
                           text=True, check=True)  # fmt: skip
    rank1 = subprocess.run([sys.executable, "-c", code], env={**env, "RANK": "1"}, cwd=tmp_path, capture_output=True,
                           text=True, check=True)  # fmt: skip
    said = [line for line in rank0.stderr.splitlines() if line.startswith("ddpflow:")]
    assert said == [
        "ddpflow: not run by ddpflow, so report() records nothing (`ddpflow run` tracks the script)",
        "ddpflow: not run by ddpflow, so log_model() exports nothing (`ddpflow run` registers it)",
    ]
    assert "ddpflow:" not in rank1.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                          torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))  # fmt: skip

    def forward(self, x):
        return self.layers(x)


class _Branching(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            return x * 2
        return x


def test_log_model_exports_the_model_in_eval_mode_with_a_dynamic_batch(in_a_run):
    torch.manual_seed(0)
    model = _Classifier()
    model(torch.randn(16, 4))  # batch-norm statistics move: the program must use the running ones
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model  # what DDP(model) holds: log_model unwraps it
    ddpflow.log_model(wrapped, input_example=torch.randn(1, 4))  # one row: doubled, the batch stays dynamic
    assert model.training  # the training model is left as it was
    program = exported_module((in_a_run / SCRIPT_PROGRAM).read_bytes())
    x = torch.randn(37, 4)
    with torch.no_grad():
        expected = model.eval()(x)
    assert torch.allclose(program(x), expected, atol=1e-6)
    example = torch.load(in_a_run / SCRIPT_EXAMPLE, weights_only=True)
    assert example["args"][0].shape == (2, 4) and example["outputs"].shape == (2, 3)


def test_a_model_torch_export_refuses_is_recorded_with_its_reason_and_the_script_goes_on(in_a_run, capsys):
    ddpflow.log_model(_Branching(), input_example=torch.ones(3, 2))
    refused = json.loads((in_a_run / SCRIPT_REFUSED).read_text())
    assert refused["error"] and refused["reason"]  # torch.export's own words
    assert not (in_a_run / SCRIPT_PROGRAM).exists()
    assert "log_model could not export the model, so it will not be registered" in capsys.readouterr().out
    program, _, outputs = export_module(_Classifier().eval(), (torch.randn(3, 4),))  # a model it takes: bytes
    assert isinstance(program, bytes) and outputs.shape == (3, 3)


def test_log_model_without_an_example_needs_a_data_section(in_a_run):
    from ddpflow.script.export import NoExampleError

    with pytest.raises(NoExampleError, match="needs input_example=.*no data section"):
        ddpflow.log_model(_Classifier())


def test_should_stop_turns_true_on_a_signal_and_records_the_stop(in_a_run, monkeypatch):
    monkeypatch.setattr(stopping, "_watch", stopping._Watch())
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert ddpflow.should_stop() is False  # the first call installs the handlers
        os.kill(os.getpid(), signal.SIGTERM)  # handled: a flag, the process goes on
        assert ddpflow.should_stop() is True
        record = json.loads((in_a_run / PREEMPTED).read_text())
        assert (record["signal"], record["script"], record["checkpoint"]) == (
            "SIGTERM",
            True,
            str(in_a_run / "checkpoints"),
        )
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, previous if signum == signal.SIGTERM else signal.getsignal(signum))
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_should_stop_turns_true_when_the_pruner_stops_the_trial_and_records_no_preemption(in_a_run, monkeypatch):
    monkeypatch.setattr(stopping, "_watch", stopping._Watch())
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        assert ddpflow.should_stop() is False
        write_stop(in_a_run)
        assert ddpflow.should_stop() is True
        assert not (in_a_run / PREEMPTED).exists()  # a pruned trial ends well: no preemption to resume
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_dataset_outside_a_run_without_a_config_says_how_to_run_the_script(monkeypatch):
    monkeypatch.delenv(JOB_ENV, raising=False)
    script_run.current_run.cache_clear()
    from ddpflow.script.data import NoDatasetError

    with pytest.raises(NoDatasetError, match="run the script with `ddpflow run --config CFG`"):
        ddpflow.dataset("train")


def test_dataset_in_a_run_without_a_data_section_names_the_section(in_a_run):
    from ddpflow.script.data import NoDatasetError

    with pytest.raises(NoDatasetError, match="has no data section"):
        ddpflow.dataset("train")


def test_dataset_outside_a_run_prepares_the_configs_data_once_and_reads_it(tmp_path, monkeypatch):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from training.core.manifest import read_manifest

    monkeypatch.delenv(JOB_ENV, raising=False)
    script_run.current_run.cache_clear()
    rng = np.random.default_rng(0)
    pq.write_table(
        pa.table({
            "id": np.arange(400, dtype=np.int64),
            "amount": np.where(rng.random(400) < 0.1, np.nan, rng.lognormal(3, 1, 400)),
            "mobile": rng.random(400) < 0.3,
            "country": rng.choice(["no", "se", "dk"], 400),
            "churned": rng.integers(0, 2, 400),
        }),
        tmp_path / "churn.parquet",
    )  # fmt: skip
    config = {
        "data": {
            "source": str(tmp_path / "churn.parquet"),
            "label": "churned",
            "key": "id",
            "inputs": {"amount": "numeric", "mobile": "numeric", "country": "categorical"},
            "root": str(tmp_path / "shards"),
        },
        "train": {"script": "train.py"},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    train = ddpflow.dataset("train", config=tmp_path / "cfg.yaml")
    (dataset_dir,) = (tmp_path / "shards").iterdir()
    assert len(train) == read_manifest(dataset_dir).rows("train") > 300
    item = train[0]
    assert set(item) >= {"amount", "mobile", "country", "label"} and item["country"].dtype == torch.int64
    assert train.n_outputs == 2 and train.inputs["country"].kind == "categorical"
    assert len(ddpflow.dataset("test", config=tmp_path / "cfg.yaml")) == read_manifest(dataset_dir).rows("test")
    assert len(list((tmp_path / "shards").iterdir())) == 1  # the prepared dataset, reused
    with pytest.raises(IndexError):
        train[len(train)]
