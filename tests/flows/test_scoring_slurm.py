"""Batch scoring with ``score.launcher: slurm`` on the session's two-node cluster (tests/slurm_cluster.py): the
scoring ranks (1 per node, 2 nodes) run as one Slurm job through the Slurm code training uses.

One scoring of the mixed table (tests/flows/test_batch_scoring.py's model and source) by the score-pipeline flow,
whose flow run is cancelled through the API part-way (the score task's check: scancel, the runs Cancelled), then run
again as `ddpflow score` runs it: it resumes from the parts the first job wrote, ends with every row once, and
scores as the pyfunc does.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pandas as pd
import pytest
from slurm_cluster import processes_mentioning, wait_until

from ddpflow.launch.slurm.commands import SlurmSetupError
from tests.flows.test_batch_scoring import ROWS, as_registered, read_scores, source_files, train_scorer
from tests.flows.test_mixed_inputs import INPUTS

pytestmark = pytest.mark.torchrun
MODEL = {"name": "scorer", "version": "1", "uri": "models:/scorer/1"}


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, _migrated_mlflow_db) -> dict:
    """test_batch_scoring's model.pt trained on the mixed table, and its config."""
    return train_scorer(tmp_path_factory.mktemp("scoring"), _migrated_mlflow_db)


def on_slurm(scorer: dict, **score):
    """The trained model's config, scoring through Slurm: 2 nodes x 1 rank."""
    config = scorer["config"]
    settings = {"launcher": "slurm", "nnodes": 2, "nproc_per_node": 1, **score}
    slurm = config.slurm.model_copy(update={"poll_interval_s": 0.5})
    return config.model_copy(update={"score": config.score.model_copy(update=settings), "slurm": slurm})


def jobs_of(cluster, output) -> list[str]:
    script = str(output / ".score" / "slurm" / "job.sh")
    return [job_id for job_id in cluster.job_ids() if cluster.job(job_id).get("Command") == script]


def cancel_the_flow_run_after_two_parts(output, cancelled: list) -> threading.Thread:
    """A thread that cancels the running score-pipeline flow run through the API (as the UI does) once the job
    wrote two parts; the run's id goes to ``cancelled``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.states import Cancelling

    def cancel() -> None:
        wait_until(lambda: len(list(output.glob("part-*.parquet"))) >= 2, 180, "two parts")
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["score-pipeline"])))
            (running,) = [run for run in runs if run.state and run.state.is_running()]
            client.set_flow_run_state(running.id, Cancelling(), force=True)
        cancelled.append(running.id)

    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    return thread


def test_a_slurm_scoring_cancelled_part_way_resumes_and_ends_with_every_row_once(
    scorer, slurm_cluster, prefect_harness, tmp_path
):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import Abort

    from ddpflow.scoring import score_table
    from flows.score_pipeline import score_pipeline
    from training.inference.serving import load_predictor, predictions

    source, output = source_files(tmp_path / "src"), tmp_path / "out"
    config = on_slurm(scorer, model=str(scorer["model_path"]), source=str(source), output=str(output))

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDPFLOW_SCORE_PAUSE_S", "2")  # each rank rests after each part (sbatch passes it on): the
        # cancellation (the task asks every 2 s) lands part-way
        cancelled = []
        canceller = cancel_the_flow_run_after_two_parts(output, cancelled)
        # The score task's flow-run check (tasks/train.py: flow_run_cancelled_check) stops the launch: scancel,
        # then Abort.
        with pytest.raises(Abort, match=r"was cancelled \(Cancelling\); cancelled Slurm job \d+"):
            score_pipeline(config=config)
        canceller.join(timeout=30)
    [first] = jobs_of(slurm_cluster, output)
    assert slurm_cluster.job(first)["JobState"] == "CANCELLED", "scancelled before the task returned"
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(cancelled[0]).state.is_cancelled()
    wait_until(lambda: not processes_mentioning(str(output)), 30, "the job's processes to end")
    kept = {path.name: path.stat().st_mtime_ns for path in output.glob("part-*.parquet")}
    assert 2 <= len(kept) < 8 and not (output / "manifest.json").exists()

    # Run again (what `ddpflow score` runs): a new job, which scores only the ranges left.
    lines = []
    summary = score_table(config, on_line=lines.append)
    second = [job_id for job_id in jobs_of(slurm_cluster, output) if job_id != first]
    assert len(second) == 1, second
    job = slurm_cluster.job(second[0])
    assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2" and job["NodeList"] == "n[1-2]", job
    assert summary["resumed_parts"] == len(kept) and summary["world_size"] == 2
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["coverage"]["rows"] == ROWS and manifest["rows"] == ROWS
    ids = read_scores(output)["customer_id"]
    assert ids.is_unique and sorted(ids) == sorted(pd.read_parquet(source)["customer_id"])
    assert {name: (output / name).stat().st_mtime_ns for name in kept} == kept, "finished parts left alone"
    assert all((output / ".score" / "slurm" / second[0] / node / "logs").is_dir() for node in ("n1", "n2"))
    assert (output / ".score" / "model.pt").is_file(), "every node loads the model from the output"
    sbatch = json.loads((output / ".score" / "slurm" / "job.json").read_text())["sbatch"]
    assert "--nodes=2" in sbatch and "--no-requeue" in sbatch and not any(a.startswith("--signal") for a in sbatch)
    script = (output / ".score" / "slurm" / "job.sh").read_text()
    assert str(output / ".score" / "model.pt") in script, "the job checks every node sees the model first"
    assert "-m training.inference.batch_scoring --config" in script

    raw = pd.read_parquet(source)
    expected = predictions(load_predictor(scorer["model_path"]), raw[list(INPUTS)], "probabilities")
    scores = read_scores(output)
    np.testing.assert_array_equal(scores["customer_id"], raw["customer_id"])
    np.testing.assert_array_equal(scores["prediction"], expected["label"])
    for column in ("probability_0", "probability_1"):
        np.testing.assert_allclose(scores[column], expected[column], atol=1e-5)


def test_the_preflight_names_the_score_settings_and_submits_nothing(scorer, slurm_cluster, tmp_path):
    from ddpflow.launch.scoring import ScoreRequest, run_scoring

    source, output = source_files(tmp_path / "src", rows=300), tmp_path / "out"
    config = on_slurm(scorer, source=str(source), output=str(output), nnodes=3)
    with pytest.raises(SlurmSetupError, match=r"^score\.nnodes: 3 nodes asked for, but partition 'debug' has 2$"):
        run_scoring(ScoreRequest(config, as_registered(scorer["model_path"], MODEL)))
    assert not output.exists() and jobs_of(slurm_cluster, output) == []
