"""Images on the ranks, under REAL torchrun launches (gloo, CPU): a Parquet column of PNG bytes plus a
categorical, prepared by prepare_dataset, trained by the built-in GroupNorm CNN with augmentation on.

TWO launches carry every check: 1 rank x 2b with no decode workers, and 2 ranks x b with 2 decode workers
each, killed at the start of epoch 1 and resumed by torchrun. They must end on the same weights (the exact
update, within 1e-5), and every (epoch, row) must have had the same augmented view in both (recorded by
``tests/image_view_model.py``): the view is a function of (seed, epoch, row) alone, not of the world
size, the worker count or a restart. Evaluation of the result then keeps the misclassified test images.
Plus the num_workers and worker-core rules, without a launch.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from image_data import image_table

from training.core.config import PipelineConfig, load_config
from training.core.job import TrainJob
from training.distributed.process import CpuSetup, decode_workers, make_room_for_workers
from training.prepare.dataset import prepare_dataset

REPO = Path(__file__).resolve().parents[2]
BATCH, EPOCHS = 8, 3  # per rank with 2 ranks; the single rank takes 2 * BATCH
EXACT = 1e-5
MODEL = {
    "model": "tests.image_view_model:recording_cnn",
    "model_kwargs": {"width": 4, "blocks": [1, 1], "groups": 2},
}


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str

    def model(self) -> dict:
        return torch.load(self.run_dir / "model.pt", weights_only=True)

    def indices(self, rank: int, epoch: int) -> list[int]:
        lines = (self.run_dir / "indices" / f"rank{rank}-epoch{epoch}.jsonl").read_text().splitlines()
        assert len(lines) == 1, f"rank {rank} completed epoch {epoch} {len(lines)} times"
        return json.loads(lines[0])

    def views(self, ranks: int, first_epoch_of_restart: dict[int, int], rows: int) -> dict[tuple[int, int], float]:
        """(epoch, row) -> the fingerprint of the view that row was trained on. Each rank's forwards of an epoch
        are ceil(rows / ranks): the sampler's padding (a repeated row, last) is in them but not in its indices."""
        forwards = -(-rows // ranks)
        views = {}
        for rank in range(ranks):
            for restart, first in first_epoch_of_restart.items():
                lines = (self.run_dir / "views" / f"rank{rank}-restart{restart}.jsonl").read_text().splitlines()
                sums = [value for line in lines for value in json.loads(line)]
                for epoch in range(first, EPOCHS):
                    trained = self.indices(rank, epoch)
                    if len(sums) < forwards:
                        break  # a pass cut short by the kill: its rows were trained again after the restart
                    views |= {(epoch, row): value for row, value in zip(trained, sums, strict=False)}
                    sums = sums[forwards:]
        return views


def launch(run_dir: Path, dataset_dir: Path, nproc: int, batch_size: int, env: dict, **train) -> Launch:
    from ddpflow.launch.command import launch_env, torchrun_command

    settings = {
        "epochs": EPOCHS, "batch_size": batch_size, "num_threads": 1, "lr": 0.01, "nproc_per_node": nproc,
        "progress_interval_s": 0.2, "collective_timeout_s": 60, **MODEL, **train,
    }  # fmt: skip
    config: PipelineConfig = load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in settings.items()])
    (run_dir / "views").mkdir(parents=True)
    job = TrainJob(config=config, dataset_dir=str(dataset_dir), run_dir=str(run_dir), init_weights=None)
    job_path = job.write(run_dir / "train_config.json")
    base = {k: v for k, v in os.environ.items() if not k.startswith("DDPFLOW_")}
    hooks = {"DDPFLOW_RECORD_INDICES": "1", "IMAGE_VIEWS_DIR": str(run_dir / "views"), **env}
    env = {**launch_env(config, run_dir, gpus=0, base=base), **hooks}
    command = torchrun_command(config, job_path, gpus=0)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    result = Launch(run_dir, done.returncode, done.stdout + done.stderr)
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    pq.write_table(image_table(90), root / "photos.parquet")
    config = load_config(
        None,
        [
            f"data.source={root / 'photos.parquet'}",
            f"data.root={root / 'shards'}",
            "data.label=shape",
            "data.key=id",
            'data.inputs={"photo": {"kind": "image", "size": 12}, "colour": "categorical"}',
        ],
    ).data
    return prepare_dataset(config).dataset_dir


@pytest.fixture(scope="module")
def one_rank(dataset, tmp_path_factory) -> Launch:
    return launch(tmp_path_factory.mktemp("w1"), dataset, nproc=1, batch_size=2 * BATCH, env={}, num_workers=0)


@pytest.fixture(scope="module")
def two_ranks_resumed(dataset, tmp_path_factory) -> Launch:
    kill = {"DDPFLOW_FAULT": "kill:rank=1:epoch=1"}
    return launch(tmp_path_factory.mktemp("w2"), dataset, 2, BATCH, kill, num_workers=2, max_restarts=1)


@pytest.mark.torchrun
def test_augmented_views_and_weights_agree_across_world_sizes_workers_and_a_resume(one_rank, two_ranks_resumed):
    assert (two_ranks_resumed.run_dir / ".fault-kill-done").exists()  # killed once, then resumed from last.pt
    rows = len(one_rank.indices(0, 0))
    single = one_rank.views(1, {0: 0}, rows)
    double = two_ranks_resumed.views(2, {0: 0, 1: 1}, rows)
    assert len(single) == EPOCHS * rows and double.keys() == single.keys()
    assert double == single  # the same view of every row in every epoch, bit for bit
    changed = sum(single[(1, row)] != single[(0, row)] for row in one_rank.indices(0, 0))
    assert changed > 0.9 * rows, "augmentation is on: a row's view changes from one epoch to the next"
    a, b = one_rank.model(), two_ranks_resumed.model()
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], atol=EXACT, rtol=0, msg=name)
    assert "2 decode worker(s) per rank" in two_ranks_resumed.output
    assert "0 decode worker(s) per rank" in one_rank.output


@pytest.mark.torchrun
def test_evaluation_keeps_the_misclassified_images_with_their_bytes(one_rank, dataset):
    from ddpflow.tracking.plots import misclassified_figure
    from training.inference.evaluate import evaluate_split

    result = evaluate_split(one_rank.run_dir / "model.pt", dataset, return_predictions=True)
    wrong = int((result.predictions != result.targets).sum())
    assert result.misclassified is not None and len(result.misclassified) == min(wrong, 16)
    originals = {bytes(photo) for photo in image_table(90)["photo"].to_pylist()}
    for row in result.misclassified:
        assert row["bytes"] in originals and row["true"] != row["predicted"] and row["input"] == "photo"
    if wrong:
        assert misclassified_figure(result) is not None


def test_decode_workers_and_the_cores_they_run_on():
    pinned = CpuSetup(8, tuple(range(8)))
    assert decode_workers("auto", pinned, on_gpu=False, decodes=False) == 0  # tables, text: no workers
    assert decode_workers("auto", pinned, on_gpu=False, decodes=True) == 2  # one per 4 cores of a CPU rank
    assert decode_workers("auto", CpuSetup(4, (0, 1, 2, 3)), on_gpu=False, decodes=True) == 1
    assert decode_workers("auto", CpuSetup(3, (0, 1, 2)), on_gpu=False, decodes=True) == 0  # below 4: in the rank
    assert decode_workers("auto", CpuSetup(16), on_gpu=True, decodes=True) == 8  # a GPU rank: up to 8
    assert decode_workers("auto", CpuSetup(3), on_gpu=True, decodes=True) == 2
    assert decode_workers(5, pinned, on_gpu=False, decodes=False) == 5  # as given
    train = load_config(None, []).train
    before = torch.get_num_threads()
    try:
        assert make_room_for_workers(pinned, 2, train) == CpuSetup(6, pinned.cores)  # threads + workers = cores
        assert torch.get_num_threads() == 6
        assert make_room_for_workers(CpuSetup(4), 2, train) == CpuSetup(4)  # unpinned (GPU) ranks keep theirs
        explicit = load_config(None, ["train.num_threads=8"]).train
        assert make_room_for_workers(pinned, 2, explicit) == pinned
    finally:
        torch.set_num_threads(before)
