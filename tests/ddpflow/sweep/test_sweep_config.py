"""A sweep's section is refused before anything starts, each bad input with its own clear error;
the stop request every rank obeys; the study's resume rule. No ranks, no servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from ddpflow.sweep.space import check_sweep_machine, load_sweep, sweep_from_raw
from ddpflow.sweep.study import (
    INTERRUPTED,
    RERUN_OF,
    decode,
    distributions,
    finished_trials,
    open_study,
    requeue_interrupted,
)
from training.core.config import ConfigError, load_config
from training.core.topology import RankLayout
from training.loop.selection import read_verdict, stop_requested, verdicts_dir, write_verdict

REPO = Path(__file__).resolve().parents[3]


def _raw(space=None, **sweep) -> dict:
    return {
        "data": {"source": "synthetic://classification?rows=400&features=4&classes=2"},
        "train": {"lr": 0.01, "nproc_per_node": 1},
        "sweep": {"trials": 4, "space": {"train.lr": {"low": 1e-4, "high": 1e-1, "log": True}} if space is None
                  else space, **sweep},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("space", "sweep", "message"),
    [
        ({}, {}, "sweep.space: the space is empty"),
        ({"train.no_such": {"low": 1, "high": 2}}, {}, "sweep.space.train.no_such: train has no field 'no_such'"),
        ({"data.val_fraction": {"low": 0.1, "high": 0.2}}, {}, "sweep.space.data.val_fraction: a data.* key"),
        ({"eval.batch_size": {"choices": [1, 2]}}, {}, "sweep.space.eval.batch_size: a sweep tunes train.* keys"),
        ({"train.lr": {"low": 0.1, "high": 0.01}}, {}, "low (0.1) is above high (0.01)"),
        ({"train.lr": {"low": 0.0, "high": 0.1, "log": True}}, {}, "log: true needs low above 0"),
        ({"train.lr": {"low": 0.0, "high": 0.1}}, {}, "sweep.space.train.lr: 0.0 is refused"),
        ({"train.timeout_s": {"low": 1, "high": 2}}, {}, "does not change the trained weights"),
        ({"train.nproc_per_node": {"choices": [1, 2]}}, {}, "not tunable"),
        ({"train.lr": {"choices": []}}, {}, "choices is empty"),
        ({"train.lr": {"low": 1e-3, "high": 1e-2}}, {"sampler": "grid"}, "sampler grid needs choices"),
        ({"train.lr": {"choices": [0.1, 0.01]}}, {"sampler": "grid"}, "sweep.trials: 4 trials, but the grid has 2"),
        (None, {"objective": "test_accuracy"}, "sweep.objective: 'test_accuracy' is not a validation metric"),
        (None, {"sampler": "bayes"}, "sweep.sampler"),
        (None, {"enqueue": [{"train.epochs": 3}]}, "sweep.enqueue[0]: ['train.epochs'] are not keys of sweep.space"),
    ],
)
def test_each_bad_sweep_is_refused_naming_the_field(space, sweep, message):
    with pytest.raises(ConfigError) as caught:
        sweep_from_raw(_raw(space, **sweep))
    assert message in str(caught.value)


def test_more_ranks_at_once_than_the_machine_has_is_refused():
    sweep = sweep_from_raw(_raw(parallel=3))
    with pytest.raises(
        ConfigError, match=r"sweep.parallel: 3 trials at once x 2 rank\(s\) each = 6 ranks, but this machine has 4 GPUs"
    ):
        check_sweep_machine(sweep, RankLayout(nproc_per_node=2, nnodes=1, backend="nccl", gpus=4))
    check_sweep_machine(sweep_from_raw(_raw(parallel=2)), RankLayout(2, 1, "nccl", 4))  # 4 ranks fit 4 GPUs


def test_a_good_sweep_gives_each_trial_the_base_config_with_its_values():
    sweep = sweep_from_raw(
        _raw({"train.epochs": {"low": 1, "high": 3}, "train.model_kwargs.hidden": {"choices": [[8], [16, 16]]}})
    )
    assert sweep.objective == "val_loss" and not sweep.maximize  # the gate's rule: lower is better
    config = sweep.trial_config({"train.epochs": 2, "train.model_kwargs.hidden": [16, 16]})
    assert config.train.epochs == 2 and config.train.model_kwargs == {"hidden": [16, 16]}
    assert config.train.lr == 0.01 and config.data == sweep.base.data
    assert sweep_from_raw(_raw(objective="val_accuracy")).maximize


def test_a_run_accepts_the_same_file_and_records_no_sweep(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_raw()))
    config = load_config(path)
    assert "sweep" not in config.model_dump() and "sweep.trials" not in config.flat()
    assert load_sweep(path, ["sweep.trials=9"]).sweep.trials == 9


def test_the_cli_refuses_a_bad_sweep_before_anything_starts(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_raw({"data.label": {"choices": ["a"]}})))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "sweep", "--config", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: sweep.space.data.label: a data.* key")
    assert "Traceback" not in done.stderr


def test_a_resumed_study_runs_an_interrupted_trial_again_and_counts_it_once(tmp_path):
    sweep = sweep_from_raw(_raw({"train.model_kwargs.hidden": {"choices": [[8], [16, 16]]}}, sampler="random"))
    study = open_study(sweep, tmp_path)
    done = study.ask(distributions(sweep))
    study.tell(done, 0.5)
    running = study.ask(distributions(sweep))  # the process that ran it died
    study = open_study(sweep, tmp_path)  # the same command again
    assert requeue_interrupted(study) == [running.number]
    failed = study.get_trials()[running.number]
    assert failed.state == optuna.trial.TrialState.FAIL and failed.user_attrs[INTERRUPTED]
    assert [t.number for t in finished_trials(study)] == [done.number]
    again = study.ask(distributions(sweep))
    assert again.params == running.params and again.user_attrs[RERUN_OF] == running.number
    assert decode(sweep, again.params)["train.model_kwargs.hidden"] in ([8], [16, 16])


class _Rank:
    def __init__(self, rank: int):
        self.rank, self.is_main, self.reduced = rank, rank == 0, []

    def all_reduce_int_sum(self, values):
        self.reduced.append(list(values))
        return [values[0] + (1 if not self.is_main and self.peer_stops else 0)]


def test_every_rank_gets_the_same_stop_and_none_waits_without_a_sweep(tmp_path):
    rank0, rank1 = _Rank(0), _Rank(1)
    rank1.peer_stops = True  # what rank 0 contributes to rank 1's all-reduce
    assert not stop_requested(tmp_path, 0, rank0) and rank0.reduced == []  # no verdicts dir: no collective
    verdicts_dir(tmp_path).mkdir()
    write_verdict(tmp_path, 0, stop=True)
    write_verdict(tmp_path, 1, stop=False)
    assert stop_requested(tmp_path, 0, rank0) and stop_requested(tmp_path, 0, rank1)
    assert read_verdict(tmp_path, 1, 0.0) is False and read_verdict(tmp_path, 2, 0.05) is None
