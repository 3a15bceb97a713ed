"""Prefect task: how this run's train split differs from the champion's training data.

The numbers are ``ddpflow/drift/``'s (PSI and mean shift per feature) and the MLflow
side ``ddpflow/tracking/drift.py``'s (``drift/data_drift.png``, ``data_drift_max_psi``).
This wrapper adds the Prefect view: a log line and a markdown artifact ``data-drift``
listing the five most drifted features. Drift is a report: with no champion, or when
the champion's data profile is not available, it says so and the run goes on. The
gate applies ``registry.max_drift_psi`` itself (ddpflow/tracking/registration.py).
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ddpflow.tracking.drift import UNAVAILABLE, DriftOutcome, measure_and_log_drift
from ddpflow.tracking.runs import how_to_open
from tasks.register import retry_on_transient_error
from training.core.config import PipelineConfig
from training.core.manifest import Manifest
from training.objectives.registry import objective_record

TOP_FEATURES = 5


def drift_markdown(outcome: DriftOutcome, max_psi: float | None, run_link: str) -> str:
    """The Prefect UI's view: the five most drifted features, or why there is nothing to show."""
    if outcome.report is None:
        return f"# Data drift: {outcome.status}\n\n{outcome.message}.\n"
    report = outcome.report
    rows = "\n".join(
        f"| {drift.feature} | {drift.psi:.4f} | {drift.mean_shift:+.3f} | {drift.reference_mean:.4g} | "
        f"{drift.current_mean:.4g} |"
        for drift in report.top(TOP_FEATURES)
    )
    limit = f"registry.max_drift_psi: {max_psi:g}" if max_psi is not None else "registry.max_drift_psi: not set"
    link = f"[{run_link}]({run_link})" if run_link.startswith("http") else run_link
    return (
        f"# Data drift from {outcome.reference}\n\n"
        f"Train split {report.current_fingerprint} against {report.reference_fingerprint}: "
        f"largest PSI **{report.max_psi:.4f}** ({report.worst.feature}); {limit}.\n\n"
        f"| feature | PSI | mean shift (std) | champion's mean | this run's mean |\n|---|---|---|---|---|\n{rows}\n\n"
        f"All {len(report.features)} features: `drift/data_drift.png` and `drift/data_drift.json` in {link}\n"
    )


@task(
    name="measure-data-drift",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_on_transient_error,
    cache_policy=NO_CACHE,
)
def measure_data_drift(config: PipelineConfig, manifest: Manifest, run_id: str, tracking_uri: str) -> dict[str, Any]:
    """Compare with @champion's training data, log the figure and metric to the run; returns a summary."""
    logger = get_run_logger()
    max_psi = config.registry.max_drift_psi
    objective = objective_record(config.train.objective, manifest.task)
    label = objective.uses_label  # an objective that does not learn the label (a language model): no label drift
    outcome = measure_and_log_drift(tracking_uri, config.registry.model_name, manifest, run_id, max_psi, label)
    (logger.warning if outcome.status == UNAVAILABLE else logger.info)("Data drift: %s", outcome.message)
    if not label and outcome.report is not None:
        logger.info("%s: the label's drift is not reported (the objective does not use the label)", objective.name)
    create_markdown_artifact(
        markdown=drift_markdown(outcome, max_psi, how_to_open(tracking_uri, run_id)),
        key="data-drift",
        description=f"Data drift of MLflow run {run_id}'s train split from the champion's training data",
    )
    return outcome.summary(TOP_FEATURES)
