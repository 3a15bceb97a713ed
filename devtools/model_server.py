"""`mlflow models serve` for the tests: serve a registered model on a loopback port, POST rows, stop it.

predictions = invocations("models:/name@champion", tracking_uri, frame, workdir, env)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from devtools.ports import free_port
from devtools.waiting import wait_until

BIND_ATTEMPTS = 3  # the port was free when picked; another process can bind it while mlflow starts (seconds)
BOUND = "Uvicorn running on"  # uvicorn's line once it listens on its port


class PortTaken(Exception):
    """The server could not bind its port: another process took it after it was picked."""


def invocations(
    model_uri: str, tracking_uri: str, rows, workdir: Path, env: dict[str, str], params: dict | None = None
) -> list:
    """Serve ``model_uri`` (``--env-manager local``, one worker), POST ``rows`` (a DataFrame) as
    ``dataframe_split`` JSON to /invocations (with the model's ``params``, e.g. ``{"output": "probabilities"}``),
    return its predictions (a frame's come back as one record per row); the server is stopped by its session.
    A server whose port another process took meanwhile is started again on another port."""
    env = {**env, "MLFLOW_TRACKING_URI": tracking_uri}
    # mlflow runs `uvicorn` by name: the venv's bin on PATH, as an activated venv has it (make test does not activate).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local"]
    log_path = Path(workdir) / "serve.log"
    for _ in range(BIND_ATTEMPTS):
        try:
            return _serve_and_post([*command, "--host", "127.0.0.1", "--workers", "1"], workdir, env, log_path,
                                   rows, params)  # fmt: skip
        except PortTaken:
            continue
    raise AssertionError(log_path.read_text()[-3000:])


def _serve_and_post(command: list[str], workdir: Path, env: dict[str, str], log_path: Path, rows, params) -> list:
    port = free_port()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [*command, "--port", str(port)], cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            return _post(server, f"http://127.0.0.1:{port}", rows, params, log_path)
        finally:
            if server.poll() is None:  # a server that died says why in the assertion, not here
                os.killpg(server.pid, 15)  # the server and its one worker: the session this started
            server.wait(timeout=30)


def _post(server: subprocess.Popen, url: str, rows, params: dict | None, log_path: Path) -> list:
    """Once THIS server listens (its own log says so: a foreign server on the port would answer /ping too), POST."""
    wait_until(lambda: BOUND in log_path.read_text() or server.poll() is not None, 120, "mlflow models serve")
    if server.poll() is not None:
        if "address already in use" in log_path.read_text():
            raise PortTaken(url)
        raise AssertionError(log_path.read_text()[-3000:])
    wait_until(lambda: _answers(f"{url}/ping") or server.poll() is not None, 120, "mlflow models serve /ping")
    assert server.poll() is None, log_path.read_text()[-3000:]
    body = {"dataframe_split": json.loads(rows.to_json(orient="split", index=False))}
    body = json.dumps({**body, "params": params} if params else body).encode()
    request = urllib.request.Request(f"{url}/invocations", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["predictions"]
    except urllib.error.HTTPError as error:
        raise AssertionError(f"/invocations answered {error.code}: {error.read()[:2000]!r}") from None


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
