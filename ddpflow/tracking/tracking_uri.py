"""Which MLflow store a command, a flow or a scoring uses, read from the environment and the config alone (no MLflow
import: `ddpflow score` of a model.pt decides this before its ranks start, and MLflow's import is a second of CPU).

    uri = resolve_tracking_uri(config)   # $MLFLOW_TRACKING_URI, else mlflow.tracking_uri, else ./mlflow.db
    note = tracking_uri_note(config)     # one line when the two name different stores, else None
"""

from __future__ import annotations

import os
from pathlib import Path

from training.core.config import PipelineConfig


def resolve_tracking_uri(config: PipelineConfig) -> str:
    """``$MLFLOW_TRACKING_URI``, else ``mlflow.tracking_uri``, else ``sqlite:///<cwd>/mlflow.db``.

    A relative SQLite path is made absolute now, so every task and rank (with
    other working directories) writes to the same database.
    """
    default = f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    uri = _absolute_sqlite(os.environ.get("MLFLOW_TRACKING_URI") or config.mlflow.tracking_uri or default)
    if "://" not in uri and not uri.startswith("databricks"):  # a bare path: MLflow 3's file store is deprecated
        raise ValueError(
            f"mlflow.tracking_uri {uri!r} is a plain path; use sqlite:///{Path(uri).resolve()}.db "
            "or an http(s):// server"
        )
    return uri


def tracking_uri_note(config: PipelineConfig) -> str | None:
    """Which store a command uses, when ``$MLFLOW_TRACKING_URI`` and ``mlflow.tracking_uri`` name two different
    ones (the variable wins: ``resolve_tracking_uri``); None when they agree or one is unset."""
    configured, environment = config.mlflow.tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    if not configured or not environment or _absolute_sqlite(configured) == _absolute_sqlite(environment):
        return None
    return (
        f"MLflow store {resolve_tracking_uri(config)} from $MLFLOW_TRACKING_URI, which wins over the config's "
        f"mlflow.tracking_uri {configured}"
    )


def _absolute_sqlite(uri: str) -> str:
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        relative = uri.removeprefix("sqlite:///")
        if relative and relative != ":memory:":
            return f"sqlite:///{Path(relative).resolve()}"
    return uri
