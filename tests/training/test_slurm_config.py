"""The slurm section and train.launcher (training/core/config.py): bad values are rejected naming the field."""

from __future__ import annotations

import pytest

from training.core.config import ConfigError, load_config, validate_config


def slurm_config(**slurm):
    return validate_config({"train": {"launcher": "slurm", "nnodes": 2}, "slurm": slurm})


def test_slurm_launcher_needs_no_rendezvous_and_defaults_are_usable():
    config = slurm_config()
    assert config.train.launcher == "slurm" and config.train.nnodes == 2
    assert config.slurm.partition is None and config.slurm.sbatch_args == [] and config.slurm.gpus_per_node == 0
    assert validate_config({}).train.launcher == "local", "today's behaviour stays the default"


def test_local_launcher_on_several_nodes_still_needs_its_rendezvous():
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        validate_config({"train": {"nnodes": 2}})


@pytest.mark.parametrize("train", [{"rdzv_endpoint": "head:29400"}, {"node_rank": 1}])
def test_slurm_launcher_rejects_the_manual_rendezvous_settings(train):
    with pytest.raises(ConfigError, match="not used with launcher 'slurm'"):
        validate_config({"train": {"launcher": "slurm", "nnodes": 2, **train}})


@pytest.mark.parametrize("limit", ["30", "30:00", "01:30:00", "2-00", "2-12:00", "1-00:00:30", "UNLIMITED"])
def test_time_limits_in_every_sbatch_form_are_accepted(limit):
    assert slurm_config(time_limit=limit).slurm.time_limit == limit


@pytest.mark.parametrize(
    ("limit", "says"),
    [
        (5400, "quoted string"),  # what YAML makes of an unquoted 1:30:00
        ("0", "not a Slurm time limit"),
        ("00:00:00", "not a Slurm time limit"),
        ("90m", "not a Slurm time limit"),
        ("1-xx", "not a Slurm time limit"),
        ("1:2:3:4", "not a Slurm time limit"),
    ],
)
def test_bad_time_limits_are_rejected_naming_the_field(limit, says):
    with pytest.raises(ConfigError) as error:
        slurm_config(time_limit=limit)
    assert "slurm.time_limit" in str(error.value) and says in str(error.value)


@pytest.mark.parametrize(
    ("arg", "owner"),
    [
        ("--nodes=3", "train.nnodes"),
        ("-N3", "train.nnodes"),
        ("--output=/tmp/x", "RUN_DIR/slurm/"),
        ("-o", "RUN_DIR/slurm/"),
        ("--outp=/tmp/x", "RUN_DIR/slurm/"),  # sbatch would take the abbreviation
        ("--ntasks-per-node=4", "one torchrun agent per node"),
        ("--partition=gpu", "slurm.partition"),
        ("-t10", "slurm.time_limit"),
        ("--wait", "follows the job itself"),
        ("--array=1-3", "one job per run"),
    ],
)
def test_sbatch_args_may_not_override_what_ddpflow_sets(arg, owner):
    with pytest.raises(ConfigError) as error:
        slurm_config(sbatch_args=["--mem=1G", arg])
    message = str(error.value)
    assert "slurm.sbatch_args" in message and "item 1" in message and owner in message, message


def test_sbatch_args_take_each_option_with_its_value_in_one_item():
    assert slurm_config(sbatch_args=["--mem=8G", "--gpus=2", "--exclusive"]).slurm.sbatch_args[1] == "--gpus=2"
    with pytest.raises(ConfigError, match=r"slurm.sbatch_args: item 1 \('8G'\) is not an option"):
        slurm_config(sbatch_args=["--mem", "8G"])


@pytest.mark.parametrize(
    ("slurm", "field"),
    [
        ({"partitoin": "debug"}, "slurm.partitoin"),
        ({"gpus_per_node": -1}, "slurm.gpus_per_node"),
        ({"cpus_per_task": 0}, "slurm.cpus_per_task"),
        ({"poll_interval_s": 0}, "slurm.poll_interval_s"),
        ({"partition": ""}, "slurm.partition"),
        ({"sbatch_args": "--mem=1G"}, "slurm.sbatch_args"),
    ],
)
def test_unknown_keys_and_bad_values_name_the_field(slurm, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        slurm_config(**slurm)


def test_unknown_launcher_is_rejected():
    with pytest.raises(ConfigError, match="train.launcher"):
        validate_config({"train": {"launcher": "kubernetes"}})


def test_yaml_and_overrides_reach_the_slurm_section(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "train: {launcher: slurm, nnodes: 2, nproc_per_node: 1}\n"
        "slurm: {partition: debug, time_limit: '00:10:00', sbatch_args: ['--mem=1G']}\n"
    )
    config = load_config(path, ["slurm.poll_interval_s=0.5", "slurm.account=ml"])
    assert config.slurm.partition == "debug" and config.slurm.time_limit == "00:10:00"
    assert config.slurm.poll_interval_s == 0.5 and config.slurm.account == "ml"
    assert config.flat()["slurm.sbatch_args"] == '["--mem=1G"]', "the section reaches the MLflow params"


def test_the_preflight_counts_the_job_nodes_gpus_not_this_machines():
    """A login node without GPUs submits NCCL jobs: slurm.gpus_per_node is what each node has."""
    from training.preflight import check_machine

    layout = check_machine(slurm_config(gpus_per_node=4))
    assert (layout.nproc_per_node, layout.nnodes, layout.world_size, layout.backend) == (4, 2, 8, "nccl")
    assert check_machine(slurm_config()).backend == "gloo", "no GPUs asked for: CPU ranks"
    with pytest.raises(ConfigError, match="train.nproc_per_node: 8 ranks asked for, but slurm.gpus_per_node is 4"):
        check_machine(
            validate_config({"train": {"launcher": "slurm", "nproc_per_node": 8}, "slurm": {"gpus_per_node": 4}})
        )
    with pytest.raises(ConfigError, match="train.backend: 'nccl' needs GPUs on the job's nodes"):
        check_machine(validate_config({"train": {"launcher": "slurm", "backend": "nccl"}}))


def test_scoring_runs_where_training_runs_and_more_than_one_scoring_node_needs_slurm():
    assert load_config(None, ["train.launcher=slurm"]).score_launcher == "slurm", "score.launcher's default"
    assert load_config(None, ["train.launcher=slurm", "score.launcher=local"]).score_launcher == "local"
    assert load_config(None, ["score.launcher=slurm", "score.nnodes=2"]).score.nnodes == 2
    with pytest.raises(ConfigError, match=r"score\.nnodes is 2: more than one node needs score\.launcher 'slurm' "
                                          r"\(it is 'local', from train\.launcher\)"):  # fmt: skip
        load_config(None, ["score.nnodes=2"])
