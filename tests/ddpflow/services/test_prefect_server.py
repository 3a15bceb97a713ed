"""Which Prefect server a command uses, and the temporary server's life (ddpflow/services/prefect_server.py).

Real Prefect servers (Prefect's own temporary-server command), real processes.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpflow.launch.process_tree import is_running, session_members
from ddpflow.services import stack
from ddpflow.services.prefect_server import FROM_STACK, TEMPORARY, choose_server, start_temporary_server

pytestmark = pytest.mark.server  # each test starts a Prefect server: 5-15 s

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server_env(tmp_path_factory) -> dict[str, str]:
    """One PREFECT_HOME for the module: the database is created once, the second server starts warm."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def listening_addresses(pid: int) -> list[str]:
    return [
        conn.laddr.ip for conn in psutil.Process(pid).net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN
    ]


def test_a_running_stack_is_used_an_explicit_url_wins_and_the_temporary_server_stops(tmp_path, server_env):
    environ = dict(server_env)
    server = start_temporary_server(environ)
    try:
        assert server.source == TEMPORARY and "PREFECT_API_URL" not in environ
        server.wait_until_ready(timeout_s=180)
        addresses = listening_addresses(server.pid)
        assert addresses, "no listening socket found: the scan is broken"
        assert all(ipaddress.ip_address(ip).is_loopback for ip in addresses), addresses

        # A stack.json naming a server that answers: the project's stack is up.
        state = stack.StackState(prefect_url=server.api_url.removesuffix("/api"), mlflow_url="http://127.0.0.1:1")
        state.write(tmp_path / ".ddpflow" / "stack.json")
        chosen = choose_server(tmp_path, environ)
        assert (chosen.source, chosen.api_url, chosen.popen) == (FROM_STACK, server.api_url, None)
        assert environ["PREFECT_API_URL"] == server.api_url, "Prefect, imported next, must see it"
        explicit = choose_server(tmp_path, {"PREFECT_API_URL": "http://127.0.0.1:9/api"})
        assert (explicit.source, explicit.popen) == ("PREFECT_API_URL", None)
    finally:
        server.stop()
    assert not server.running
    assert session_members(server.pid) == []


OWNER = """
import os, sys, time
from ddpflow.services.prefect_server import start_temporary_server
server = start_temporary_server(dict(os.environ))
server.wait_until_ready(timeout_s=180)
print(server.pid, flush=True)
time.sleep(3600)
"""


def test_the_temporary_server_dies_with_its_owner_even_by_sigkill(server_env):
    """The OOM killer or `kill -9` on `ddpflow run`: no handler runs, the parent-death signal still does."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=server_env, stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(owner.stdout.readline()))
        assert "prefect.server.api.server:create_app" in server.cmdline()
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while is_running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not is_running(server), "the server outlived its owner"
