"""The MLflow model registry: versions, aliases, the champion's files, idempotency look-ups, transient errors.

Plain MLflow I/O for the gate (ddpflow/tracking/registration.py); the gate's
rules are in ddpflow/tracking/gate.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from ddpflow.tracking.runs import SCRIPT_TAG, TRAINING_IDENTITY_TAG
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from training.core.config import PipelineConfig
from training.core.layout import SCRIPT_EXAMPLE
from training.core.manifest import Manifest

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"
MODEL_PT_IN_MODEL = "artifacts/model.pt"  # where training/inference/serving.py's artifact lands in a logged model
RUN_ID_TAG = "ddpflow.run_id"  # on the logged model and the version: which MLflow run made it
LINEAGE_RUN_TAGS = (
    SCRIPT_TAG,  # a training script's model: its path
    "data.fingerprint",
    "data.source",
    "data.task",
    "prefect.flow_run_id",
    "prefect.flow_run_name",
    "prefect.deployment",
    "git.commit",
    "ddp.world_size",
    TRAINING_IDENTITY_TAG,  # train.skip_if_unchanged compares the champion's with the next run's
)
# MLflow error codes worth retrying: the server or database is busy or restarting.
TRANSIENT_MLFLOW_CODES = {
    "TEMPORARILY_UNAVAILABLE",
    "INTERNAL_ERROR",
    "REQUEST_LIMIT_EXCEEDED",
    "DEADLINE_EXCEEDED",
    "ABORTED",
}
NOT_FOUND_CODES = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


class RegistrationError(ValueError):
    """Registration cannot succeed as asked (missing metric, unknown run): retrying will not help."""


class RegistryUnavailable(RuntimeError):
    """The tracking store failed in a way worth retrying (down, busy); the message says how to finish later."""


class ChampionDownloadError(RuntimeError):
    """The @champion version exists, but its model.pt could not be fetched; the message names the version."""


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


# ---------------------------------------------------------------- aliases


def find_alias(client: MlflowClient, model_name: str, alias: str = CHAMPION) -> ModelVersion | None:
    """The version behind ``alias``; None only when the alias (or the whole model) does not exist.

    Every other error is raised: a registry that cannot answer must never look
    like "no champion yet", which would let any candidate through.
    """
    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException as error:
        if _alias_missing(error):
            return None
        raise


def _alias_missing(error: MlflowException) -> bool:
    # The SQL store and the REST API answer a missing model with RESOURCE_DOES_NOT_EXIST, and a
    # missing alias of an existing model with INVALID_PARAMETER_VALUE "... alias champion not found."
    # Anything else (a version row gone, a bad name, a refused request) is not "no champion".
    text = str(error).lower()
    if error.error_code in NOT_FOUND_CODES:
        return "registered model" in text or "alias" in text
    return error.error_code == "INVALID_PARAMETER_VALUE" and "alias" in text and "not found" in text


def promote(client: MlflowClient, model_name: str, version: str, previous: str | None) -> None:
    """@previous-champion to the old champion, then @champion: the move of @champion is the last write."""
    if previous and previous != str(version):
        client.set_registered_model_alias(model_name, PREVIOUS_CHAMPION, previous)
    client.set_registered_model_alias(model_name, CHAMPION, str(version))


def mark_challenger(client: MlflowClient, model_name: str, version: str) -> None:
    client.set_registered_model_alias(model_name, CHALLENGER, str(version))


def set_version_tags(client: MlflowClient, model_name: str, version: str, tags: dict[str, str]) -> None:
    for key, value in tags.items():  # in order: callers put the tag that marks completion last
        client.set_model_version_tag(model_name, str(version), key, value)


# ---------------------------------------------------------------- the champion's files


def version_download_uri(client: MlflowClient, version: ModelVersion) -> str:
    """Where a version's model.pt lives in the artifact store (for messages and downloads)."""
    model_uri = client.get_model_version_download_uri(version.name, version.version)
    return f"{model_uri.rstrip('/')}/{MODEL_PT_IN_MODEL}"


def download_version_checkpoint(client: MlflowClient, version: ModelVersion, destination: str | Path) -> Path:
    """The ``model.pt`` inside a registered version's logged model."""
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=version_download_uri(client, version),
        dst_path=str(destination),
        tracking_uri=client.tracking_uri,
    )
    return Path(local)


def champion_checkpoint(config: PipelineConfig, destination: str | Path | None = None) -> Path | None:
    """Download the current @champion's ``model.pt`` (for ``train.init_from: champion``); None when there is none.

    Raises ``ChampionDownloadError`` (naming the version) when the champion exists but its files cannot be
    fetched, so a warm start never silently becomes a fresh one.
    """
    uri = resolve_tracking_uri(config)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    champion = find_alias(client, config.registry.model_name)
    if champion is None:
        return None
    destination = Path(destination or tempfile.mkdtemp(prefix="ddpflow-champion-"))
    try:
        return download_version_checkpoint(client, champion, destination)
    except Exception as error:
        if is_transient(error):
            raise
        raise ChampionDownloadError(
            f"train.init_from=champion: {config.registry.model_name} champion v{champion.version}'s model.pt "
            f"could not be downloaded ({first_line(error)})"
        ) from error


# ---------------------------------------------------------------- versions


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
    """The first rows of the first test shard: raw input columns, as users send them."""
    first_shard = manifest.split_files(dataset_dir, "test")[0]
    batch = next(pq.ParquetFile(first_shard).iter_batches(batch_size=rows, columns=manifest.input_names()))
    return batch.to_pandas()


def version_description(
    config: PipelineConfig,
    manifest: Manifest | None,
    run_tags: dict[str, str],
    run_id: str,
    scored_as: str | None = None,
) -> str:
    """The version's description; ``scored_as``: what its evaluation is (the objective's, else the data's task).
    A training script's model: the script and its data (``manifest`` None: none of ddpflow's)."""
    train = config.train
    where = f"MLflow run {run_id}; Prefect flow run {run_tags.get('prefect.flow_run_name', '?')}."
    world = f"world size {run_tags.get('ddp.world_size', '?')}"
    if train.script:
        data = "" if manifest is None else f" on {manifest.source} (fingerprint {manifest.fingerprint})"
        task = scored_as or (manifest.task if manifest is not None else "")
        return (
            f"{task} model of the training script {train.script} (sha256 {str(train.script_sha256)[:16]}, "
            f"arguments {train.script_args} {train.script_params or ''}){data}, {world}. {where}"
        ).replace("  ", " ")
    global_batch = train.global_batch_size
    batch = f"batch {train.batch_size}/rank" if global_batch is None else f"global batch {global_batch}"
    rows = f"{manifest.rows('train')} train / {manifest.rows('val')} val / {manifest.rows('test')} test rows"
    return (
        f"{scored_as or manifest.task} model '{train.model}' {train.model_kwargs or ''} "
        f"trained on {manifest.source} "
        f"(fingerprint {manifest.fingerprint}: {rows}, {manifest.n_features} features). "
        f"{train.epochs} epochs, {batch}, lr {train.lr}, {world}. {where}"
    )


def register_version(
    client: MlflowClient,
    config: PipelineConfig,
    experiment_id: str,
    run_id: str,
    model_path: str,
    manifest: Manifest,
    dataset_dir: str,
    scored_as: str | None = None,
) -> ModelVersion:
    """Log the pyfunc model (unless an earlier attempt did) and create the registry version (``scored_as``: what
    its evaluation is, for the description).

    Uses MLflow's process-wide tracking URI: call inside ``runs.use_tracking_uri``.
    """
    from training.inference.serving import log_pyfunc_model

    model_uri = existing_logged_model(client, experiment_id, run_id)
    if model_uri is None:
        example = input_example(manifest, dataset_dir)
        model_uri = log_pyfunc_model(model_path, example, run_id=run_id, tags={RUN_ID_TAG: run_id}).model_uri
    description = version_description(config, manifest, client.get_run(run_id).data.tags, run_id, scored_as)
    return _create_version(client, config, run_id, model_uri, model_path, description)


def register_program_version(
    client: MlflowClient, config: PipelineConfig, experiment_id: str, run_id: str, program_path: str
) -> ModelVersion:
    """A training script's exported program (no data section) as a pyfunc model (unless an earlier attempt logged
    it) and its registry version. Inside ``runs.use_tracking_uri``, as ``register_version``."""
    from training.inference.program_serving import log_program_model

    model_uri = existing_logged_model(client, experiment_id, run_id)
    if model_uri is None:
        example = Path(program_path).parent / Path(SCRIPT_EXAMPLE).name  # beside it (training/core/layout.py)
        model_uri = log_program_model(program_path, example, run_id=run_id, tags={RUN_ID_TAG: run_id}).model_uri
    description = version_description(config, None, client.get_run(run_id).data.tags, run_id)
    return _create_version(client, config, run_id, model_uri, program_path, description)


def _create_version(
    client: MlflowClient, config: PipelineConfig, run_id: str, model_uri: str, model_path: str, description: str
) -> ModelVersion:
    """The registered model (created if new) and its version of ``model_uri``, with the run's lineage tags."""
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
        description=description,
    )


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``, short enough for a log line or a tag."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:500]
