"""What batch scoring asks MLflow: the model a ``score.model`` spec names, as a local model.pt with its name and
version, and the record of a scoring (one MLflow run: model version, source, rows, rows/s, the distribution of
the scores).

    model = scoring_model("churn@champion", tracking_uri, scratch_dir)   # or "churn/3", or "runs/x/model.pt"
    model.path, model.identity()   # a local model.pt; {"name", "version", "uri"}
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from ddpflow.drift.report import Profile
from ddpflow.tracking.drift import UNAVAILABLE, DriftOutcome, drift_from_version, log_drift
from ddpflow.tracking.registry import download_version_checkpoint
from ddpflow.tracking.served_model import registered_version


@dataclass(frozen=True)
class ScoringModel:
    path: Path  # a local model.pt
    name: str
    version: str
    uri: str  # models:/NAME@alias, models:/NAME/version, or the model.pt's path

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "uri": self.uri}


def is_model_file(spec: str) -> bool:
    return spec.endswith(".pt") or Path(spec).is_file()


def scoring_model(spec: str, tracking_uri: str | None, destination: str | Path) -> ScoringModel:
    """``NAME@alias`` / ``NAME/version`` / ``NAME`` (its @champion) from the registry, or a run's ``model.pt``
    (named by its path, versioned by its content's hash); ValueError naming what is not there."""
    if is_model_file(spec):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"score.model {spec!r}: no such model.pt")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        return ScoringModel(path, str(path), f"sha256:{digest}", str(path))
    client, found, uri = registered_version(spec, tracking_uri, f" for score.model {spec!r}")
    path = download_version_checkpoint(client, found, Path(destination) / f"{found.name}-v{found.version}")
    return ScoringModel(path, found.name, str(found.version), uri)


SCORING_TAG = "ddpflow.scoring"  # "true" on a scoring's MLflow run (not a training run)


def log_scoring(
    config, tracking_uri: str, model: ScoringModel, summary: dict, distribution: dict, profile: dict | str
) -> tuple[str, DriftOutcome]:
    """One MLflow run for a finished scoring: the model version, the source and output, rows, rows/s, the
    scores' distribution; and drift of the scored table's inputs from the training data of the version that
    scored (``profile``: ``training/inference/scored_drift.py: scored_profile``, or why there is none). (run id,
    drift outcome)."""
    from ddpflow.tracking.runs import configure_mlflow

    client, experiment_id = configure_mlflow(config, tracking_uri)
    tags = {SCORING_TAG: "true", "score.model": model.name, "score.model_version": model.version,
            "score.source_fingerprint": summary["source"]["fingerprint"]}  # fmt: skip
    run = client.create_run(experiment_id, run_name=f"score-{Path(model.name).name}-v{model.version}", tags=tags)
    run_id = run.info.run_id
    params = {"model": model.uri, "model_version": model.version, "source": summary["source"]["url"],
              "output": summary["output"], "output_kind": summary["output_kind"],
              "nproc_per_node": summary["world_size"], "batch_size": config.score.batch_size}  # fmt: skip
    stamp = int(time.time() * 1000)
    numbers = {"rows": summary["rows"], "scored_rows": summary["scored"], "rejected_rows": summary["rejected"],
               "rows_per_s": summary["rows_per_s"], "elapsed_s": summary["elapsed_s"], **distribution}  # fmt: skip
    client.log_batch(
        run_id,
        metrics=[Metric(key, float(value), stamp, 0) for key, value in numbers.items() if value is not None],
        params=[Param(f"score.{key}", str(value)) for key, value in params.items()],
    )
    client.log_dict(run_id, {key: summary[key] for key in ("files", "source", "coverage", "model")}, "scoring.json")
    outcome = scoring_drift(client, model, profile, summary["source"]["fingerprint"])
    log_drift(client, run_id, outcome)
    client.set_terminated(run_id, "FINISHED")
    return run_id, outcome


def scoring_drift(client: MlflowClient, model: ScoringModel, profile: dict | str, fingerprint: str) -> DriftOutcome:
    """The scored table (``profile``: ``training/inference/scored_drift.py: scored_profile``, or why there is none)
    against the training data of the registered version that scored, as the retraining flow compares a new train
    split with the champion's (``drift_from_version``)."""
    if isinstance(profile, str):
        return DriftOutcome(UNAVAILABLE, f"drift of the scored table is not available: {profile}")
    version = client.get_model_version(model.name, model.version)
    return drift_from_version(client, version, Profile.of_scored_table(profile, fingerprint), "the scored table")
