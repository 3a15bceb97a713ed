"""The session's two-node Slurm cluster for tests (devtools/slurm_local_cluster.py), and probes.

One ``slurmctld`` and two ``slurmd`` (nodes ``n1`` and ``n2``) per test session, started with
``Popen(start_new_session=True)`` and stopped by PID (TERM, 5 s, KILL). The session's
``SLURM_CONF`` is set in ``os.environ`` while it runs, so the launcher under test finds the
cluster the way it would on a login node.

Skipped only where the Slurm programs are missing (or we are not root) outside CI; with
``CI=true`` the same situation fails the tests instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psutil
import pytest

from devtools.slurm_local_cluster import LocalSlurmCluster, missing_requirements, start, stop
from devtools.waiting import wait_until

__all__ = [
    "LocalSlurmCluster",
    "processes_mentioning",
    "require_slurm",
    "skip_or_fail_in_ci",
    "slurm_cluster",
    "wait_until",
]


def require_slurm() -> None:
    """Skip outside CI when Slurm cannot run here; in CI (CI=true) fail instead."""
    missing = missing_requirements()
    if missing:
        skip_or_fail_in_ci(f"Slurm tests need {', '.join(missing)} (install: .ci/run, or ../shared/SLURM.md)")


def skip_or_fail_in_ci(reason: str) -> None:
    """What this machine cannot do skips the test, with the reason; in CI (CI=true) it fails it instead."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (a run directory: every rank and agent names it)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return [proc for proc in found if proc.pid != os.getpid()]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[LocalSlurmCluster]:
    """The session's two-node cluster; ``SLURM_CONF`` points at it while the session runs."""
    require_slurm()
    cluster = start(tmp_path_factory.mktemp("slurm"))
    patch = pytest.MonkeyPatch()
    patch.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        patch.undo()
        stop(cluster)  # cancels what a failed test left running first
