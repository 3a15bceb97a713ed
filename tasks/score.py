"""Prefect task: a model scores a whole table on torchrun ranks (``ddpflow/scoring.py: score_table``).

The work, its exactness, resume and refusals are plain Python (``ddpflow/launch/scoring.py``,
``training/inference/batch_scoring.py``). This wrapper adds the Prefect view: every rank's line in the run's log,
a table artifact ``scored-table`` (rows, rejected, parts, model version, rows/s, the MLflow run), and cancellation
(tasks/train.py: ``flow_run_cancelled_check``; a cancelled flow run stops the ranks, local torchrun or a Slurm
job by scancel; the part files already written are kept, the task and flow runs end Cancelled, and the next run
resumes). No retries: bad input fails the same way every time, and a re-run resumes from the parts anyway.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from ddpflow.launch.failure import LaunchInterrupted
from ddpflow.scoring import score_table
from tasks.train import flow_run_cancelled_check
from training.core.config import PipelineConfig


@task(name="score-table", retries=0, cache_policy=NO_CACHE)
def score_table_task(config: PipelineConfig) -> dict[str, Any]:
    logger = get_run_logger()
    cancel_check = flow_run_cancelled_check()
    try:
        summary = score_table(config, on_line=lambda line: logger.info("%s", line), should_cancel=cancel_check)
    except LaunchInterrupted as error:
        if cancel_check is not None:
            cancel_check.abort_if_fired(error)  # Abort: the runs stay Cancelled
        raise
    logger.info(
        "%s v%s scored %s rows of %s into %s (%s rejected, %s rows/s)%s",
        summary["model"]["name"], summary["model"]["version"], summary["rows"], summary["source"]["url"],
        summary["output"], summary["rejected"], summary["rows_per_s"],
        " (already complete)" if summary.get("already_complete") else "",
    )  # fmt: skip
    if summary.get("data_drift"):
        drift = summary["data_drift"]
        top = ", ".join(f"{entry['feature']} {entry['psi']:.3g}" for entry in drift.get("top", []))
        logger.info("Data drift: %s%s", drift["message"], f"; PSI of the most drifted: {top}" if top else "")
    row = {key: summary.get(key) for key in ("rows", "scored", "rejected", "rows_per_s", "output", "mlflow_run_id")}
    row |= {"model": f"{summary['model']['name']} v{summary['model']['version']}", "parts": len(summary["files"])}
    create_table_artifact(key="scored-table", table=[row], description=f"Batch scoring of {summary['source']['url']}")
    return summary
