"""Step checkpoints and exact mid-epoch resume under REAL torchrun (gloo, CPU ranks, tiny data).

The split: 242 train rows, a global batch of 12: 2 ranks x 6, 1 x 12 and 3 x 4 (3 ranks pad the permutation
by one row) all take 21 steps an epoch, and global step k holds the same rows at every world size
(training/loading/batches.py: ``global_positions_of_steps``). ``checkpoint_every_steps: 4`` over 21 steps an epoch
writes epoch 1's step checkpoints once 3, 7, 11, 15 and 19 of its steps are trained (optimizer steps 24, 28, ...
of the run), named by that count: a resume from ``s00000011`` starts at step 11 (0-based).

The image case: 60 PNGs prepared into 49 train rows, the built-in CNN (``train.model: auto``) with its
random crop and flip, 1 decode worker per rank, 2 ranks x 4 rows (no ``global_batch_size``): 7 steps an
epoch, the last with one padded row. ``checkpoint_every_steps: 2`` writes epoch 1's after 1, 3 and 5 of its
steps (run steps 8, 10, 12).

Launches: ONE of three uninterrupted 2-rank references (numeric with dropout, without, and the image case:
tests/multi_case.py), a run killed mid-epoch that torchrun restarts (numeric with dropout, and the image
case), a run stopped mid-epoch that two launches resume on 1 and on 3 ranks, and one that is refused: the
image run resumed on 1 rank by ``nproc_per_node: auto`` without ``global_batch_size``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.image_data import image_table
from tests.multi_case import launch_cases
from tests.training.test_train_ddp import (
    DROPOUT_MODEL,
    Launch,
    assert_same_weights,
    job_config,
    launch,
    production_env,
    report,
    succeeded,
)
from tests.training.test_train_ddp import write_dataset as write_test_dataset
from training.checkpoint.files import Checkpointer, ResumeMismatchError
from training.core.config import load_config
from training.core.layout import FINAL_MODEL, LAST_CHECKPOINT, PREEMPTED
from training.core.manifest import read_manifest
from training.distributed.context import SingleProcess
from training.prepare.dataset import prepare_dataset

pytestmark = pytest.mark.torchrun

TRAIN_ROWS, GLOBAL_BATCH, STEPS_PER_EPOCH = 242, 12, 21
SAME_WORLD, OTHER_WORLD = 1e-6, 1e-5
RECORD = {"DDPFLOW_RECORD_INDICES": "1"}
# batch_size null: the per-rank batch is global_batch_size / world size.
SETTINGS = {"batch_size": None, "global_batch_size": GLOBAL_BATCH, "epochs": 2}
STEPS = {"checkpoint_every_steps": 4}
RESUMED = re.compile(r"resumed from \S+ after (\d+) epoch\(s\), at step (\d+) of epoch (\d+)")
IMAGE_ROWS, IMAGE_TRAIN_ROWS, IMAGE_BATCH = 60, 49, 4  # IMAGE_BATCH per rank, 2 ranks
IMAGE_SETTINGS = {
    "model": "auto", "model_kwargs": {"width": 4, "blocks": [1, 1], "groups": 2},
    "batch_size": IMAGE_BATCH, "epochs": 2, "num_workers": 1,
}  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rows = {"train": TRAIN_ROWS, "val": 31, "test": 8}
    return write_test_dataset(tmp_path_factory.mktemp("steps"), rows, seed=3, name="fp-steps")


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory) -> Path:
    """PNG bytes and a categorical, through prepare_dataset (its hash split keeps IMAGE_TRAIN_ROWS for train)."""
    root = tmp_path_factory.mktemp("image-steps")
    pq.write_table(image_table(IMAGE_ROWS), root / "photos.parquet")
    data = load_config(
        None,
        [
            f"data.source={root / 'photos.parquet'}", f"data.root={root / 'shards'}", "data.label=shape",
            "data.key=id", 'data.inputs={"photo": {"kind": "image", "size": 12}, "colour": "categorical"}',
        ],
    ).data  # fmt: skip
    dataset_dir = prepare_dataset(data).dataset_dir
    assert read_manifest(dataset_dir).rows("train") == IMAGE_TRAIN_ROWS
    return dataset_dir


@pytest.fixture(scope="module")
def references(dataset, image_dataset, tmp_path_factory) -> dict[str, Launch]:
    """2 ranks, uninterrupted, no step checkpoints: numeric (without and with dropout) and the image case,
    three cases of one launch."""
    cases = {
        "reference": (job_config(2, 0, **SETTINGS), dataset),
        "dropout": (job_config(2, 0, **SETTINGS, **DROPOUT_MODEL), dataset),
        # Validation in batches of 2 rows (of 2 and 3 per rank), the killed run's in its train batch of 4.
        "image": (job_config(2, 0, **IMAGE_SETTINGS, val_batch_size=2), image_dataset),
    }
    root = tmp_path_factory.mktemp("references")
    results = launch_cases(root, cases, production_env(cases["reference"][0], root, **RECORD))
    return {name: Launch(result.run_dir, result.returncode, result.output) for name, result in results.items()}


@pytest.fixture(scope="module")
def reference(references) -> Launch:
    return succeeded(references["reference"])


@pytest.fixture(scope="module")
def dropout_reference(references) -> Launch:
    return succeeded(references["dropout"])


@pytest.fixture(scope="module")
def image_reference(references) -> Launch:
    return succeeded(references["image"])


@pytest.fixture(scope="module")
def killed(dataset, tmp_path_factory) -> Launch:
    """Dropout (each rank's RNG stream matters), rank 1 SIGKILLed at step 18 of epoch 1; torchrun restarts."""
    env = {**RECORD, "DDPFLOW_FAULT": "kill:rank=1:epoch=1:step=18"}
    run_dir = tmp_path_factory.mktemp("killed")
    return succeeded(launch(run_dir, dataset, max_restarts=1, env=env, **SETTINGS, **DROPOUT_MODEL, **STEPS))


@pytest.fixture(scope="module")
def image_killed(image_dataset, tmp_path_factory) -> Launch:
    """The image case, rank 1 SIGKILLed before step 6 of epoch 1 (after the checkpoint of 5 steps); torchrun
    restarts both ranks and their decode workers."""
    env = {**RECORD, "DDPFLOW_FAULT": "kill:rank=1:epoch=1:step=6"}
    run_dir = tmp_path_factory.mktemp("image-killed")
    return succeeded(
        launch(run_dir, image_dataset, max_restarts=1, env=env, **IMAGE_SETTINGS, checkpoint_every_steps=2)
    )


@pytest.fixture(scope="module")
def stopped(dataset, tmp_path_factory) -> Launch:
    """2 ranks, failing for good before step 14 of epoch 1 (no restarts): the newest checkpoint holds 11 steps."""
    env = {**RECORD, "DDPFLOW_FAULT": "raise:rank=0:epoch=1:step=14"}
    result = launch(tmp_path_factory.mktemp("stopped"), dataset, env=env, **SETTINGS, **STEPS)
    assert result.returncode != 0 and "injected fault" in result.output, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def preempted(dataset, tmp_path_factory) -> Launch:
    """Dropout, NO step checkpoints configured, a restart allowed: rank 1 sends itself SIGUSR1
    (train.preempt_signal) before step 9 of epoch 1 (training/loop/hooks.py: preempt)."""
    env = {**RECORD, "DDPFLOW_FAULT": "preempt:rank=1:epoch=1:step=9"}
    return launch(tmp_path_factory.mktemp("preempted"), dataset, max_restarts=1, env=env, **SETTINGS, **DROPOUT_MODEL)


def resumed_on(stopped: Launch, dataset: Path, tmp_path: Path, nproc: int) -> Launch:
    run_dir = tmp_path / f"on{nproc}"
    shutil.copytree(stopped.run_dir, run_dir)
    return succeeded(launch(run_dir, dataset, nproc=nproc, env=RECORD, **SETTINGS, **STEPS))


def assert_same_final_weights(result: Launch, reference: Launch, atol: float) -> float:
    """The weights after the last epoch (last.pt), and model.pt's: model.pt holds the best epoch's by
    val_loss, which may be one before the resumed pass, so it alone could not tell a resume's error."""
    last, want = (torch.load(run.run_dir / LAST_CHECKPOINT, weights_only=True) for run in (result, reference))
    assert last["epoch"] == want["epoch"] == SETTINGS["epochs"]
    assert_same_weights(result.model()["model"], reference.model()["model"], atol)
    return assert_same_weights(last["model"], want["model"], atol)


def resumed_step(result: Launch) -> int:
    found = RESUMED.search(result.output)
    assert found, result.output[-3000:]
    epochs_done, step, epoch = map(int, found.groups())
    assert epochs_done == epoch == 1
    return step


def assert_resumed_at(step: int, per_rank: int, killed, reference) -> None:
    """On both ranks epoch 1 completed once: the resumed pass, which began at the checkpointed ``step`` (not at
    step 0) and trained the reference's rows from there; epoch 0 trained the reference's rows."""
    for rank in range(2):
        (resumed,) = killed.passes(rank, 1)
        assert resumed == reference.indices(rank, 1)[step * per_rank :]
        assert killed.indices(rank, 0) == reference.indices(rank, 0)


def test_a_killed_rank_resumes_at_its_step_checkpoint_to_the_uninterrupted_weights(killed, dropout_reference):
    step = resumed_step(killed)
    assert step in (11, 15), "the newest complete step checkpoint before step 18: 15 steps (or 11, if mid-write)"
    assert_resumed_at(step, GLOBAL_BATCH // 2, killed, dropout_reference)
    difference = assert_same_final_weights(killed, dropout_reference, SAME_WORLD)
    report(f"killed at step 18, resumed at step {step} (dropout, 2 ranks)", difference)
    # The epoch's metrics count the steps before the checkpoint too (carried in it, not trained again).
    assert [m["train_samples"] for m in killed.metrics()] == [TRAIN_ROWS, TRAIN_ROWS]
    for got, want in zip(killed.metrics(), dropout_reference.metrics()):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9)


def test_an_image_model_with_augmentation_and_decode_workers_resumes_mid_epoch_to_the_uninterrupted_weights(
    image_killed, image_reference
):
    """Each view is drawn from (seed, epoch, row) in the workers, so the resumed pass, whose workers start at
    the checkpointed step, trains the views the uninterrupted pass trained from that step on."""
    assert (image_killed.run_dir / ".fault-kill-done").exists()
    step = resumed_step(image_killed)
    assert step in (3, 5), "the newest complete step checkpoint before step 6: 5 steps (or 3, if mid-write)"
    assert_resumed_at(step, IMAGE_BATCH, image_killed, image_reference)
    difference = assert_same_final_weights(image_killed, image_reference, SAME_WORLD)
    report(f"image CNN, crop + flip, 1 worker per rank: killed at step 6, resumed at step {step}", difference)
    assert image_killed.model()["model_spec"] == image_reference.model()["model_spec"]
    assert image_killed.model()["model_spec"]["model"] == "image_cnn"  # what auto picks for an image input
    assert "1 decode worker(s) per rank" in image_killed.output and "1 decode worker(s)" in image_reference.output
    # train.val_batch_size moves the val metrics by float rounding only (a row's view and logits are its own).
    assert "validation in batches of 4 rows" in image_killed.output
    assert "validation in batches of 2 rows" in image_reference.output
    assert [m["train_samples"] for m in image_killed.metrics()] == [IMAGE_TRAIN_ROWS] * 2
    for got, want in zip(image_killed.metrics(), image_reference.metrics(), strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-9)
        val = {key: value for key, value in want.items() if key.startswith("val_")}
        assert len(val) >= 3 and {key: got[key] for key in val} == pytest.approx(val, rel=1e-6)


def test_a_signal_to_one_rank_saves_every_rank_at_that_step_and_the_resume_ends_on_the_uninterrupted_weights(
    preempted, dataset, dropout_reference
):
    """Every rank learns of rank 1's signal at the same step (the all-reduced flag), a step checkpoint is written
    there although none is configured, the ranks exit 0 ("preempted, resumable": RUN_DIR/preempted.json) and
    torchrun restarts nothing; the same launch then resumes at that step to the uninterrupted weights."""
    assert preempted.returncode == 0, preempted.output[-3000:]
    record = json.loads((preempted.run_dir / PREEMPTED).read_text())
    assert (record["epoch"], record["step"]) == (1, 10), record  # told before step 9: saved once it is trained
    assert record["checkpoint"] == str(preempted.run_dir / "checkpoints" / "step-e00001-s00000010.pt")
    assert record["signal"] == "a signal to another rank"  # rank 0 writes it; rank 1 was the one signalled
    assert sorted(path.name for path in (preempted.run_dir / "checkpoints").iterdir()) == [
        "last.pt",
        "step-e00001-s00000010.pt",
    ]
    assert not (preempted.run_dir / FINAL_MODEL).exists()
    assert len(preempted.metrics()) == 1  # epoch 0 only: the ranks stopped in epoch 1
    (attempts,) = [list(job.glob("attempt_*")) for job in (preempted.run_dir / "logs").iterdir()]
    assert len(attempts) == 1, "torchrun restarted the preempted group"

    resumed = succeeded(launch(preempted.run_dir, dataset, env=RECORD, **SETTINGS, **DROPOUT_MODEL))
    assert resumed_step(resumed) == 10
    assert_resumed_at(10, GLOBAL_BATCH // 2, resumed, dropout_reference)
    difference = assert_same_final_weights(resumed, dropout_reference, SAME_WORLD)
    report("preempted (SIGUSR1 to rank 1) at step 10, resumed at step 10 (dropout, 2 ranks)", difference)


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
    difference = assert_same_final_weights(result, reference, OTHER_WORLD)
    report(f"stopped on 2 ranks at step {step}, resumed on {nproc}", difference)
    assert f"world size 2 -> {nproc}" in result.output


def test_a_resume_with_another_global_batch_size_is_refused(stopped, dataset):
    changed = job_config(2, 0, **{**SETTINGS, "global_batch_size": 2 * GLOBAL_BATCH})
    with pytest.raises(ResumeMismatchError, match=r"train\.global_batch_size 12 != 24"):
        Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(changed, "fp-steps")
    same = job_config(1, 0, **SETTINGS)  # one rank: the world is not part of the identity with a global batch
    saved = Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(same, "fp-steps")
    assert (saved["epoch"], saved["step"]) == (1, 11)
    assert (stopped.run_dir / LAST_CHECKPOINT).exists()
    assert torch.is_tensor(next(iter(saved["model"].values())))


def test_a_resume_on_another_world_size_without_global_batch_size_is_refused_naming_both(
    image_reference, image_dataset, tmp_path
):
    """2 ranks x 4 rows is a global batch of 8; 1 rank x 4 would train other weights. A changed nproc_per_node
    is an identity difference; ``auto`` hides the change from the identity, so the rank refuses it."""
    fingerprint = read_manifest(image_dataset).fingerprint
    advice = (
        r"resume it on its 2 rank\(s\): only a run started with train\.global_batch_size \(this one's: 8\) "
        "resumes on another world size"
    )
    with pytest.raises(ResumeMismatchError, match=r"\(train\.nproc_per_node 2 != 1\); .*; " + advice):
        Checkpointer(image_reference.run_dir, SingleProcess()).load_resumable(
            job_config(1, 0, **IMAGE_SETTINGS), fingerprint
        )
    # nproc_per_node: auto, checkpointed as on a 2-GPU node (2 ranks), resumed where auto is 1 rank (no GPU).
    run_dir = tmp_path / "auto"
    shutil.copytree(image_reference.run_dir, run_dir)
    state = torch.load(run_dir / LAST_CHECKPOINT, weights_only=True)
    assert state["world_size"] == 2 and state["config"]["train"]["nproc_per_node"] == 2
    state["config"]["train"]["nproc_per_node"] = "auto"
    torch.save(state, run_dir / LAST_CHECKPOINT)
    before = (run_dir / LAST_CHECKPOINT).read_bytes()
    result = launch(run_dir, image_dataset, nproc="auto", env=RECORD, **IMAGE_SETTINGS)
    assert result.returncode != 0
    refusal = (
        r"ResumeMismatchError: \S+last\.pt: checkpointed after 2 epoch\(s\) with a global batch of 8 rows on 2 "
        r"rank\(s\); this run has 1 rank\(s\) x 4 = 4, and without train\.global_batch_size the world size "
        r"changes the weights; " + advice
    )
    assert re.search(refusal, result.output), result.output[-3000:]
    assert "epoch 3" not in result.output and (run_dir / LAST_CHECKPOINT).read_bytes() == before


def test_the_reference_logs_each_epoch_coverage_certificate(reference):
    from training.loop.counting import Certificate

    expected = Certificate.expected(TRAIN_ROWS).metrics()
    for line in reference.metrics():
        assert {key: line[key] for key in expected} == expected
