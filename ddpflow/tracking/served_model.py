"""What `ddpflow serve` asks the registry: which version NAME[@alias|/version] is, and one row of its example.

    model = served_model("churn@champion", tracking_uri)
    model.uri          # "models:/churn@champion": what `mlflow models serve -m` takes
    model.version      # "3"
    model.example      # {"dataframe_split": {"columns": [...], "data": [[...]]}}: one row of its own example

The example row is the model's own ``serving_input_example.json`` (logged with the model,
training/inference/serving.py), cut to its first row: a body `/invocations` accepts as it is.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ddpflow.tracking.registry import CHAMPION, find_alias

SERVING_EXAMPLE = "serving_input_example.json"  # what MLflow writes beside a logged model's MLmodel


@dataclass(frozen=True)
class ServedModel:
    name: str
    version: str
    uri: str
    example: dict[str, Any] | None  # an /invocations body with one row; None: the model was logged without one


def model_uri(spec: str) -> tuple[str, str | None, str | None]:
    """``NAME`` (its @champion), ``NAME@alias`` or ``NAME/version`` -> (name, alias, version); ValueError else."""
    name, at, alias = spec.partition("@")
    version = None
    if not at and "/" in spec:
        name, _, version = spec.rpartition("/")
        if not version.isdigit():
            raise ValueError(f"model {spec!r}: after the / comes a version number (NAME/3), not {version!r}")
    if not name or (at and not alias):
        raise ValueError(f"model {spec!r}: give NAME, NAME@alias or NAME/version")
    return name, (alias or (None if version else CHAMPION)), version


def served_model(spec: str, tracking_uri: str) -> ServedModel:
    """The registered version ``spec`` names, checked to exist in ``tracking_uri``; ValueError naming what is not
    there (the model, its alias or version), with the versions and aliases that are."""
    client, found, uri = registered_version(spec, tracking_uri, "; give --tracking-uri")
    return ServedModel(found.name, str(found.version), uri, _example_row(client, found))


def _what_there_is(client: MlflowClient, name: str) -> str:
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        return " (no registered model of that name)"
    versions = sorted(int(version.version) for version in client.search_model_versions(f"name = '{name}'"))
    aliases = ", ".join(f"@{alias} (v{version})" for alias, version in sorted(model.aliases.items()))
    return f"; its versions: {versions or 'none'}" + (f"; its aliases: {aliases}" if aliases else "")


def _example_row(client: MlflowClient, version) -> dict[str, Any] | None:
    """The first row of the version's own serving input example, as an /invocations body."""
    import mlflow

    source = client.get_model_version_download_uri(version.name, version.version)
    with tempfile.TemporaryDirectory(prefix="ddpflow-serve-") as scratch:
        try:
            where = f"{source.rstrip('/')}/{SERVING_EXAMPLE}"
            path = mlflow.artifacts.download_artifacts(where, dst_path=scratch, tracking_uri=client.tracking_uri)
        except (MlflowException, OSError):
            return None
        body = json.loads(Path(path).read_text())
    split = body.get("dataframe_split")
    if isinstance(split, dict) and split.get("data"):
        return {**body, "dataframe_split": {**split, "data": split["data"][:1]}}
    records = body.get("dataframe_records")
    if isinstance(records, list) and records:
        return {**body, "dataframe_records": records[:1]}
    tensors = body.get("inputs")  # a training script's exported model: a tensor, or named tensors
    if isinstance(tensors, list) and tensors:
        return {**body, "inputs": tensors[:1]}
    if isinstance(tensors, dict):
        return {
            **body,
            "inputs": {name: value[:1] if isinstance(value, list) else value for name, value in tensors.items()},
        }
    return body


def registered_version(spec: str, tracking_uri: str, store_hint: str = ""):
    """(client, the ModelVersion ``spec`` names, its ``models:/`` URI) in ``tracking_uri``; ValueError naming what
    is not there (the store, the model, its alias or version), with the versions and aliases that are.
    ``store_hint`` ends the message of a missing SQLite store (what to give instead)."""
    name, alias, version = model_uri(spec)
    database = tracking_uri.removeprefix("sqlite:///") if tracking_uri.startswith("sqlite:///") else None
    if database is not None and not Path(database).is_file():  # MLflow would create an empty store there
        raise ValueError(f"no MLflow store at {database} (tracking URI {tracking_uri}){store_hint}")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    if alias is not None:
        found = find_alias(client, name, alias)
        if found is None:
            raise ValueError(f"{name!r} has no @{alias} in {tracking_uri}{_what_there_is(client, name)}")
        return client, found, f"models:/{name}@{alias}"
    try:
        found = client.get_model_version(name, version)
    except MlflowException:
        raise ValueError(f"{name!r} has no version {version} in {tracking_uri}{_what_there_is(client, name)}") from None
    return client, found, f"models:/{name}/{version}"
