"""How a user's training script is launched (train.script), without starting it: the config it takes, the
preflight, the rank program and environment, and what its failure says."""

from __future__ import annotations

import pytest

from ddpflow.launch.command import launch_env, rank_program, rank_workdir, torchrun_command
from ddpflow.launch.failure import ScriptFailed, failure_from_output, traceback_tail
from training.core.config import ConfigError, PipelineConfig, validate_config
from training.core.layout import JOB_ENV
from training.preflight import check_machine


def test_a_script_may_go_without_a_data_section_and_nothing_else_may():
    script = validate_config({"train": {"script": "train.py", "script_args": ["4", "1"]}})
    assert script.data is None
    assert (
        validate_config({"train": {"script": "train.py"}, "data": {"source": "t.parquet"}}).data.source == "t.parquet"
    )
    assert PipelineConfig.model_validate_json(script.model_dump_json()).data is None  # config.json, a Prefect param
    assert validate_config({}).data is not None  # ddpflow's own trainer: the section's defaults
    with pytest.raises(ConfigError, match="data: only a run of train.script may go without its data section"):
        validate_config({"data": None})


def test_the_preflight_names_a_missing_or_foreign_script_and_leaves_model_checks_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"train.script: no file at .*/missing\.py"):
        check_machine(validate_config({"train": {"script": "missing.py"}}), gpus=0)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"train.script: notes.txt is not a Python file \(.py\)"):
        check_machine(validate_config({"train": {"script": "notes.txt"}}), gpus=0)
    (tmp_path / "train.py").write_text("")
    # ddpflow's model and objective settings are not the script's: an import path that does not exist is fine.
    config = validate_config({"train": {"script": "train.py", "model": "nowhere:factory", "nproc_per_node": 2}})
    assert check_machine(config, gpus=0).nproc_per_node == 2


def test_every_rank_runs_the_script_with_its_arguments_in_the_directory_the_run_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = validate_config(
        {"train": {"script": "/p/train.py", "script_args": ["4", "1"], "script_params": {"lr": 0.1, "tag": "a b"}}}
    )
    job = tmp_path / "run" / "train_config.json"
    assert rank_program(config, job) == ["/p/train.py", "4", "1", "--lr", "0.1", "--tag", "a b"]
    argv = torchrun_command(config, job, gpus=0)
    assert argv[argv.index("/p/train.py") :] == ["/p/train.py", "4", "1", "--lr", "0.1", "--tag", "a b"]
    assert "--config" not in argv  # the script's own arguments only
    assert launch_env(config, tmp_path / "run", gpus=0, base={})[JOB_ENV] == str(job)
    assert rank_workdir(config) == tmp_path
    builtin = validate_config({})
    assert rank_program(builtin, job) == ["-m", "training.train", "--config", str(job)]
    assert JOB_ENV not in launch_env(builtin, tmp_path / "run", gpus=0, base={})


RANK_LOG = """\
[GPU1] Epoch 0 | Steps: 16
[rank1]: Traceback (most recent call last):
[rank1]:   File "/p/train.py", line 140, in <module>
[rank1]:     main()
[rank1]:   File "/p/train.py", line 72, in _run_epoch
[rank1]:     raise ValueError(f"bad batch in epoch {epoch}")
[rank1]: ValueError: bad batch in epoch 1
"""


def test_a_scripts_failure_is_its_own_error_with_the_last_lines_of_its_traceback(tmp_path):
    assert traceback_tail(RANK_LOG).splitlines() == [
        "Traceback (most recent call last):",
        '  File "/p/train.py", line 140, in <module>',
        "    main()",
        '  File "/p/train.py", line 72, in _run_epoch',
        '    raise ValueError(f"bad batch in epoch {epoch}")',
        "ValueError: bad batch in epoch 1",
    ]
    deep = "Traceback (most recent call last):\n" + "".join(
        f'  File "x.py", line {i}, in f\n    f()\n' for i in range(30)
    )
    assert len(traceback_tail(deep + "RecursionError: too deep\n").splitlines()) == 15
    attempt = tmp_path / "logs" / "job" / "attempt_0"
    (attempt / "1").mkdir(parents=True)
    (attempt / "1" / "stderr.log").write_text(RANK_LOG)
    tail = ["Root Cause (first observed failure):", "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 9)"]
    failure = failure_from_output(tmp_path, attempt.parent, tail, 1, show_traceback=True)
    assert isinstance(failure, ScriptFailed)
    assert failure.headline.startswith("rank 1 failed with exit code 1: ValueError: bad batch in epoch 1 (its log: ")
    assert failure.traceback.endswith("ValueError: bad batch in epoch 1")
    assert not isinstance(failure_from_output(tmp_path, attempt.parent, tail, 1), ScriptFailed)  # ddpflow's ranks
