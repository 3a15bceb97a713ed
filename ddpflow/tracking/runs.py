"""The pipeline's MLflow run: where tracking goes, the run's lifecycle, its lineage and its evaluation.

    uri = resolve_tracking_uri(config)
    check_tracking_reachable(uri)          # before training wastes an hour
    run_id = start_pipeline_run(config, run_name, prefect_context, fingerprint, manifest, ddp)
    ...
    log_evaluation(uri, run_id, result, metrics_path, model_path, dataset_dir)
    end_pipeline_run(run_id, uri, status="FINISHED")

Every function takes the URI explicitly and uses an ``MlflowClient`` bound to
it, so concurrent tasks never share MLflow's "active run" state. The one
fluent call without a client form (logging the pyfunc model) runs inside
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
import time
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
from mlflow.entities import DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException

from ddpflow.launch.command import LOG_DIR
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from training.checkpoint.identity import training_identity
from training.core.config import PipelineConfig
from training.core.digest import json_digest
from training.core.layout import SPLITS
from training.core.manifest import Manifest
from training.inference.model_file import EvalResult

CONFIG_ARTIFACT = "config.json"  # the run's PipelineConfig, so registration can be re-run later
# The prepared data's manifest (with its per-feature histograms): what a later run measures drift against,
# even once the shards are deleted.
TRAINING_DATA_ARTIFACT = "data/manifest.json"
# A stable hash of training/checkpoint/identity.py's training_identity (the data's fingerprint and the settings that
# change the weights), on the run and on its model version: train.skip_if_unchanged compares it.
TRAINING_IDENTITY_TAG = "ddpflow.training_identity"
WRONG_ROWS_ARTIFACT = "eval/confidently_wrong.json"  # a text classifier's most confidently wrong test rows
MODEL_PATH_TAG = "ddpflow.model_path"  # set with the evaluation: what `ddpflow register --run-id` needs
DATASET_DIR_TAG = "ddpflow.dataset_dir"
RUN_DIR_TAG = "ddpflow.run_dir"  # the run directory (checkpoints and logs), for people
SCRIPT_TAG = "ddpflow.script"  # a training script's run: the script's path (its file: the artifact script/<name>)
SCRIPT_ARTIFACTS = "script"
RESTARTS_TAG = "ddp.restarts"  # beside ddp.nnodes and ddp.world_size
SLURM_JOB_TAG = "slurm.job_id"  # the Slurm job that trained (train.launcher: slurm)
# A resumed run and the interrupted (or failed) run whose run directory and checkpoints it continues.
RESUMED_FROM_TAG = "ddpflow.resumed_from"
RESUMED_BY_TAG = "ddpflow.resumed_by"
# A run whose ranks were preempted (training/loop/preemption.py): "true", and where they saved (the step checkpoint's
# epoch, 0-based as in its name, and step; step 0: last.pt at the end of that many epochs), the signal, the file.
PREEMPTED_TAG = "ddpflow.preempted"
PREEMPTED_PREFIX = "ddpflow.preempted_"


def preempted_tags(record: dict) -> dict[str, str]:
    """The MLflow tags of RUN_DIR/preempted.json's record: ddpflow.preempted=true, ddpflow.preempted_epoch, _step,
    _signal, _checkpoint."""
    fields = ("epoch", "step", "signal", "checkpoint")
    return {PREEMPTED_TAG: "true", **{PREEMPTED_PREFIX + name: str(record.get(name)) for name in fields}}


LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # `mlflow ui --backend-store-uri sqlite:///...` serves here
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
PROJECT_ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger(__name__)


class TrackingUnreachableError(ConnectionError):
    """The MLflow tracking store cannot be used; the message names the URI."""


# ---------------------------------------------------------------- where things go


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
    if "://" in location or location.startswith("mlflow-artifacts:"):
        return location
    return Path(location).resolve().as_uri()


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


# ---------------------------------------------------------------- experiment


def configure_mlflow(config: PipelineConfig, tracking_uri: str | None = None) -> tuple[MlflowClient, str]:
    """A client bound to the store (tracking and registry), and the experiment's id (created if missing)."""
    uri = tracking_uri or resolve_tracking_uri(config)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return client, ensure_experiment(client, config.mlflow.experiment, resolve_artifact_location(config, uri))


@contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API points at ``uri`` inside the block; the environment is restored after.

    MLflow's URI (and ``$MLFLOW_TRACKING_URI``, which setting it writes) is process-wide, and
    registrations can overlap in one process (threads, concurrent task runs). So the state to
    restore is saved by the first block to enter and restored by the last to leave: a block that
    saved another block's URI would otherwise put it back for good, and every later run in this
    process would log into that store.
    """
    global _uri_users, _uri_saved
    with _uri_lock:
        if _uri_users == 0:
            _uri_saved = (os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri())
        _uri_users += 1
        mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        with _uri_lock:
            _uri_users -= 1
            if _uri_users == 0:
                saved_env, previous = _uri_saved
                mlflow.set_tracking_uri(previous)
                if saved_env is None:
                    os.environ.pop("MLFLOW_TRACKING_URI", None)
                else:
                    os.environ["MLFLOW_TRACKING_URI"] = saved_env


_uri_lock = threading.Lock()
_uri_users = 0  # blocks of use_tracking_uri open in this process
_uri_saved: tuple[str | None, str] | None = None  # what the first of them found


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


# ---------------------------------------------------------------- the run's lineage


def git_commit(directory: str | Path | None = None) -> str | None:
    """The commit of the code that runs, when it is a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(directory or PROJECT_ROOT),
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def run_tags(
    prefect_context: dict[str, Any],
    manifest: Manifest | None,
    fingerprint: str | None,
    ddp: dict[str, Any],
    code_dir: str | Path | None = None,
) -> dict[str, str]:
    """The run's tags: its Prefect flow run, its data (none for a training script without a data section), its DDP
    layout and the git commit of ``code_dir`` (default: ddpflow's own; a training script's directory)."""
    tags = {
        "prefect.flow_run_id": prefect_context.get("flow_run_id"),
        "prefect.flow_run_name": prefect_context.get("flow_run_name"),
        "prefect.flow_run_url": prefect_context.get("flow_run_url"),
        "prefect.deployment": prefect_context.get("deployment_name") or prefect_context.get("deployment"),
        "prefect.deployment_id": prefect_context.get("deployment_id"),
        "data.fingerprint": fingerprint,
        "data.source": manifest.source if manifest is not None else None,
        "data.task": manifest.task if manifest is not None else None,
    }
    for key, value in ddp.items():
        tags[f"ddp.{key}"] = value
    if "world_size" not in ddp and isinstance(ddp.get("nproc_per_node"), int):
        tags["ddp.world_size"] = ddp["nproc_per_node"] * int(ddp.get("nnodes", 1))
    commit = git_commit(code_dir)
    if commit:
        tags["git.commit"] = commit
        tags["mlflow.source.git.commit"] = commit  # what the MLflow UI shows
    return {key: str(value) for key, value in tags.items() if value is not None}


def training_identity_tag(config: PipelineConfig, fingerprint: str) -> str:
    """16 hex digits of the training identity: equal exactly when the resume rule calls two trainings the same."""
    return json_digest(training_identity(config, fingerprint))


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
    columns = [ColSpec(DataType.float, name) for name in manifest.features]
    schema = Schema([*columns, ColSpec(label_type, manifest.label)])
    inputs = []
    for split in SPLITS:
        source = _dataset_source(f"{str(dataset_dir).rstrip('/')}/{split}")
        digest = f"{fingerprint[:24]}-{split}"[:36]
        dataset = MetaDataset(source, name=f"{fingerprint[:16]}-{split}", digest=digest, schema=schema)
        tags = [InputTag("mlflow.data.context", split), InputTag("rows", str(manifest.rows(split)))]
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
    return inputs


def _dataset_source(location: str):
    """MLflow's own resolver: a local path, s3://, gs://, ... becomes the matching artifact source."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    with warnings.catch_warnings():  # local paths match two registered sources; either is right
        warnings.simplefilter("ignore")
        return resolve_dataset_source(location)


def _absolute(location: str | Path) -> str:
    """A local path made absolute (a relative one means nothing to someone reading the run); URLs unchanged."""
    return str(location) if "://" in str(location) else str(Path(location).resolve())


# ---------------------------------------------------------------- the run's lifecycle


def start_pipeline_run(
    config: PipelineConfig,
    run_name: str,
    prefect_context: dict[str, Any],
    fingerprint: str | None,
    manifest: Manifest | None,
    ddp: dict[str, Any],
    dataset_dir: str | Path | None = None,
) -> str:
    """Create the MLflow run for one pipeline run; returns its id.

    Params: the flattened config (a training script's: its path, its sha256, its arguments and params among them).
    Tags: Prefect flow run, data fingerprint and source, training identity, git commit, DDP layout. Inputs: the
    train/val/test shards. The config itself is logged as ``config.json`` so ``ddpflow register --run-id`` can
    rebuild it, the manifest as ``data/manifest.json`` (drift is measured against it later), and a training script
    as ``script/<its name>``. ``manifest`` None: a training script without a data section. The run stays RUNNING
    until ``end_pipeline_run``.
    """
    client, experiment_id = configure_mlflow(config)
    script = config.train.script
    tags = run_tags(prefect_context, manifest, fingerprint, ddp, code_dir=Path(script).parent if script else None)
    tags[TRAINING_IDENTITY_TAG] = training_identity_tag(config, fingerprint)
    if script:
        tags[SCRIPT_TAG] = script
    run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    params = [Param(key, str(value)[:6000]) for key, value in config.flat().items()]
    for start in range(0, len(params), 100):  # MLflow accepts at most 100 params per batch
        client.log_batch(run_id, params=params[start : start + 100])
    client.log_dict(run_id, config.model_dump(mode="json"), CONFIG_ARTIFACT)
    if manifest is not None:
        dataset_dir = _absolute(dataset_dir or Path(config.data.root) / fingerprint)
        client.log_inputs(run_id, datasets=dataset_inputs(manifest, dataset_dir, fingerprint))
        client.log_dict(run_id, manifest.to_dict(), TRAINING_DATA_ARTIFACT)
    if script:
        client.log_artifact(run_id, script, SCRIPT_ARTIFACTS)
    return run_id


def log_rank_logs(tracking_uri: str, run_id: str, run_dir: str | Path) -> None:
    """Every rank's stdout and stderr (RUN_DIR/logs, torchrun's per-rank files) as the run's ``logs/`` artifacts;
    never raises (it runs on the way out of failed runs too)."""
    logs = Path(run_dir) / LOG_DIR
    if not logs.is_dir():
        return
    try:
        MlflowClient(tracking_uri=tracking_uri).log_artifacts(run_id, str(logs), LOG_DIR)
    except Exception as error:
        logger.warning("could not log the rank logs of %s to MLflow run %s: %s", run_dir, run_id, error)


def end_pipeline_run(run_id: str, tracking_uri: str, status: str = "FINISHED") -> None:
    """End the run FINISHED or FAILED (or KILLED). Never raises: it runs on error paths."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, not {status!r}")
    try:
        MlflowClient(tracking_uri=tracking_uri).set_terminated(run_id, status=status)
    except Exception as error:
        logger.warning("could not mark MLflow run %s %s in %s: %s", run_id, status, tracking_uri, error)


def tag_run(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` on the run (string values)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def link_resumed_run(tracking_uri: str, earlier_run_id: str, run_id: str) -> None:
    """Tag the two runs with each other (``ddpflow.resumed_from`` / ``ddpflow.resumed_by``): one story in the UI.
    Never raises: an earlier run in another store (or deleted) only gets a warning."""
    try:
        tag_run(tracking_uri, run_id, {RESUMED_FROM_TAG: earlier_run_id})
        tag_run(tracking_uri, earlier_run_id, {RESUMED_BY_TAG: run_id})
    except Exception as error:
        logger.warning("could not link MLflow run %s to the run it resumes, %s: %s", run_id, earlier_run_id, error)


def read_run_config(client: MlflowClient, run_id: str) -> PipelineConfig:
    """The PipelineConfig that ``start_pipeline_run`` logged with the run."""
    with tempfile.TemporaryDirectory() as scratch:
        path = client.download_artifacts(run_id, CONFIG_ARTIFACT, scratch)
        return PipelineConfig.model_validate_json(Path(path).read_text())


# ---------------------------------------------------------------- the evaluation


def log_evaluation(
    tracking_uri: str,
    run_id: str,
    result: EvalResult,
    metrics_path: str | Path,
    model_path: str | Path,
    dataset_dir: str | Path,
    baselines: dict[str, float] | None = None,
) -> None:
    """Test metrics, ``eval/metrics.json``, the figure, and where the model and data are (for re-registration).

    ``baselines``: ``baseline_trivial/<metric>`` and ``baseline_reference/<metric>`` (training/inference/baselines.py),
    logged beside the model's own metrics so the MLflow UI compares them."""
    from ddpflow.tracking.plots import evaluation_figure, misclassified_figure

    client = MlflowClient(tracking_uri=tracking_uri)
    now = int(time.time() * 1000)
    logged = {**result.metrics, **(baselines or {})}
    client.log_batch(run_id, metrics=[Metric(name, value, now, 0) for name, value in logged.items()])
    client.log_artifact(run_id, str(metrics_path), "eval")
    figure, name = evaluation_figure(result)
    client.log_figure(run_id, figure, f"eval/{name}")
    if (grid := misclassified_figure(result)) is not None:
        client.log_figure(run_id, grid, "eval/misclassified.png")
    if result.confidently_wrong is not None:  # a text classifier's most confidently wrong test rows (wrong_rows.py)
        import pandas as pd

        table = pd.DataFrame(result.confidently_wrong["data"], columns=result.confidently_wrong["columns"])
        client.log_table(run_id, data=table, artifact_file=WRONG_ROWS_ARTIFACT)
    client.set_tag(run_id, MODEL_PATH_TAG, _absolute(model_path))
    client.set_tag(run_id, DATASET_DIR_TAG, _absolute(dataset_dir))


# ---------------------------------------------------------------- links for people


def run_url(tracking_uri: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI when the store is an http(s) server, else None."""
    if not is_http(tracking_uri):
        return None
    experiment_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def ui_url(tracking_uri: str, run_id: str) -> str:
    """The run's page: on the tracking server, or where `mlflow ui` serves a local store by default."""
    url = run_url(tracking_uri, run_id)
    if url:
        return url
    experiment_id = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    return f"{LOCAL_MLFLOW_UI}/#/experiments/{experiment_id}/runs/{run_id}"


def how_to_open(tracking_uri: str, run_id: str) -> str:
    """One line for people: the URL, or the run id and the command that opens the UI."""
    url = run_url(tracking_uri, run_id)
    if url:
        return url
    return f"MLflow run {run_id} in {tracking_uri} (open with: mlflow ui --backend-store-uri {tracking_uri})"
