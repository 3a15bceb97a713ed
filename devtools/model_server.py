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


def invocations(
    model_uri: str, tracking_uri: str, rows, workdir: Path, env: dict[str, str], params: dict | None = None
) -> list:
    """Serve ``model_uri`` (``--env-manager local``, one worker), POST ``rows`` (a DataFrame) as
    ``dataframe_split`` JSON to /invocations (with the model's ``params``, e.g. ``{"output": "probabilities"}``),
    return its predictions (a frame's come back as one record per row); the server is stopped by its session."""
    port = free_port()
    env = {**env, "MLFLOW_TRACKING_URI": tracking_uri}
    # mlflow runs `uvicorn` by name: the venv's bin on PATH, as an activated venv has it (make test does not activate).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local"]
    log_path = Path(workdir) / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
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
    finally:
        if server.poll() is None:  # a server that died says why in the assertion above, not here
            os.killpg(server.pid, 15)  # the server and its one worker: the session this started
        server.wait(timeout=30)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
