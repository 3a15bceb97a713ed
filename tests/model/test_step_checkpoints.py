"""Step checkpoints and exact mid-epoch resume under REAL torchrun (gloo, CPU ranks, tiny data).

The split: 242 train rows, a global batch of 12: 2 ranks x 6, 1 x 12 and 3 x 4 (3 ranks pad the permutation
by one row) all take 21 steps an epoch, and global step k holds the same rows at every world size
(training/loading.py: ``global_positions_of_steps``). ``checkpoint_every_steps: 4`` over 21 steps an epoch
writes epoch 1's step checkpoints once 3, 7, 11, 15 and 19 of its steps are trained (optimizer steps 24, 28, ...
of the run), named by that count: a resume from ``s00000011`` starts at step 11 (0-based).

Launches: two uninterrupted references (with dropout, and without), a run killed mid-epoch that torchrun
restarts, a run stopped mid-epoch that two launches resume on 1 and on 3 ranks.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.model.test_train_ddp import DROPOUT_MODEL, Launch, assert_same_weights, launch, report, succeeded
from tests.model.test_train_ddp import write_dataset as write_test_dataset
from training.checkpoint import Checkpointer, ResumeMismatchError
from training.distributed import SingleProcess
from training.layout import LAST_CHECKPOINT

pytestmark = pytest.mark.torchrun

TRAIN_ROWS, GLOBAL_BATCH, STEPS_PER_EPOCH = 242, 12, 21
SAME_WORLD, OTHER_WORLD = 1e-6, 1e-5
RECORD = {"DDPFLOW_RECORD_INDICES": "1"}
# batch_size null: the per-rank batch is global_batch_size / world size.
SETTINGS = {"batch_size": None, "global_batch_size": GLOBAL_BATCH, "epochs": 2}
STEPS = {"checkpoint_every_steps": 4}
RESUMED = re.compile(r"resumed from \S+ after (\d+) epoch\(s\), at step (\d+) of epoch (\d+)")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rows = {"train": TRAIN_ROWS, "val": 31, "test": 8}
    return write_test_dataset(tmp_path_factory.mktemp("steps"), rows, seed=3, name="fp-steps")


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> Launch:
    """2 ranks, uninterrupted, no step checkpoints."""
    return succeeded(launch(tmp_path_factory.mktemp("reference"), dataset, env=RECORD, **SETTINGS))


@pytest.fixture(scope="module")
def dropout_reference(dataset, tmp_path_factory) -> Launch:
    return succeeded(launch(tmp_path_factory.mktemp("dropout"), dataset, env=RECORD, **SETTINGS, **DROPOUT_MODEL))


@pytest.fixture(scope="module")
def killed(dataset, tmp_path_factory) -> Launch:
    """Dropout (each rank's RNG stream matters), rank 1 SIGKILLed at step 18 of epoch 1; torchrun restarts."""
    env = {**RECORD, "DDPFLOW_FAULT": "kill:rank=1:epoch=1:step=18"}
    run_dir = tmp_path_factory.mktemp("killed")
    return succeeded(launch(run_dir, dataset, max_restarts=1, env=env, **SETTINGS, **DROPOUT_MODEL, **STEPS))


@pytest.fixture(scope="module")
def stopped(dataset, tmp_path_factory) -> Launch:
    """2 ranks, failing for good before step 14 of epoch 1 (no restarts): the newest checkpoint holds 11 steps."""
    env = {**RECORD, "DDPFLOW_FAULT": "raise:rank=0:epoch=1:step=14"}
    result = launch(tmp_path_factory.mktemp("stopped"), dataset, env=env, **SETTINGS, **STEPS)
    assert result.returncode != 0 and "injected fault" in result.output, result.output[-3000:]
    return result


def resumed_on(stopped: Launch, dataset: Path, tmp_path: Path, nproc: int) -> Launch:
    run_dir = tmp_path / f"on{nproc}"
    shutil.copytree(stopped.run_dir, run_dir)
    return succeeded(launch(run_dir, dataset, nproc=nproc, env=RECORD, **SETTINGS, **STEPS))


def resumed_step(result: Launch) -> int:
    found = RESUMED.search(result.output)
    assert found, result.output[-3000:]
    epochs_done, step, epoch = map(int, found.groups())
    assert epochs_done == epoch == 1
    return step


def test_a_killed_rank_resumes_at_its_step_checkpoint_to_the_uninterrupted_weights(killed, dropout_reference):
    step = resumed_step(killed)
    assert step in (11, 15), "the newest complete step checkpoint before step 18: 15 steps (or 11, if mid-write)"
    per_rank = GLOBAL_BATCH // 2
    for rank in range(2):
        # Epoch 1 completed once: the resumed pass, which began at the checkpointed step (not at step 0).
        (resumed,) = killed.passes(rank, 1)
        assert resumed == dropout_reference.indices(rank, 1)[step * per_rank :]
        assert killed.indices(rank, 0) == dropout_reference.indices(rank, 0)
    difference = assert_same_weights(killed.model()["model"], dropout_reference.model()["model"], SAME_WORLD)
    report(f"killed at step 18, resumed at step {step} (dropout, 2 ranks)", difference)
    # The epoch's metrics count the steps before the checkpoint too (carried in it, not trained again).
    assert [m["train_samples"] for m in killed.metrics()] == [TRAIN_ROWS, TRAIN_ROWS]
    for got, want in zip(killed.metrics(), dropout_reference.metrics()):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9)


def test_step_checkpoints_keep_the_newest_and_leave_no_torn_file(stopped):
    checkpoints = stopped.run_dir / "checkpoints"
    # Epoch 0's went with epoch 0's last.pt; of epoch 1's (3, 7 and 11 steps) the newest 2 stay.
    names = sorted(path.name for path in checkpoints.iterdir())
    assert names == ["last.pt", "step-e00001-s00000007.pt", "step-e00001-s00000011.pt"]


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_run_stopped_on_2_ranks_resumes_on_another_world_size(stopped, reference, dataset, tmp_path, nproc):
    result = resumed_on(stopped, dataset, tmp_path, nproc)
    step = resumed_step(result)
    assert step == 11
    # Global step k holds the same rows at any world size: the ranks' rows of the resumed pass are the
    # reference's global batches from step 11 on.
    resumed = sorted(row for rank in range(nproc) for row in result.indices(rank, 1))
    reference_rows = sorted(row for rank in range(2) for row in reference.indices(rank, 1)[step * 6 :])
    assert resumed == reference_rows
    difference = assert_same_weights(result.model()["model"], reference.model()["model"], OTHER_WORLD)
    report(f"stopped on 2 ranks at step {step}, resumed on {nproc}", difference)
    assert f"world size 2 -> {nproc}" in result.output


def test_a_resume_with_another_global_batch_size_is_refused(stopped, dataset):
    from tests.model.test_train_ddp import job_config

    changed = job_config(2, 0, **{**SETTINGS, "global_batch_size": 2 * GLOBAL_BATCH})
    with pytest.raises(ResumeMismatchError, match=r"train\.global_batch_size 12 != 24"):
        Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(changed, "fp-steps")
    same = job_config(1, 0, **SETTINGS)  # one rank: the world is not part of the identity with a global batch
    saved = Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(same, "fp-steps")
    assert (saved["epoch"], saved["step"]) == (1, 11)
    assert (stopped.run_dir / LAST_CHECKPOINT).exists()
    assert torch.is_tensor(next(iter(saved["model"].values())))


def test_the_reference_logs_each_epoch_coverage_certificate(reference):
    from training.coverage import Certificate

    expected = Certificate.expected(TRAIN_ROWS).metrics()
    for line in reference.metrics():
        assert {key: line[key] for key in expected} == expected
