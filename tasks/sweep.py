"""Prefect tasks of the sweep flow: each trial's launch is the train task (tasks/train.py: ``train_model``,
with its retries, cancellation and epoch mirror); here the sweep's own steps and what the Prefect UI shows of it.

``SweepProgress``: a progress artifact (``sweep-progress``: trials finished out of ``sweep.trials``) and one
log line per trial (done, pruned, failed, the best so far). ``summarise_sweep``: the parent MLflow run's
table, plot and best trial (ddpflow/sweep/session.py: ``summarise``) and the table as a Prefect artifact
(``sweep-trials``).
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from ddpflow.sweep.session import BestTrial, summarise
from ddpflow.sweep.study import finished_trials
from ddpflow.sweep.trials import SweepSetup, trial_rows
from ddpflow.tracking.sweep import cell


class SweepProgress:
    """Called with each trial's line (SweepSetup.report): the flow run's log and its progress artifact."""

    def __init__(self, total: int, study: Any):
        self.total, self.study = total, study
        self.logger = get_run_logger()
        self.artifact_id = create_progress_artifact(
            progress=self._percent(), key="sweep-progress", description=f"Trials finished of {total}"
        )

    def _percent(self) -> float:
        return min(100.0, 100.0 * len(finished_trials(self.study)) / self.total)

    def __call__(self, line: str) -> None:
        self.logger.info("sweep: %s", line)
        try:
            update_progress_artifact(self.artifact_id, self._percent())
        except Exception as error:  # the UI's view must not stop the sweep
            self.logger.warning("could not update the sweep's progress artifact: %s", error)


@task(name="summarise-sweep", cache_policy=NO_CACHE)
def summarise_sweep(setup: SweepSetup, study: Any) -> BestTrial | None:
    """The parent run's summary in MLflow, the table in Prefect; the best complete trial (None: none completed)."""
    rows = trial_rows(study, setup.sweep)
    best = summarise(setup, study)
    create_table_artifact(
        key="sweep-trials",
        table=[{name: cell(value) for name, value in row.items()} for row in rows],
        description=f"Every trial of sweep {setup.sweep.study_name()} by {setup.sweep.objective}",
    )
    return best
