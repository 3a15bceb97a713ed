"""`ddpflow serve`: MLflow's own scoring server (`mlflow models serve`) for a registered model, run from the
project's environment, owned until it stops.

    with ScoringServer(model.uri, tracking_uri, port=5001) as server:
        server.wait_until_ready()   # /ping answers; ScoringServerError (with its log's tail) if it died
        server.wait()               # until it exits, or Ctrl-C / SIGTERM end the command

Why not `mlflow models serve` from a shell: MLflow runs `uvicorn` by name, found on PATH only when the venv is
activated ("exec: uvicorn: not found" otherwise). Here it runs as ``sys.executable -m mlflow models serve
--env-manager local``, with this interpreter's bin directory first on PATH: the server, its model and the
pyfunc's code all come from the environment ddpflow runs in.

The server starts in a session of its own; leaving the ``with`` block, however it is left (Ctrl-C, SIGTERM,
an error), stops every process of that session (``stop_processes``): nothing is left running. A command
killed outright (SIGKILL) takes the server down too: the server's parent-death signal (SIGTERM), then
MLflow's own for its uvicorn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import psutil

from ddpflow.launch.process_tree import session_members, stop_processes, with_parent_death_signal
from ddpflow.lifetime import shielded

DEFAULT_PORT = 5001  # `ddpflow stack` puts the MLflow server on 5000
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


class ScoringServerError(RuntimeError):
    """The scoring server did not start, or exited on its own; the message ends with its last lines."""


class ScoringServer:
    def __init__(self, model_uri: str, tracking_uri: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        self.model_uri, self.tracking_uri, self.host, self.port = model_uri, tracking_uri, host, port
        self.process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._tail: deque[str] = deque(maxlen=40)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "mlflow", "models", "serve", "-m", self.model_uri,
            "--env-manager", "local", "--host", self.host, "--port", str(self.port),
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, MLFLOW_TRACKING_URI=self.tracking_uri)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
        return env

    def __enter__(self) -> ScoringServer:
        # Its own session: the terminal's Ctrl-C reaches this command only, which then stops the whole session.
        # The parent-death signal: if this command is killed outright (SIGKILL), `mlflow models serve` gets
        # SIGTERM, and MLflow's own one takes its uvicorn down with it.
        self.process = subprocess.Popen(
            with_parent_death_signal(self.argv()), env=self.environment(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._echo_lines, name="scoring-server-log", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        with shielded():  # a second Ctrl-C must not leave half of the server behind
            self.stop()

    def stop(self) -> None:
        if self.process is None:
            return
        members = session_members(self.process.pid)
        if self.process.poll() is None:
            members.append(psutil.Process(self.process.pid))
        stop_processes(members, STOP_GRACE_S)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass

    def wait_until_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /ping answers 200, echoing the server's lines to stderr; ScoringServerError if it exits first."""
        deadline = time.monotonic() + timeout_s
        while not self._answers("/ping"):
            if self.process.poll() is not None:
                self._reader.join(timeout=2)
                status = self.process.returncode
                raise ScoringServerError(self._ended(f"exited with status {status} before it answered"))
            if time.monotonic() > deadline:
                raise ScoringServerError(self._ended(f"did not answer {self.url}/ping within {timeout_s:g} s"))
            time.sleep(0.3)

    def wait(self) -> None:
        """Echo the server's log until it exits; ScoringServerError when it exits on its own."""
        status = self.process.wait()
        self._reader.join(timeout=2)
        raise ScoringServerError(self._ended(f"exited with status {status}"))

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _echo_lines(self) -> None:
        """A thread: the server's lines to stderr as they come (the last ones kept for an error)."""
        for line in self.process.stdout:
            self._tail.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)

    def _ended(self, what: str) -> str:
        tail = "\n".join(self._tail) or "(it printed nothing)"
        return f"the scoring server for {self.model_uri} {what}; its last lines:\n{tail}"
