"""A Slurm job that fails after a step checkpoint, resubmitted on fewer nodes, resumes there.

The whole pipeline with ``train.launcher: slurm`` on the session's two-node cluster (tests/slurm_cluster.py):
a 2-node run with ``train.global_batch_size`` fails for good mid-epoch (its retry too); the same config on
1 node finds that run directory (the global batch, not the node count, is the training's identity), and its
job continues from the newest step checkpoint.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from training.checkpoint.files import step_checkpoints, step_position
from training.core.layout import FINAL_MODEL

pytestmark = pytest.mark.torchrun

# ~3200 train rows in global batches of 128: about 25 steps an epoch, a step checkpoint every 5 optimizer steps
# of the run; a fault before step 12 of epoch 1 leaves one of its first steps as the newest.
FAULT = "raise:rank=0:epoch=1:step=12"


def job_outputs(run_dir: str | Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted(Path(run_dir).glob("slurm/*.out")))


def test_a_job_failing_after_a_step_checkpoint_resumes_on_one_node(prefect_harness, slurm_cluster, make_config):
    from flows.pipeline import train_pipeline

    two_nodes = make_config(**{
        "train.launcher": "slurm", "train.nnodes": 2, "train.nproc_per_node": 1, "train.batch_size": None,
        "train.global_batch_size": 128, "train.checkpoint_every_steps": 5,
    })  # fmt: skip
    two_nodes["slurm"] = {"poll_interval_s": 0.5}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_FAULT", FAULT)  # sbatch hands the environment to the job
        with pytest.raises(Exception, match="injected fault"):
            train_pipeline(config=two_nodes)
    client = MlflowClient(two_nodes["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(two_nodes["mlflow"]["experiment"]).experiment_id
    (failed,) = client.search_runs([experiment])
    run_dir = Path(failed.data.tags["ddpflow.run_dir"])
    epoch, step = step_position(step_checkpoints(run_dir / "checkpoints")[-1])
    assert epoch == 1 and 0 < step < 12

    one_node = copy.deepcopy(two_nodes)
    one_node["train"]["nnodes"] = 1
    result = train_pipeline(config=one_node)
    assert result["run_dir"] == str(run_dir), "the same training: the run directory it left is resumed"
    assert Path(run_dir, FINAL_MODEL).is_file()
    output = job_outputs(run_dir)
    resumed_line = r"resumed from \S+ after 1 epoch\(s\), at step (\d+) of epoch 1; world size (\d) -> (\d)"
    found = re.findall(resumed_line, output)
    assert found[-1] == (str(step), "2", "1"), output[-4000:]
    resumed = client.get_run(result["mlflow_run_id"])
    assert resumed.data.tags["ddp.nnodes"] == "1" and resumed.data.tags["ddp.world_size"] == "1"
