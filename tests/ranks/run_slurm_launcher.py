"""Runs the Slurm launcher (ddpflow/launch/slurm/launcher.py) on the stand-in rank in its own process, for signal tests.

    run_slurm_launcher.py CONFIG_JSON DATASET_DIR RUN_DIR

SLURM_CONF and DUMMY_RANK_* come from the environment. Prints every line, "JOB <id>" once the
job is submitted or found, "LAUNCH-ERROR: <type>: <message>" when the launch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_helpers import DUMMY_RANK

import ddpflow.launch.command
from ddpflow.launch.failure import LaunchError
from ddpflow.launch.slurm.launcher import run_training_on_slurm
from ddpflow.launch.stage import TrainRequest
from training.core.config import PipelineConfig

ddpflow.launch.command.RANK_ENTRYPOINT = str(DUMMY_RANK)


def main() -> None:
    config_json, dataset_dir, run_dir = sys.argv[1:4]
    config = PipelineConfig.model_validate_json(Path(config_json).read_text())
    try:
        request = TrainRequest(
            config,
            dataset_dir,
            run_dir,
            on_line=lambda line: print(line, flush=True),
            on_job=lambda job_id: print(f"JOB {job_id}", flush=True),
        )
        run_training_on_slurm(request)
    except LaunchError as error:
        print(f"LAUNCH-ERROR: {type(error).__name__}: {error}", flush=True)
        raise
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
