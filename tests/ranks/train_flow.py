"""A flow that runs the real train_model task on the stand-in rank, in its own process.

train_flow.py RUN_DIR DATASET_DIR     (PREFECT_API_URL and DUMMY_RANK_* from the environment)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_helpers import DUMMY_RANK

import ddpflow.launch.command

ddpflow.launch.command.RANK_ENTRYPOINT = str(DUMMY_RANK)

from prefect import flow  # noqa: E402

from tasks.train import TrainRequest, train_model  # noqa: E402
from training.core.config import PipelineConfig  # noqa: E402


@flow(name="train-stand-in")
def train_stand_in(run_dir: str, dataset_dir: str):
    config = PipelineConfig.model_validate({"train": {"nproc_per_node": 2, "batch_size": 10}})
    return train_model(TrainRequest(config, dataset_dir, run_dir, grace_s=3))


if __name__ == "__main__":
    train_stand_in(sys.argv[1], sys.argv[2])
