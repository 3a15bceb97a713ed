"""Shared fixtures for the flow tests: one real SQLite MLflow store per session, tiny synthetic data, 2 gloo
ranks (the session's Prefect harness is tests/conftest.py's). Here ``make_config`` is a whole pipeline's config
dict; it stands in for tests/source_tables.py's DataConfig fixture of the same name."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

# 4k rows x 8 features: torchrun start-up dominates, not the training.
TINY_SOURCE = "synthetic://classification?rows=4000&features=8&classes=3&seed=0"
TINY_EPOCHS = 2


@pytest.fixture(scope="session")
def flow_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("flow")


@pytest.fixture(scope="session")
def tracking_uri(flow_home: Path) -> str:
    """One real MLflow SQLite store for the session; tests isolate themselves by model name."""
    return f"sqlite:///{flow_home / 'mlflow.db'}"


@pytest.fixture(scope="session")
def make_config(flow_home: Path, tracking_uri: str):
    """``make_config(**overrides)`` -> a config dict for a tiny 2-rank run.

    Overrides are dotted keys: ``make_config(**{"train.epochs": 3})``.
    Each call gets its own run root, model name and experiment, so tests do not
    see each other's champions, runs or resumable run dirs; the shard cache is shared.
    """

    def build(**overrides: Any) -> dict[str, Any]:
        unique = uuid.uuid4().hex[:8]
        raw: dict[str, Any] = {
            "data": {"source": TINY_SOURCE, "root": str(flow_home / "shards")},
            "train": {
                "epochs": TINY_EPOCHS,
                "batch_size": 128,
                "lr": 0.01,
                "nproc_per_node": 2,
                "backend": "gloo",
                "model_kwargs": {"hidden": [32]},
                "run_root": str(flow_home / f"runs-{unique}"),
                "max_restarts": 0,
                "timeout_s": 300,
                "collective_timeout_s": 60,
                "progress_interval_s": 1.0,
            },
            "eval": {"batch_size": 4096},
            "registry": {"model_name": f"tiny-{unique}"},
            "mlflow": {
                "tracking_uri": tracking_uri,
                "experiment": f"flow-tests-{unique}",
                "artifact_location": (flow_home / "mlartifacts").as_uri(),
            },
        }
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            raw[section][key] = value
        return raw

    return build
