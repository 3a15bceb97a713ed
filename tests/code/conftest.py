"""Fixtures for tests/code: one Prefect harness per session (it costs ~10 s to start)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Stand-in ranks and their helpers live in tests/code/ranks (tests are not a package).
sys.path.insert(0, str(Path(__file__).parent / "ranks"))


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server (SQLite) for the whole session: it costs ~10 s to start."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield

