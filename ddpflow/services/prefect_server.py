"""The Prefect server that `ddpflow run` and `ddpflow register` talk to, and the temporary one they own.

    with prefect_server(project) as server:   # sets PREFECT_API_URL before Prefect is imported
        from flows.pipeline import train_pipeline   # overlaps with a temporary server's start
        server.wait_until_ready()
        train_pipeline(...)
    # a temporary server is stopped here, on every way out

Which server, in this order:

1. ``PREFECT_API_URL``, when the user set it: always wins.
2. The project's stack (`ddpflow stack up`): ``<project>/.ddpflow/stack.json``
   names its server and the server answers ``/api/health``. The run then shows
   in the stack's UI, and no server is started. A state file whose server does
   not answer is ignored; ``server.note`` says so, for the caller to print.
3. A temporary server that this module starts, and stops when the command ends.

Why ddpflow starts the temporary server itself. Without ``PREFECT_API_URL``,
Prefect 3.9 starts one on its own (``prefect.server.api.server.SubprocessASGIServer``:
``python -m uvicorn --factory prefect.server.api.server:create_app`` with
``PREFECT__SERVER_EPHEMERAL=1``) from whichever client first needs it, in the
caller's process group, and stops it only from an atexit hook. atexit does not
run when a signal's default action ends the process, and that is exactly how a
SIGTERM ends a flow: Prefect's SIGTERM handler marks the flow run crashed, then
restores the default handler and sends SIGTERM again. It does not run after a
SIGKILL either. Each such run left its server behind, holding a port and the
SQLite file. Reaching into Prefect's private singleton for the PID afterwards
would still leave the server without a parent-death signal, and a window
before its PID is known. So this module runs the very same command itself:

- the same server (Prefect's ephemeral app: no UI, only the services a run needs;
  ``prefect server start`` would also serve the UI and run the scheduler, and
  start slower), so a run's overhead stays what it was;
- in its own session, so a Ctrl-C in the terminal reaches the CLI, which stops it
  in order (after the flow run's final state is written), not both at once;
- with a parent-death signal (SIGTERM when the CLI dies, even by SIGKILL);
- stopped by its PID through the one stop helper (``stop_processes``: SIGTERM,
  5 s, SIGKILL), never by a name;
- on a port held from the moment it is chosen (a bound SO_REUSEADDR socket kept
  until the server answers: nothing else can take the port meanwhile, while the
  server, which binds with SO_REUSEADDR too, can);
- started before the CLI imports the flow (Prefect, MLflow, torch: ~5 s), so the
  server's start-up (~5 s warm, ~15 s cold) and those imports overlap.

The server keeps its database in ``PREFECT_HOME`` (``<project>/.ddpflow/prefect``
by default), the stack's too, so runs made with a temporary server are in the
stack's UI once it is up. Plain Python: Prefect runs only in the child process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ddpflow.launch.process_tree import is_running, session_members, stop_processes, with_parent_death_signal
from ddpflow.lifetime import shielded
from ddpflow.services.stack import HOST, http_ok, running_prefect_api

# What Prefect sets for its own temporary server (SubprocessASGIServer._run_uvicorn_command).
TEMPORARY_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# Prefect's own setting for how long its temporary server may take to start; honoured here too.
STARTUP_TIMEOUT_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
DEFAULT_STARTUP_TIMEOUT_S = 90.0  # ~15 s cold on 2 cores; far more under load
STOP_GRACE_S = 5.0  # it stops in well under a second when idle; SIGKILL after this

FROM_ENVIRONMENT = "PREFECT_API_URL"
FROM_STACK = "stack"
TEMPORARY = "temporary"


class PrefectServerError(RuntimeError):
    """The temporary server did not start; the message says why and where its output went."""


@dataclass
class PrefectServer:
    """One Prefect API for one command: where it is, where it came from, and (temporary) its process."""

    api_url: str
    source: str  # FROM_ENVIRONMENT, FROM_STACK or TEMPORARY
    note: str = ""  # why a stack.json was passed over, for the caller to print
    popen: subprocess.Popen | None = None
    _reservation: socket.socket | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def ui_url(self) -> str | None:
        """The UI of a server that outlives the command; None for a temporary one (no UI, gone at exit)."""
        if self.source == TEMPORARY:
            return None
        return self.api_url.rstrip("/").removesuffix("/api")

    def describe(self) -> dict[str, Any]:
        return {"prefect_server": self.source, "prefect_api_url": self.api_url}

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Return once the server answers /api/health (at once for a server this module did not start)."""
        if self.popen is None:
            return
        timeout_s = timeout_s if timeout_s is not None else startup_timeout_s()
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"{self.api_url}/health", timeout=2.0):
            if self.popen.poll() is not None:
                raise PrefectServerError(
                    f"the temporary Prefect server ({' '.join(temporary_server_argv(self._port))}) exited with "
                    f"status {self.popen.returncode} before it answered; its output is above"
                )
            if time.monotonic() > deadline:
                raise PrefectServerError(
                    f"the temporary Prefect server at {self.api_url} did not answer within {timeout_s:.0f} s "
                    f"(raise {STARTUP_TIMEOUT_VARIABLE} on a busy machine, or start one: `ddpflow stack up`)"
                )
            time.sleep(0.1)
        self._release_port()

    def stop(self) -> None:
        """Stop a temporary server and everything in its session; nothing for other servers. Idempotent."""
        self._release_port()
        if self.popen is None:
            return
        try:
            leader = [psutil.Process(self.popen.pid)]
        except psutil.NoSuchProcess:
            leader = []
        stop_processes([*leader, *session_members(self.popen.pid)], STOP_GRACE_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=1.0)  # reap it: no zombie

    @property
    def running(self) -> bool:
        if self.popen is None:
            return False
        try:
            return is_running(psutil.Process(self.popen.pid))
        except psutil.NoSuchProcess:
            return False

    @property
    def _port(self) -> int:
        return int(self.api_url.rsplit(":", 1)[1].split("/", 1)[0])

    def _release_port(self) -> None:
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None


@contextlib.contextmanager
def prefect_server(
    project: str | Path = ".", environ: MutableMapping[str, str] | None = None
) -> Iterator[PrefectServer]:
    """Choose the server (see the module's docstring), point ``PREFECT_API_URL`` at it, stop it on the way out.

    ``environ`` (default ``os.environ``) gets ``PREFECT_API_URL``: Prefect reads it once,
    when it is imported, so import the flows inside this block. A temporary server is
    stopped on every way out of the block, a signal's exception included; the stop is
    shielded from a second Ctrl-C.
    """
    environ = os.environ if environ is None else environ
    server = choose_server(project, environ)
    try:
        yield server
    finally:
        with shielded():
            server.stop()
            if server.source == TEMPORARY:
                environ.pop(FROM_ENVIRONMENT, None)  # it pointed at a server that is gone


def choose_server(project: str | Path, environ: MutableMapping[str, str]) -> PrefectServer:
    """PREFECT_API_URL, else the project's running stack, else a temporary server (started, not yet ready)."""
    explicit = environ.get(FROM_ENVIRONMENT)
    if explicit:
        return PrefectServer(api_url=explicit, source=FROM_ENVIRONMENT)
    stack_api, why_not = running_prefect_api(project)
    if stack_api:
        environ[FROM_ENVIRONMENT] = stack_api
        return PrefectServer(api_url=stack_api, source=FROM_STACK)
    server = start_temporary_server(environ)
    server.note = why_not
    environ[FROM_ENVIRONMENT] = server.api_url
    return server


def start_temporary_server(environ: MutableMapping[str, str]) -> PrefectServer:
    """Start Prefect's temporary server on a held loopback port; returns at once (see wait_until_ready)."""
    if environ.get("PREFECT_HOME"):
        # Prefect creates only the last level; without the parents its server cannot open its database.
        Path(environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    env = {**environ, **TEMPORARY_SERVER_ENV}
    env.pop(FROM_ENVIRONMENT, None)
    try:
        popen = subprocess.Popen(
            with_parent_death_signal(temporary_server_argv(port)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None,  # stdout stays the summary's
            start_new_session=True,
        )
    except BaseException:
        reservation.close()
        raise
    return PrefectServer(api_url=f"http://{HOST}:{port}/api", source=TEMPORARY, popen=popen, _reservation=reservation)


def temporary_server_argv(port: int) -> list[str]:
    """Prefect's own temporary-server command (errors only in its log), bound to loopback."""
    return [
        sys.executable, "-m", "uvicorn",
        "--factory", "prefect.server.api.server:create_app",
        "--host", HOST, "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip


def reserve_port() -> socket.socket:
    """A loopback port, bound (not listening) with SO_REUSEADDR: only another SO_REUSEADDR bind can share it.

    Linux also keeps connect() from picking a bound port as its local port. Close it
    once the server listens.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    return sock


def startup_timeout_s() -> float:
    raw = os.environ.get(STARTUP_TIMEOUT_VARIABLE, "")
    try:
        return float(raw) if raw else DEFAULT_STARTUP_TIMEOUT_S
    except ValueError:
        return DEFAULT_STARTUP_TIMEOUT_S


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
