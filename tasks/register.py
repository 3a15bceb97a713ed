"""Register the candidate model behind a champion gate.

Decisions (``decision`` in the returned dict, the version's tags and the run's tags):
- ``rejected``: a metric is NaN/inf, or the gate metric misses
  ``registry.min_metric``. Nothing is logged to the registry.
- ``promoted``: no champion yet; or the candidate beats the champion, both
  scored on the SAME test shards, by more than ``registry.min_delta``; or the
  champion cannot score this data (other features/task/classes:
  ``champion_status = incompatible``). Alias ``champion`` moves to the
  candidate, ``previous-champion`` to the old one.
- ``challenger``: the champion stays; the candidate gets alias ``challenger``.

Idempotent per MLflow run: a retry (or ``ddpflow register --run-id``) finds
the version already registered for the run (tag ``ddpflow.run_id``) and
returns the recorded decision; it never creates a second version.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.tracking import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    configure_mlflow,
    download_version_checkpoint,
    find_alias,
    read_run_config,
    resolve_tracking_uri,
    use_tracking_uri,
)
from training.config import PipelineConfig
from training.data.manifest import Manifest, read_manifest
from training.evaluate import IncompatibleModelError, evaluate_split

RUN_ID_TAG = "ddpflow.run_id"
DECISION_TAG = "gate.decision"  # written last: its presence means the gate finished for this version
LINEAGE_RUN_TAGS = (
    "data.fingerprint",
    "data.source",
    "data.task",
    "prefect.flow_run_id",
    "prefect.flow_run_name",
    "prefect.deployment",
    "git.commit",
    "ddp.world_size",
)
# MLflow error codes worth retrying: the server or database is busy or restarting.
TRANSIENT_MLFLOW_CODES = {
    "TEMPORARILY_UNAVAILABLE",
    "INTERNAL_ERROR",
    "REQUEST_LIMIT_EXCEEDED",
    "DEADLINE_EXCEEDED",
    "ABORTED",
}

_logger = logging.getLogger("ddpflow.register")


class RegistrationError(ValueError):
    """Registration cannot succeed as asked (missing metric, unknown run): retrying will not help."""


class RegistryUnavailable(RuntimeError):
    """The tracking store failed in a way worth retrying (down, busy); the message says how to finish later."""


# ---------------------------------------------------------------- the gate's rules


def is_better(candidate: float, champion: float, higher_is_better: bool, min_delta: float) -> bool:
    return candidate > champion + min_delta if higher_is_better else candidate < champion - min_delta


def rejection_reason(
    metrics: dict[str, float], metric: str, higher_is_better: bool, min_metric: float | None
) -> str | None:
    """Why the candidate may not be registered at all, or None."""
    invalid = sorted(name for name, value in metrics.items() if not math.isfinite(float(value)))
    if invalid:
        return f"metrics {invalid} are NaN or infinite"
    if min_metric is not None:
        value = metrics[metric]
        if (value < min_metric) if higher_is_better else (value > min_metric):
            return f"{metric}={value:.6g} misses registry.min_metric={min_metric:.6g} ({'higher' if higher_is_better else 'lower'} is better)"
    return None


# ---------------------------------------------------------------- registry look-ups


def find_version_for_run(client: MlflowClient, model_name: str, run_id: str) -> ModelVersion | None:
    """The version an earlier attempt registered for this run, if any."""
    try:
        versions = client.search_model_versions(f"name = '{model_name}' and tags.`{RUN_ID_TAG}` = '{run_id}'")
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return min(versions, key=lambda version: int(version.version)) if versions else None


def existing_logged_model(client: MlflowClient, experiment_id: str, run_id: str) -> str | None:
    """A model an earlier attempt already logged for this run (its model URI), so a retry does not log twice."""
    models = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    ready = [model for model in models if model.tags.get(RUN_ID_TAG) == run_id and str(model.status).endswith("READY")]
    return f"models:/{ready[0].model_id}" if ready else None


def input_example(manifest: Manifest, dataset_dir: str | Path, rows: int = 5):
    """The first rows of the first test shard: raw feature columns, as users send them."""
    first_shard = manifest.split_files(dataset_dir, "test")[0]
    batch = next(pq.ParquetFile(first_shard).iter_batches(batch_size=rows, columns=list(manifest.features)))
    return batch.to_pandas()


def version_description(config: PipelineConfig, manifest: Manifest, run_tags: dict[str, str], run_id: str) -> str:
    train = config.train
    return (
        f"{manifest.task} model '{train.model}' {train.model_kwargs or ''} trained on {manifest.source} "
        f"(fingerprint {manifest.fingerprint}: {manifest.rows('train')} train / {manifest.rows('val')} val / {manifest.rows('test')} test rows, "
        f"{manifest.n_features} features). {train.epochs} epochs, batch {train.batch_size}/rank, lr {train.lr}, "
        f"world size {run_tags.get('ddp.world_size', '?')}. MLflow run {run_id}; Prefect flow run {run_tags.get('prefect.flow_run_name', '?')}."
    )


def register_version(
    client: MlflowClient,
    config: PipelineConfig,
    experiment_id: str,
    run_id: str,
    model_path: str,
    manifest: Manifest,
    dataset_dir: str,
) -> ModelVersion:
    """Log the pyfunc model (unless an earlier attempt did) and create the registry version."""
    from training.serving import log_pyfunc_model

    model_uri = existing_logged_model(client, experiment_id, run_id)
    if model_uri is None:
        model_uri = log_pyfunc_model(
            model_path, input_example(manifest, dataset_dir), run_id=run_id, tags={RUN_ID_TAG: run_id}
        ).model_uri
    name = config.registry.model_name
    try:
        client.create_registered_model(
            name, description="ddpflow: retrained on a schedule; aliases champion / challenger / previous-champion"
        )
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run_tags = client.get_run(run_id).data.tags
    lineage = {key: run_tags[key] for key in LINEAGE_RUN_TAGS if key in run_tags}
    return client.create_model_version(
        name,
        source=model_uri,
        run_id=run_id,
        model_id=model_uri.removeprefix("models:/"),
        tags={RUN_ID_TAG: run_id, "model_path": str(model_path), **lineage},
        description=version_description(config, manifest, run_tags, run_id),
    )


# ---------------------------------------------------------------- scoring the champion


def score_champion(
    client: MlflowClient, champion: ModelVersion, dataset_dir: str, metric: str, batch_size: int
) -> tuple[float | None, str]:
    """(the champion's gate metric on these test shards, status): status 'scored' or 'incompatible: why'."""
    with tempfile.TemporaryDirectory(prefix="ddpflow-champion-") as scratch:
        try:
            checkpoint = download_version_checkpoint(client, champion, scratch)
        except (MlflowException, OSError) as error:
            if isinstance(error, MlflowException) and error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
                raise
            return None, f"incompatible: champion v{champion.version} has no model.pt ({error})"
        try:
            result = evaluate_split(checkpoint, dataset_dir, "test", batch_size)
        except IncompatibleModelError as error:
            return None, f"incompatible: {error}"
    if metric not in result.metrics:
        return None, f"incompatible: the champion's evaluation has no {metric}"
    return result.metrics[metric], "scored"


# ---------------------------------------------------------------- recording


def _tag_values(values: dict[str, Any]) -> dict[str, str]:
    return {
        key: "" if value is None else (f"{value:.10g}" if isinstance(value, float) else str(value))
        for key, value in values.items()
    }


def record_on_run(client: MlflowClient, run_id: str, decision: dict[str, Any]) -> None:
    tags = _tag_values(
        {
            f"registry.{key}": decision.get(key)
            for key in (
                "decision",
                "reason",
                "model_name",
                "version",
                "metric",
                "candidate_value",
                "champion_value",
                "champion_version",
                "champion_status",
            )
        }
    )
    for key, value in tags.items():
        client.set_tag(run_id, key, value[:5000])
    now = int(time.time() * 1000)
    metrics = (
        [Metric(f"gate_candidate_{decision['metric']}", decision["candidate_value"], now, 0)]
        if _finite(decision.get("candidate_value"))
        else []
    )
    if _finite(decision.get("champion_value")):
        metrics.append(Metric(f"gate_champion_{decision['metric']}", decision["champion_value"], now, 0))
    if metrics:
        client.log_batch(run_id, metrics=metrics)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def decision_from_version(version: ModelVersion, model_name: str, run_id: str) -> dict[str, Any]:
    tags = version.tags

    def number(key: str) -> float | None:
        return float(tags[key]) if tags.get(key) else None

    return {
        "decision": tags[DECISION_TAG],
        "reason": tags.get("gate.reason", ""),
        "model_name": model_name,
        "version": str(version.version),
        "metric": tags.get("gate.metric"),
        "greater_is_better": tags.get("gate.greater_is_better") == "True",
        "candidate_value": number("gate.candidate_value"),
        "champion_value": number("gate.champion_value"),
        "champion_version": tags.get("gate.champion_version") or None,
        "champion_status": tags.get("gate.champion_status"),
        "run_id": run_id,
        "model_uri": f"models:/{model_name}/{version.version}",
        "already_registered": True,
    }


# ---------------------------------------------------------------- the whole step


def register_candidate(
    config: PipelineConfig,
    run_id: str,
    model_path: str,
    dataset_dir: str,
    metrics: dict[str, float],
    tracking_uri: str,
    logger: Any = None,
) -> dict[str, Any]:
    """Register the run's model and apply the champion gate; returns the decision dict."""
    # The registry resolves a version's source (models:/<id>) through MLflow's
    # process-wide tracking URI, so point it at this store for the whole step.
    with use_tracking_uri(tracking_uri):
        try:
            return _register_candidate(
                config, run_id, model_path, dataset_dir, metrics, tracking_uri, logger or _logger
            )
        except Exception as error:
            if isinstance(error, RegistryUnavailable) or not is_transient(error):
                raise
            # MLflow's own text names an endpoint URL deep in a connection-pool message; say what it
            # means for this run, and that nothing is lost: the step is idempotent and can be re-run.
            raise RegistryUnavailable(
                f"registering MLflow run {run_id} failed: the tracking store {tracking_uri} is unavailable "
                f"({_first_line(error)}). {model_path} and its eval/metrics.json are kept; once the store is back, "
                f"finish with: MLFLOW_TRACKING_URI={tracking_uri} ddpflow register --run-id {run_id}"
            ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _register_candidate(
    config: PipelineConfig,
    run_id: str,
    model_path: str,
    dataset_dir: str,
    metrics: dict[str, float],
    tracking_uri: str,
    logger: Any,
) -> dict[str, Any]:
    client, experiment_id = configure_mlflow(config, tracking_uri)
    name = config.registry.model_name
    manifest = read_manifest(dataset_dir)
    metric = config.registry.gate_metric(manifest.task)
    higher = config.registry.higher_is_better(manifest.task)
    if metric not in metrics:
        raise RegistrationError(f"registry.metric {metric!r} is not among the evaluated metrics {sorted(metrics)}")

    version = find_version_for_run(client, name, run_id)
    if version is not None and version.tags.get(DECISION_TAG):
        decision = decision_from_version(version, name, run_id)
        logger.info(
            "MLflow run %s is already registered as %s v%s (%s); nothing to do",
            run_id,
            name,
            version.version,
            decision["decision"],
        )
        return decision

    decision: dict[str, Any] = {
        "decision": None, "reason": "", "model_name": name, "version": None, "metric": metric, "greater_is_better": higher,
        "candidate_value": float(metrics[metric]), "champion_value": None, "champion_version": None, "champion_status": None,
        "run_id": run_id, "model_uri": None, "already_registered": False,
    }  # fmt: skip
    rejection = rejection_reason(metrics, metric, higher, config.registry.min_metric)
    if rejection:
        decision.update(decision="rejected", reason=rejection)
        record_on_run(client, run_id, decision)
        logger.warning("Not registering run %s: %s", run_id, rejection)
        return decision

    if version is None:
        version = register_version(client, config, experiment_id, run_id, model_path, manifest, dataset_dir)
    decision.update(version=str(version.version), model_uri=f"models:/{name}/{version.version}")
    _decide(client, decision, version, dataset_dir, higher, config)
    _apply(client, decision, version)
    record_on_run(client, run_id, decision)
    log = logger.info if decision["decision"] == "promoted" else logger.warning
    log("%s v%s: %s (%s)", name, version.version, decision["decision"], decision["reason"])
    return decision


def _decide(
    client: MlflowClient,
    decision: dict[str, Any],
    version: ModelVersion,
    dataset_dir: str,
    higher: bool,
    config: PipelineConfig,
) -> None:
    name, metric = decision["model_name"], decision["metric"]
    candidate = decision["candidate_value"]
    champion = find_alias(client, name, CHAMPION)
    if champion is not None and str(champion.version) == str(version.version):
        # An earlier attempt moved the alias, then failed before recording: keep what it measured.
        recorded = version.tags
        decision.update(
            decision="promoted",
            reason=recorded.get("gate.reason") or "promoted by an earlier attempt",
            champion_version=recorded.get("gate.champion_version") or None,
            champion_value=float(recorded["gate.champion_value"]) if recorded.get("gate.champion_value") else None,
            champion_status=recorded.get("gate.champion_status"),
        )
        return
    if champion is None:
        decision.update(
            decision="promoted",
            champion_status="none",
            reason=f"first model: no {CHAMPION} yet ({metric}={candidate:.6g})",
        )
        return
    value, status = score_champion(client, champion, dataset_dir, metric, config.eval.batch_size)
    decision.update(champion_version=str(champion.version), champion_value=value, champion_status=status)
    if value is None:
        decision.update(
            decision="promoted", reason=f"champion v{champion.version} is {status}; the candidate replaces it"
        )
    elif not math.isfinite(value):
        decision.update(
            decision="promoted", reason=f"champion v{champion.version} scores {metric}={value} on this data"
        )
    elif is_better(candidate, value, higher, config.registry.min_delta):
        decision.update(
            decision="promoted",
            reason=f"{metric} {candidate:.6g} beats champion v{champion.version}'s {value:.6g} by more than {config.registry.min_delta:g}",
        )
    else:
        decision.update(
            decision="challenger",
            reason=f"{metric} {candidate:.6g} does not beat champion v{champion.version}'s {value:.6g} by more than {config.registry.min_delta:g}",
        )


def _apply(client: MlflowClient, decision: dict[str, Any], version: ModelVersion) -> None:
    """Numbers first, then aliases, then the decision tag: a crash in between is finished by a retry."""
    name = decision["model_name"]
    numbers = {
        "gate.metric": decision["metric"],
        "gate.greater_is_better": decision["greater_is_better"],
        "gate.candidate_value": decision["candidate_value"],
        "gate.champion_value": decision["champion_value"],
        "gate.champion_version": decision["champion_version"],
        "gate.champion_status": decision["champion_status"],
        "gate.reason": decision["reason"],
    }
    for key, value in _tag_values(numbers).items():
        client.set_model_version_tag(name, version.version, key, value[:5000])
    if decision["decision"] == "promoted":
        if decision["champion_version"] and decision["champion_version"] != str(version.version):
            client.set_registered_model_alias(name, PREVIOUS_CHAMPION, decision["champion_version"])
        client.set_registered_model_alias(name, CHAMPION, version.version)
    else:
        client.set_registered_model_alias(name, CHALLENGER, version.version)
    client.set_model_version_tag(name, version.version, DECISION_TAG, decision["decision"])


# ---------------------------------------------------------------- re-running for a finished run


def register_run(
    run_id: str, config: PipelineConfig | None = None, tracking_uri: str | None = None, logger: Any = None
) -> dict[str, Any]:
    """``ddpflow register --run-id``: the gate for a run that was already evaluated.

    The model path, dataset and test metrics come from the run (tags
    ``ddpflow.model_path`` / ``ddpflow.dataset_dir`` set by the evaluate
    task); the config is the run's own unless one is given.
    """
    uri = tracking_uri or resolve_tracking_uri(config or PipelineConfig())
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
            raise RegistrationError(f"MLflow run {run_id!r} does not exist in {uri}") from None
        raise
    tags = run.data.tags
    if "ddpflow.model_path" not in tags or "ddpflow.dataset_dir" not in tags:
        raise RegistrationError(
            f"MLflow run {run_id} was never evaluated (no ddpflow.model_path / ddpflow.dataset_dir tags); run the pipeline first"
        )
    config = config or read_run_config(client, run_id)
    metrics = {name: value for name, value in run.data.metrics.items() if name.startswith("test_")}
    return register_candidate(
        config, run_id, tags["ddpflow.model_path"], tags["ddpflow.dataset_dir"], metrics, uri, logger
    )


# ---------------------------------------------------------------- the Prefect task


def is_transient(error: BaseException | None) -> bool:
    """Worth retrying: the tracking server or its database was busy or briefly away."""
    if error is None:
        return False
    if isinstance(error, RegistryUnavailable):
        return True
    if isinstance(error, MlflowException):
        return error.error_code in TRANSIENT_MLFLOW_CODES or "database is locked" in str(error)
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    try:
        import requests

        if isinstance(error, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:
        pass
    return "database is locked" in str(error)


def retry_on_transient_error(task_, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry MLflow hiccups, not deterministic errors."""
    try:
        error = state.result(raise_on_failure=False)
    except BaseException as raised:
        error = raised
    return is_transient(error if isinstance(error, BaseException) else None)


# NO_CACHE: a side effect, never to be skipped by a cache hit; retries are safe because the step is idempotent.
@task(
    name="register-model",
    task_run_name="register-{run_id}",
    retries=3,
    retry_delay_seconds=[2, 5, 15],
    retry_condition_fn=retry_on_transient_error,
    cache_policy=NO_CACHE,
)
def register_model(
    config: PipelineConfig, run_id: str, model_path: str, dataset_dir: str, metrics: dict[str, float], tracking_uri: str
) -> dict[str, Any]:
    """Register the candidate and apply the champion gate (see the module docstring)."""
    return register_candidate(config, run_id, model_path, dataset_dir, metrics, tracking_uri, get_run_logger())
