"""MLflow glue for the pipeline: where tracking goes, the run, its lineage.

    uri = resolve_tracking_uri(config)
    check_tracking_reachable(uri)          # before training wastes an hour
    run_id = start_pipeline_run(config, run_name, prefect_context, fingerprint, manifest, ddp)
    ...
    end_pipeline_run(run_id, uri, status="FINISHED")

Every function takes the URI explicitly and uses an ``MlflowClient`` bound to
it, so concurrent Prefect tasks never share MLflow's "active run" state. The
one fluent call without a client form (logging the pyfunc model) runs inside
``use_tracking_uri``, which restores the process-wide URI afterwards:
``mlflow.set_tracking_uri`` also sets ``$MLFLOW_TRACKING_URI``, which would
otherwise override the next run's configured URI in the same process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Param
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from training.config import PipelineConfig
from training.data.manifest import Manifest
from training.layout import SPLITS
from training.metrics_sink import MlflowEpochLogger, read_metrics_lines

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"
MODEL_PT_IN_MODEL = "artifacts/model.pt"  # where training/serving.py's artifact lands in a logged model
CONFIG_ARTIFACT = "config.json"  # the run's PipelineConfig, so registration can be re-run later
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")

logger = logging.getLogger(__name__)


class TrackingUnreachableError(ConnectionError):
    """The MLflow tracking store cannot be used; the message names the URI."""


# ---------------------------------------------------------------- where things go


def resolve_tracking_uri(config: PipelineConfig) -> str:
    """``$MLFLOW_TRACKING_URI``, else ``mlflow.tracking_uri``, else ``sqlite:///<cwd>/mlflow.db``.

    A relative SQLite path is made absolute now, so every task and rank (with
    other working directories) writes to the same database.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.mlflow.tracking_uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        relative = uri.removeprefix("sqlite:///")
        if relative and relative != ":memory:":
            uri = f"sqlite:///{Path(relative).resolve()}"
    if "://" not in uri and not uri.startswith("databricks"):  # a bare path: MLflow 3's file store is deprecated
        raise ValueError(
            f"mlflow.tracking_uri {uri!r} is a plain path; use sqlite:///{Path(uri).resolve()}.db or an http(s):// server"
        )
    return uri


def is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def resolve_artifact_location(config: PipelineConfig, tracking_uri: str) -> str | None:
    """Artifact root for a NEW experiment: ``mlflow.artifact_location``, else ``<cwd>/mlartifacts``.

    Against an http(s) server with nothing configured: None, so the server's
    own ``--artifacts-destination`` is used (a local path here would not
    exist on the server, and clients elsewhere could not read it).
    """
    location = config.mlflow.artifact_location
    if location is None:
        return None if is_http(tracking_uri) else (Path.cwd() / "mlartifacts").as_uri()
    return (
        location if "://" in location or location.startswith("mlflow-artifacts:") else Path(location).resolve().as_uri()
    )


# ---------------------------------------------------------------- reachability


def check_tracking_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the URI, when the tracking store cannot be used."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        _check_http_server(uri, timeout_s)
    elif scheme == "sqlite":
        _check_sqlite_path(uri)


def _check_http_server(uri: str, timeout_s: float) -> None:
    health = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s):
            return
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise TrackingUnreachableError(
                f"MLflow tracking server {uri} refused access (HTTP {error.code}); set MLFLOW_TRACKING_USERNAME/"
                "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN"
            ) from None
        return  # it answered: a proxy in front of MLflow may not route /health
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise TrackingUnreachableError(
            f"MLflow tracking server {uri} is unreachable ({reason}). Start it (`ddpflow stack up`), or point "
            "MLFLOW_TRACKING_URI / mlflow.tracking_uri at a running server (or sqlite:///path/mlflow.db)"
        ) from None


def _check_sqlite_path(uri: str) -> None:
    path = Path(uri.removeprefix("sqlite:///"))
    if str(path) in ("", ":memory:"):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TrackingUnreachableError(f"MLflow tracking store {uri}: cannot create {path.parent} ({error})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TrackingUnreachableError(f"MLflow tracking store {uri}: {path} is not writable")


# ---------------------------------------------------------------- experiment and run


def configure_mlflow(config: PipelineConfig, tracking_uri: str | None = None) -> tuple[MlflowClient, str]:
    """A client bound to the store (tracking and registry); get or create the experiment. Returns (client, experiment id)."""
    uri = tracking_uri or resolve_tracking_uri(config)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return client, ensure_experiment(client, config.mlflow.experiment, resolve_artifact_location(config, uri))


@contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API points at ``uri`` inside the block; the environment is restored after."""
    saved_env = os.environ.get("MLFLOW_TRACKING_URI")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        if saved_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException as error:  # another flow created it a moment ago
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if experiment.lifecycle_stage == "deleted":
        raise ValueError(
            f"mlflow.experiment {name!r} is deleted; restore it (`mlflow experiments restore`) or choose another name"
        )
    if artifact_location and experiment.artifact_location.rstrip("/") != artifact_location.rstrip("/"):
        logger.warning(
            "experiment %r keeps its artifact location %s (configured: %s)",
            name,
            experiment.artifact_location,
            artifact_location,
        )
    return experiment.experiment_id


def git_commit(directory: str | Path | None = None) -> str | None:
    """The commit of the code that runs, when it is a git checkout."""
    directory = Path(directory or Path(__file__).resolve().parents[1])
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def run_tags(
    prefect_context: dict[str, Any], manifest: Manifest, fingerprint: str, ddp: dict[str, Any]
) -> dict[str, str]:
    tags = {
        "prefect.flow_run_id": prefect_context.get("flow_run_id"),
        "prefect.flow_run_name": prefect_context.get("flow_run_name"),
        "prefect.flow_run_url": prefect_context.get("flow_run_url"),
        "prefect.deployment": prefect_context.get("deployment_name") or prefect_context.get("deployment"),
        "prefect.deployment_id": prefect_context.get("deployment_id"),
        "data.fingerprint": fingerprint,
        "data.source": manifest.source,
        "data.task": manifest.task,
    }
    for key, value in ddp.items():
        tags[f"ddp.{key}"] = value
    if "world_size" not in ddp and isinstance(ddp.get("nproc_per_node"), int):
        tags["ddp.world_size"] = ddp["nproc_per_node"] * int(ddp.get("nnodes", 1))
    commit = git_commit()
    if commit:
        tags["git.commit"] = commit
        tags["mlflow.source.git.commit"] = commit  # what the MLflow UI shows
    return {key: str(value) for key, value in tags.items() if value is not None}


def dataset_inputs(manifest: Manifest, dataset_dir: str | Path, fingerprint: str) -> list[DatasetInput]:
    """One MLflow dataset per split, pointing at its Parquet shards; no data is read.

    A ``MetaDataset`` (source + schema + digest) rather than
    ``mlflow.data.from_pandas``, which would load the whole split into memory.
    The digest is the prepared data's fingerprint, so identical data is one
    dataset across runs.
    """
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, DataType, Schema

    label_type = DataType.long if manifest.task == "classification" else DataType.float
    schema = Schema(
        [ColSpec(DataType.float, name) for name in manifest.features] + [ColSpec(label_type, manifest.label)]
    )
    inputs = []
    for split in SPLITS:
        source = _dataset_source(f"{str(dataset_dir).rstrip('/')}/{split}")
        dataset = MetaDataset(
            source, name=f"{fingerprint[:16]}-{split}", digest=f"{fingerprint[:24]}-{split}"[:36], schema=schema
        )
        tags = [InputTag("mlflow.data.context", split), InputTag("rows", str(manifest.rows(split)))]
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
    return inputs


def _dataset_source(location: str):
    """MLflow's own resolver: a local path, s3://, gs://, ... becomes the matching artifact source."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    with warnings.catch_warnings():  # local paths match two registered sources; either is right
        warnings.simplefilter("ignore")
        return resolve_dataset_source(location)


def start_pipeline_run(
    config: PipelineConfig,
    run_name: str,
    prefect_context: dict[str, Any],
    fingerprint: str,
    manifest: Manifest,
    ddp: dict[str, Any],
    dataset_dir: str | Path | None = None,
) -> str:
    """Create the MLflow run for one pipeline run; returns its id.

    Params: the flattened config. Tags: Prefect flow run, data fingerprint and
    source, git commit, DDP layout. Inputs: the train/val/test shards. The
    config itself is logged as ``config.json`` so ``ddpflow register --run-id``
    can rebuild it. The run stays RUNNING until ``end_pipeline_run``.
    """
    client, experiment_id = configure_mlflow(config)
    run = client.create_run(
        experiment_id, run_name=run_name, tags=run_tags(prefect_context, manifest, fingerprint, ddp)
    )
    run_id = run.info.run_id
    params = [Param(key, str(value)[:6000]) for key, value in config.flat().items()]
    for start in range(0, len(params), 100):  # MLflow accepts at most 100 params per batch
        client.log_batch(run_id, params=params[start : start + 100])
    dataset_dir = dataset_dir or Path(config.data.root) / fingerprint
    if "://" not in str(dataset_dir):
        dataset_dir = Path(dataset_dir).resolve()  # a relative path means nothing to someone reading the run
    client.log_inputs(run_id, datasets=dataset_inputs(manifest, dataset_dir, fingerprint))
    client.log_dict(run_id, config.model_dump(mode="json"), CONFIG_ARTIFACT)
    return run_id


class EpochMetricsFollower:
    """Mirrors rank 0's RUN_DIR/metrics.jsonl into the pipeline's MLflow run, from the launching process.

    Why here and not in rank 0: this process already has MLflow loaded, while
    importing it in rank 0 costs seconds of CPU on rank 0's core, and every
    rank waits for rank 0 at the next collective. Why on a thread: a tracking
    server that is down makes MLflow retry for minutes, and the launcher's
    loop (timeouts, cancellation) must not wait for that. The train task
    calls ``poke()`` on every streamed line (it only sets an event) and
    ``close()`` once torchrun has exited, failed or not; ``close()`` catches up
    one last time. Each epoch lands once: epochs the run already holds (an
    earlier attempt's) are skipped.
    """

    def __init__(self, metrics_path: str | Path, run_id: str, tracking_uri: str):
        self.path = Path(metrics_path)
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._size_seen = -1
        self._logger = None  # created on the first epoch: no MLflow call before there is something to log
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> EpochMetricsFollower:
        self._thread = threading.Thread(target=self._follow, name="metrics-to-mlflow", daemon=True)
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float = 60.0) -> None:
        """Log what is left, waiting at most ``timeout_s`` (metrics.jsonl has every epoch either way)."""
        if self._thread is None:
            self.catch_up()
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "MLflow run %s: epoch metrics not all logged within %.0f s; %s has them",
                self.run_id,
                timeout_s,
                self.path,
            )

    def _follow(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            last = self._closing  # read before catching up: a close() during it wakes us for one more pass
            self.catch_up()
            if last:
                return

    def catch_up(self) -> None:
        """Log every complete epoch line the run does not hold yet; never raises."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._size_seen:
            return
        self._size_seen = size
        try:
            for record in read_metrics_lines(self.path):  # a torn last line is skipped now, read on the next change
                epoch = record.pop("epoch", None)
                if isinstance(epoch, int):
                    if self._logger is None:
                        self._logger = MlflowEpochLogger(self.run_id, self.tracking_uri)
                    self._logger.log(epoch, record)
        except Exception as error:
            logger.warning("could not mirror %s into MLflow run %s: %s", self.path, self.run_id, error)


def end_pipeline_run(run_id: str, tracking_uri: str, status: str = "FINISHED") -> None:
    """End the run FINISHED or FAILED (or KILLED). Never raises: it runs on error paths."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, not {status!r}")
    try:
        MlflowClient(tracking_uri=tracking_uri).set_terminated(run_id, status=status)
    except Exception as error:
        logger.warning("could not mark MLflow run %s %s in %s: %s", run_id, status, tracking_uri, error)


def run_url(tracking_uri: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI when the store is an http(s) server, else None."""
    if not is_http(tracking_uri):
        return None
    experiment_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def how_to_open(tracking_uri: str, run_id: str) -> str:
    """One line for people: the URL, or the run id and the command that opens the UI."""
    url = run_url(tracking_uri, run_id)
    if url:
        return url
    return f"MLflow run {run_id} in {tracking_uri} (open with: mlflow ui --backend-store-uri {tracking_uri})"


def read_run_config(client: MlflowClient, run_id: str) -> PipelineConfig:
    """The PipelineConfig that ``start_pipeline_run`` logged with the run."""
    with tempfile.TemporaryDirectory() as scratch:
        path = client.download_artifacts(run_id, CONFIG_ARTIFACT, scratch)
        return PipelineConfig.model_validate_json(Path(path).read_text())


# ---------------------------------------------------------------- the registry's champion


def find_alias(client: MlflowClient, model_name: str, alias: str = CHAMPION) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def download_version_checkpoint(client: MlflowClient, version: ModelVersion, destination: str | Path) -> Path:
    """The ``model.pt`` inside a registered version's logged model."""
    model_uri = client.get_model_version_download_uri(version.name, version.version)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"{model_uri.rstrip('/')}/{MODEL_PT_IN_MODEL}",
        dst_path=str(destination),
        tracking_uri=client.tracking_uri,
    )
    return Path(local)


def champion_checkpoint(config: PipelineConfig, destination: str | Path | None = None) -> Path | None:
    """Download the current @champion's ``model.pt`` (for ``train.init_from: champion``); None when there is none."""
    uri = resolve_tracking_uri(config)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    champion = find_alias(client, config.registry.model_name)
    if champion is None:
        return None
    destination = Path(destination or tempfile.mkdtemp(prefix="ddpflow-champion-"))
    return download_version_checkpoint(client, champion, destination)
