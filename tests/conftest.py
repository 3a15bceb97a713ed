"""Suite-wide settings: every store lives in a temp dir, nothing in ~ or the repo."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Set before any test module imports Prefect or MLflow.
_SUITE_HOME = Path(tempfile.mkdtemp(prefix="ddpflow-tests-"))
os.environ["PREFECT_HOME"] = str(_SUITE_HOME / "prefect")  # even under `make`, which exports the project's
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.5")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("PREFECT_API_URL", None)

REPO_ROOT = Path(__file__).resolve().parents[1]

# devtools/ and bench/ are not installed: tests import them from the repository root, however pytest was started.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# The suite's shared helpers sit at tests/'s top (tests are not a package), the stand-in ranks and their helpers
# in tests/ranks/; the test folders below mirror the product (flows/, tasks/, ddpflow/, training/, bench/, and
# house/ for checks of the whole product).
sys.path.append(str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "ranks"))
# Fixtures that tests in several folders use, from the helper modules that define them:
# tests/slurm_cluster.py: the session's two-node Slurm cluster (the `slurm_cluster` fixture) and its probes;
# tests/source_tables.py: small source files and a DataConfig for prepare (`make_config`, `table_file`, `dh`;
# tests/flows/conftest.py gives the flows' tests their own `make_config`, a whole pipeline's config);
# tests/manifest_datasets.py: prepared datasets and model.pt files written from their contracts.
from manifest_datasets import dataset_factory, model_factory  # noqa: E402, F401
from slurm_cluster import slurm_cluster  # noqa: E402, F401
from source_tables import dh, make_config, table_file  # noqa: E402, F401

# The marks torchrun, server and slurm, the guard that keeps them true, --reverse-modules.
pytest_plugins = ["suite_marks"]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def _migrated_mlflow_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite database with its schema migrated, made once per session."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates the tables
    return path


@pytest.fixture
def mlflow_store(tmp_path, _migrated_mlflow_db):
    """A real SQLite-backed MLflow store in a temp dir, (tracking_uri, artifact_root), started from a migrated
    copy: a fresh migration costs seconds per test."""
    shutil.copy(_migrated_mlflow_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "mlartifacts").as_uri()


@pytest.fixture(scope="session")
def prefect_harness() -> str:
    """ONE temporary Prefect server (SQLite) for the whole session: each costs 10-40 s to start. Yields its API
    URL, for a subprocess (`ddpflow run`) to use as a user's PREFECT_API_URL instead of starting its own."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


@pytest.fixture
def stand_in_rank(monkeypatch):
    """Ranks (every node's, under Slurm) run tests/ranks/dummy_rank.py instead of training.train: a launch costs the
    torchrun agents' start-up and no torch import in the ranks (tests/ddpflow/launch, tests/tasks)."""
    from launch_helpers import DUMMY_RANK

    import ddpflow.launch.command

    monkeypatch.setattr(ddpflow.launch.command, "RANK_ENTRYPOINT", str(DUMMY_RANK))
    return monkeypatch
