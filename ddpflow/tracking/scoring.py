"""What batch scoring asks MLflow: the model a ``score.model`` spec names, as a local model.pt with its name and
version, and the record of a scoring (one MLflow run: model version, source, rows, rows/s, the distribution of
the scores, the drift).

    model = scoring_model("churn@champion", tracking_uri, scratch_dir)   # or "churn/3", or "runs/x/model.pt"
    model.path, model.identity(), model.file.meta   # a local model.pt (read once); {"name", "version", "uri"}
    run = ScoringRun(config)     # run.start(model, job, plan) as the ranks start; run.finish(...) once they end

MLflow is imported only where it is used: a model.pt scores without importing it before the ranks start, and the
run's imports and store set-up happen on a thread while the ranks score. Nor is torch imported with this module:
reading the model does (``scoring_model``), once batch scoring has started torchrun.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from ddpflow.tracking.drift import DriftOutcome
    from training.inference.model_file import ModelFile


@dataclass(frozen=True)
class ScoringModel:
    path: Path  # a local model.pt
    name: str
    version: str
    uri: str  # models:/NAME@alias, models:/NAME/version, or the model.pt's path
    file: ModelFile  # its bytes and entries, read once

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "uri": self.uri}

    @property
    def registered(self) -> bool:
        return self.uri.startswith("models:/")


def is_model_file(spec: str) -> bool:
    return spec.endswith(".pt") or Path(spec).is_file()


def scoring_model(spec: str, tracking_uri: str | None, destination: str | Path) -> ScoringModel:
    """``NAME@alias`` / ``NAME/version`` / ``NAME`` (its @champion) from the registry, or a run's ``model.pt``
    (named by its path, versioned by its content's hash); ValueError naming what is not there. The file is read
    once: its hash, its entries and the copy the ranks load come from the same bytes. Imports torch (reading the
    file): batch scoring calls it once torchrun has started."""
    from training.inference.model_file import ModelFile

    if is_model_file(spec):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"score.model {spec!r}: no such model.pt")
        loaded = ModelFile.read(path)
        digest = hashlib.sha256(loaded.data).hexdigest()[:12]
        return ScoringModel(path, str(path), f"sha256:{digest}", str(path), loaded)
    from ddpflow.tracking.registry import download_version_checkpoint
    from ddpflow.tracking.served_model import registered_version

    client, found, uri = registered_version(spec, tracking_uri, f" for score.model {spec!r}")
    path = download_version_checkpoint(client, found, Path(destination) / f"{found.name}-v{found.version}")
    return ScoringModel(path, found.name, str(found.version), uri, ModelFile.read(path))


SCORING_TAG = "ddpflow.scoring"  # "true" on a scoring's MLflow run (not a training run)


class ScoringRun:
    """One MLflow run for a scoring that scores. ``start`` (as the ranks start: ``ScoreRequest.on_ranks_start``)
    creates it on a thread, with its tags and the params known then, so MLflow's imports and its store's set-up
    overlap the scoring; ``finish`` waits for that thread and logs the rest; ``fail`` ends a started run FAILED."""

    def __init__(self, config, tracking_uri: str | None = None):
        self.config, self.tracking_uri = config, tracking_uri
        self.model: ScoringModel | None = None  # the model that scores: known once the ranks start
        self.run_id: str | None = None
        self._client: MlflowClient | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, model: ScoringModel, job, plan) -> None:
        """Create the run on a thread (``job``: the ScoreJob the ranks read; ``plan``: its Plan)."""
        self.model = model
        self._thread = threading.Thread(target=self._create, args=(job, plan), name="scoring-run", daemon=True)
        self._thread.start()

    def _create(self, job, plan) -> None:
        try:
            self._client, self.run_id = self._new_run(job, plan)
        except BaseException as error:  # raised again by finish, in the caller's thread
            self._error = error

    def _new_run(self, job, plan) -> tuple[MlflowClient, str]:
        from mlflow.entities import Param

        from ddpflow.tracking.runs import configure_mlflow
        from ddpflow.tracking.tracking_uri import resolve_tracking_uri

        model, config = self.model, self.config
        self.tracking_uri = self.tracking_uri or resolve_tracking_uri(config)
        client, experiment_id = configure_mlflow(config, self.tracking_uri)
        tags = {SCORING_TAG: "true", "score.model": model.name, "score.model_version": model.version,
                "score.source_fingerprint": plan.fingerprint}  # fmt: skip
        name = f"score-{Path(model.name).name}-v{model.version}"
        run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        params = {"model": model.uri, "model_version": model.version, "source": job.source,
                  "output": config.score.output, "output_kind": job.output_kind,
                  "batch_size": config.score.batch_size}  # fmt: skip
        client.log_batch(run_id, params=[Param(f"score.{key}", str(value)) for key, value in params.items()])
        return client, run_id

    def _created(self) -> MlflowClient:
        if self._thread is None:
            raise RuntimeError("ScoringRun.finish before start")
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._client

    def finish(self, summary: dict, distribution: dict, profile: dict | str) -> tuple[str, DriftOutcome]:
        """Log the finished scoring (rows, rows/s, the scores' distribution) and the drift of the scored table from
        the training data of the version that scored (``profile``: ``training/inference/scored_drift.py:
        scored_profile``, or why there is none); end the run. (run id, drift outcome)."""
        from mlflow.entities import Metric, Param

        from ddpflow.tracking.drift import log_drift

        client = self._created()
        stamp = int(time.time() * 1000)
        numbers = {"rows": summary["rows"], "scored_rows": summary["scored"], "rejected_rows": summary["rejected"],
                   "rows_per_s": summary["rows_per_s"], "elapsed_s": summary["elapsed_s"], **distribution}  # fmt: skip
        client.log_batch(
            self.run_id,
            metrics=[Metric(key, float(value), stamp, 0) for key, value in numbers.items() if value is not None],
            params=[Param("score.nproc_per_node", str(summary["world_size"]))],
        )
        record = {key: summary[key] for key in ("files", "source", "coverage", "model")}
        client.log_dict(self.run_id, record, "scoring.json")
        outcome = scoring_drift(client, self.model, profile, summary["source"]["fingerprint"])
        log_drift(client, self.run_id, outcome)
        client.set_terminated(self.run_id, "FINISHED")
        return self.run_id, outcome

    def fail(self) -> None:
        """A started run whose scoring failed ends FAILED (an error creating it is left for the scoring's own)."""
        if self._thread is None:
            return
        self._thread.join()
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, "FAILED")


def scoring_drift(client: MlflowClient, model: ScoringModel, profile: dict | str, fingerprint: str) -> DriftOutcome:
    """The scored table (``profile``: ``training/inference/scored_drift.py: scored_profile``, or why there is none)
    against the training data of the registered version that scored, as the retraining flow compares a new train
    split with the champion's (``drift_from_version``)."""
    from ddpflow.drift.report import Profile
    from ddpflow.tracking.drift import UNAVAILABLE, DriftOutcome, drift_from_version

    if isinstance(profile, str):
        return DriftOutcome(UNAVAILABLE, f"drift of the scored table is not available: {profile}")
    version = client.get_model_version(model.name, model.version)
    return drift_from_version(client, version, Profile.of_scored_table(profile, fingerprint), "the scored table")
