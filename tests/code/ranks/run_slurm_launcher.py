"""Runs ddpflow.launch.slurm.run_training_on_slurm on the stand-in rank in its own process, for signal tests.

    run_slurm_launcher.py CONFIG_JSON DATASET_DIR RUN_DIR

SLURM_CONF and DUMMY_RANK_* come from the environment. Prints every line, "JOB <id>" once the
job is submitted or found, "LAUNCH-ERROR: <type>: <message>" when the launch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the project root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_helpers import DUMMY_RANK

import ddpflow.launch.command
from ddpflow.launch.failure import LaunchError
from ddpflow.launch.slurm import run_training_on_slurm
from training.config import PipelineConfig

ddpflow.launch.command.RANK_ENTRYPOINT = str(DUMMY_RANK)


def main() -> None:
    config_json, dataset_dir, run_dir = sys.argv[1:4]
    config = PipelineConfig.model_validate_json(Path(config_json).read_text())
    try:
        run_training_on_slurm(
            config,
            dataset_dir,
            run_dir,
            on_line=lambda line: print(line, flush=True),
            on_job=lambda job_id: print(f"JOB {job_id}", flush=True),
        )
    except LaunchError as error:
        print(f"LAUNCH-ERROR: {type(error).__name__}: {error}", flush=True)
        raise
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
