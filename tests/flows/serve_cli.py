"""`ddpflow serve` as a user runs it, for the flow tests: started as the CLI, read as a person reads it, stopped
by a signal; what it started is recorded so a test can assert none of it outlives the command."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from devtools.ports import free_port
from devtools.waiting import wait_until
from tests.flows.cli_runs import cli_env

READY_LINE = "Ctrl-C stops it."


@dataclass
class ServeCommand:
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    started: list[psutil.Process] = field(default_factory=list)  # the server's processes, seen while it served

    def printed(self) -> str:
        return self.stdout.read_text()

    def url(self) -> str:
        return re.search(r" at (http://\S+)", self.printed()).group(1)

    def curl_line(self) -> str:
        return next(line.strip() for line in self.printed().splitlines() if line.strip().startswith("curl "))

    def post(self, body: dict) -> list:
        request = urllib.request.Request(
            f"{self.url()}/invocations", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())["predictions"]
        except urllib.error.HTTPError as error:
            raise AssertionError(f"/invocations answered {error.code}: {error.read()[:2000]!r}") from None

    def stop(self, signum: int, timeout_s: float = 60) -> int:
        """Send ``signum`` to the command alone (as a terminal's Ctrl-C or `kill` would); its exit status."""
        self.process.send_signal(signum)
        return self.process.wait(timeout=timeout_s)

    def left_running(self) -> list[str]:
        alive = []
        for proc in self.started:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(proc.cmdline())[:200])
            except psutil.NoSuchProcess:
                continue
        return alive


def as_from_a_terminal() -> None:
    """The signal dispositions a command typed at a terminal starts with. A suite started in the background
    (``nohup``, ``cmd &`` in a script) ignores SIGINT and SIGHUP, its children inherit that, and a command
    that ignores them rightly keeps running."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def start_serve(model: str, tracking_uri: str, workdir: Path) -> ServeCommand:
    """``ddpflow serve MODEL --port P --tracking-uri URI`` until it prints its note (the server answers)."""
    stdout, stderr = workdir / "serve.out", workdir / "serve.err"
    command = [sys.executable, "-m", "flows.cli", "serve", model, "--port", str(free_port())]
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(
            [*command, "--tracking-uri", tracking_uri], cwd=workdir, env=cli_env(), stdout=out, stderr=err,
            start_new_session=True,  # the test's signals reach the command only, as a terminal's would
            preexec_fn=as_from_a_terminal,  # Ctrl-C stops it also when the suite runs in the background
        )  # fmt: skip
    served = ServeCommand(process, stdout, stderr)

    def ready() -> bool:
        assert process.poll() is None, f"ddpflow serve exited {process.returncode}: {stderr.read_text()[-3000:]}"
        return READY_LINE in served.printed()

    try:
        wait_until(ready, 180, "ddpflow serve's note")
    except BaseException:
        served.stop(signal.SIGTERM)
        raise
    served.started = psutil.Process(process.pid).children(recursive=True)
    return served
