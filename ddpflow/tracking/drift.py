"""Data drift in MLflow: the champion's training data, the comparison with a run's, the figure and the metric.

    outcome = measure_drift(client, model_name, manifest)   # against the current @champion's training data
    log_drift(client, run_id, outcome, max_psi)             # drift/data_drift.png, data_drift_max_psi, drift_psi/...
    outcome = measure_and_log_drift(tracking_uri, model_name, manifest, run_id, max_psi)   # both, for the task

The champion's training data is the ``data/manifest.json`` its MLflow run logged at
start (``runs.py: TRAINING_DATA_ARTIFACT``), so drift survives the deletion of old
shards; a run without that artifact falls back to the manifest in its
``ddpflow.dataset_dir``. When neither is there, or a manifest has no histograms
(prepared before PREPARE_VERSION 3), drift is "not available" with the reason: a log
line, never an error. With no champion yet there is nothing to compare with, and
nothing is logged. The numbers are ``ddpflow/drift/``'s (``report.compare``).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.entities.model_registry import ModelVersion

from ddpflow.drift.psi import DriftUnavailable
from ddpflow.drift.report import DriftReport, Profile, compare
from ddpflow.tracking.plots import drift_figure
from ddpflow.tracking.registry import CHAMPION, find_alias, first_line, is_transient
from ddpflow.tracking.runs import DATASET_DIR_TAG, TRAINING_DATA_ARTIFACT
from training.core.manifest import Manifest, read_manifest

DRIFT_FIGURE = "drift/data_drift.png"
DRIFT_REPORT = "drift/data_drift.json"
MAX_PSI_METRIC = "data_drift_max_psi"
MEASURED, NO_CHAMPION, UNAVAILABLE = "measured", "no champion", "not available"
PSI_METRIC_PREFIX = "drift_psi/"  # + a feature's name: its PSI
METRICS_PER_BATCH = 1000  # MLflow's limit on one log_batch


def psi_metric(feature: str) -> str:
    """``drift_psi/<feature>``, the feature's name kept to what MLflow takes in a metric's name (letters, digits,
    ``_ - . : space``; a vector's ``name[3]`` is ``name_3_``)."""
    name = re.sub(r"[^\w.\- :]", "_", feature)
    return PSI_METRIC_PREFIX + (name if name.strip(".") else name.replace(".", "_") or "_")  # not a path: ".", ""


@dataclass(frozen=True)
class DriftOutcome:
    """What drift measurement found: ``status`` MEASURED (with a report), NO_CHAMPION or UNAVAILABLE (why)."""

    status: str
    message: str
    champion_version: str | None = None
    report: DriftReport | None = None

    @property
    def reference(self) -> str:
        return f"champion v{self.champion_version}'s training data"

    def summary(self, count: int = 5) -> dict[str, Any]:
        """For the flow's result: the status, and the most drifted features when measured."""
        summary: dict[str, Any] = {"status": self.status, "message": self.message}
        if self.report is not None:
            summary |= {
                "champion_version": self.champion_version,
                "max_psi": self.report.max_psi,
                "worst_feature": self.report.worst.feature,
                "top": [
                    {
                        "feature": drift.feature,
                        "psi": drift.psi,
                        "mean_shift": drift.mean_shift,
                        **_null_rates(drift),
                    }
                    for drift in self.report.top(count)
                ],
            }
        return summary


def _null_rates(drift) -> dict[str, float]:
    """A feature's null rates, where either dataset has missing values."""
    if not (drift.reference_null_rate or drift.current_null_rate):
        return {}
    return {"reference_null_rate": drift.reference_null_rate, "current_null_rate": drift.current_null_rate}


def measure_and_log_drift(
    tracking_uri: str,
    model_name: str,
    manifest: Manifest,
    run_id: str,
    max_psi: float | None = None,
    label: bool = True,
) -> DriftOutcome:
    """``measure_drift`` then ``log_drift`` on the store at ``tracking_uri`` (models and runs in one store).

    ``label=False``: the label's drift is left out of the report (a next_token model does not use the label)."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    outcome = measure_drift(client, model_name, manifest)
    if not label and outcome.report is not None:
        outcome = replace(outcome, report=replace(outcome.report, label=None))
    log_drift(client, run_id, outcome, max_psi)
    return outcome


def measure_drift(client: MlflowClient, model_name: str, manifest: Manifest) -> DriftOutcome:
    """Drift of ``manifest``'s train split from the current @champion's training data."""
    champion = find_alias(client, model_name, CHAMPION)
    if champion is None:
        return DriftOutcome(NO_CHAMPION, f"{model_name} has no champion yet: no data to compare with")
    return drift_from_version(client, champion, manifest)


def drift_from_version(
    client: MlflowClient, version: ModelVersion, current: Manifest | Profile, subject: str | None = None
) -> DriftOutcome:
    """Drift of ``current`` (a manifest's train split; a batch scoring's table, ``subject`` "the scored table")
    from the training data of a registered ``version`` (``report.compare``)."""
    number = str(version.version)
    reference = f"v{number}'s training data" if subject else f"champion v{number}'s training data"
    try:
        report = compare(champion_training_data(client, version), current)
    except DriftUnavailable as why:
        return DriftOutcome(UNAVAILABLE, f"drift from {reference} is not available: {why}")
    worst = report.worst
    message = (
        f"largest drift{f' of {subject}' if subject else ''} from {reference}: {worst.feature} "
        f"(PSI {worst.psi:.3g}, mean shift {worst.mean_shift:+.2f} std)"
    )
    return DriftOutcome(MEASURED, message, number, report)


def champion_training_data(client: MlflowClient, version: ModelVersion) -> Manifest:
    """The manifest of the data ``version`` was trained on: its run's artifact, else its dataset directory."""
    run_id = version.run_id
    try:
        with tempfile.TemporaryDirectory(prefix="ddpflow-drift-") as scratch:
            path = client.download_artifacts(run_id, TRAINING_DATA_ARTIFACT, scratch)
            return Manifest.from_dict(json.loads(Path(path).read_text()))
    except Exception as error:
        if is_transient(error):
            raise
        missing = f"its MLflow run {run_id} has no {TRAINING_DATA_ARTIFACT} ({first_line(error)})"
    dataset_dir = client.get_run(run_id).data.tags.get(DATASET_DIR_TAG)
    if dataset_dir and "://" not in dataset_dir and Path(dataset_dir).is_dir():
        try:
            return read_manifest(dataset_dir)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DriftUnavailable(f"{missing}, and {dataset_dir}'s manifest does not read ({error})") from None
    raise DriftUnavailable(f"{missing}, and its dataset directory {dataset_dir or '(not recorded)'} is gone")


def log_drift(client: MlflowClient, run_id: str, outcome: DriftOutcome, max_psi: float | None = None) -> None:
    """The figure, the metrics ``data_drift_max_psi`` and ``drift_psi/<feature>`` (each feature's PSI), the whole
    report and two tags; nothing unless measured."""
    report = outcome.report
    if report is None:
        return
    client.log_figure(run_id, drift_figure(report, outcome.reference, max_psi), DRIFT_FIGURE)
    client.log_dict(run_id, {"reference": outcome.reference, **report.to_dict()}, DRIFT_REPORT)
    stamp = int(time.time() * 1000)
    metrics = [Metric(MAX_PSI_METRIC, report.max_psi, stamp, 0)]
    metrics += [Metric(psi_metric(drift.feature), drift.psi, stamp, 0) for drift in report.features]
    for first in range(0, len(metrics), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[first : first + METRICS_PER_BATCH])
    client.set_tag(run_id, "drift.champion_version", str(outcome.champion_version))
    client.set_tag(run_id, "drift.worst_feature", report.worst.feature)
