"""What batch scoring asks MLflow: the model a ``score.model`` spec names, as a local model.pt with its name and
version, and the record of a scoring (one MLflow run: model version, source, rows, rows/s, the distribution of
the scores).

    model = scoring_model("churn@champion", tracking_uri, scratch_dir)   # or "churn/3", or "runs/x/model.pt"
    model.path, model.identity()   # a local model.pt; {"name", "version", "uri"}
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ddpflow.tracking.registry import download_version_checkpoint, find_alias
from ddpflow.tracking.served_model import _what_there_is, model_uri


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
    name, alias, version = model_uri(spec)
    database = tracking_uri.removeprefix("sqlite:///") if tracking_uri.startswith("sqlite:///") else None
    if database is not None and not Path(database).is_file():
        raise ValueError(f"no MLflow store at {database} (tracking URI {tracking_uri}) for score.model {spec!r}")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    if alias is not None:
        found = find_alias(client, name, alias)
        if found is None:
            raise ValueError(f"{name!r} has no @{alias} in {tracking_uri}{_what_there_is(client, name)}")
        uri = f"models:/{name}@{alias}"
    else:
        try:
            found = client.get_model_version(name, version)
        except MlflowException:
            raise ValueError(
                f"{name!r} has no version {version} in {tracking_uri}{_what_there_is(client, name)}"
            ) from None
        uri = f"models:/{name}/{version}"
    path = download_version_checkpoint(client, found, Path(destination) / f"{name}-v{found.version}")
    return ScoringModel(path, name, str(found.version), uri)
