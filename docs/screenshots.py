"""Screenshots of the running stack's UIs into docs/img/, with headless Chromium.

    ddpflow stack up && prefect deployment run 'train-pipeline/manual' --watch
    python docs/screenshots.py [--state-dir .ddpflow] [--out docs/img]
    python docs/screenshots.py --only --page mlflow-drift.png mlflow \
        '/#/experiments/1/runs/<run id>/artifacts/drift/data_drift.png'    # one run's drift figure

Needs `chromium` (Debian: apt-get install chromium). Reads the URLs from the
stack's stack.json, so it shoots whatever `ddpflow stack up` started.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpflow.services.stack import StackLayout, StackState

# (file name, which UI, path): the pages a reader of docs/deployments.md wants to see.
PAGES = (
    ("prefect-deployments.png", "prefect", "/deployments"),
    ("prefect-runs.png", "prefect", "/runs"),
    ("mlflow-experiments.png", "mlflow", "/#/experiments"),
    ("mlflow-models.png", "mlflow", "/#/models/ddpflow-demo"),
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("error: no chromium on PATH (Debian: apt-get install chromium)")


def _devtools_port(profile: Path, browser: subprocess.Popen, timeout_s: float = 60) -> int:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if browser.poll() is not None:
            raise SystemExit(f"error: chromium exited with {browser.returncode}")
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text().split()[0])
        time.sleep(0.2)
    raise SystemExit("error: chromium did not open its DevTools port")


class Page:
    """One headless tab driven over the DevTools protocol: real waits, unlike
    --screenshot with --virtual-time-budget, under which the Prefect UI's API
    calls time out before they answer."""

    def __init__(self, devtools_port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{devtools_port}/json") as response:
            target = next(t for t in json.load(response) if t["type"] == "page")
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # skip events until our answer
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                return message.get("result", {})

    def shoot(self, url: str, out: Path, settle_s: float) -> None:
        self.call("Page.navigate", url=url)
        time.sleep(settle_s)
        # Dismiss "what's new" dialogs and side panels: they hide the page.
        self.call("Runtime.evaluate", expression=DISMISS_JS)
        time.sleep(1.5)
        out.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


# Close buttons of dialogs and drawers, whatever the UI library names them.
DISMISS_JS = """
document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape', bubbles: true}));
const closers = 'button[aria-label="Close"], button[aria-label="close"], [data-testid*="close"]';
for (const b of document.querySelectorAll(closers)) b.click();
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default=".")
    parser.add_argument("--state-dir", help="default: <project>/.ddpflow")
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds each page gets to load its data")
    parser.add_argument(
        "--page", nargs=3, action="append", default=[], metavar=("FILE", "UI", "PATH"),
        help="one more page: file name, 'prefect' or 'mlflow', path under that UI (repeatable)",
    )  # fmt: skip
    parser.add_argument("--only", action="store_true", help="shoot only the --page pages")
    args = parser.parse_args()
    layout = StackLayout.for_project(args.project, args.state_dir)
    state = StackState.read(layout.stack_file)
    if state is None:
        raise SystemExit(f"error: no stack recorded in {layout.stack_file}; run `ddpflow stack up` first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bases = {"prefect": state.prefect_url, "mlflow": state.mlflow_url}
    unknown = [ui for _, ui, _ in args.page if ui not in bases]
    if unknown:
        raise SystemExit(f"error: --page UI must be 'prefect' or 'mlflow', not {unknown[0]!r}")
    with tempfile.TemporaryDirectory(prefix="ddpflow-chromium-") as profile:
        argv = [
            chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
            "--window-size=1440,900", "about:blank",
        ]  # fmt: skip
        browser = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            page = Page(_devtools_port(Path(profile), browser))
            for name, ui, path in ([] if args.only else list(PAGES)) + [tuple(page) for page in args.page]:
                page.shoot(bases[ui] + path, out / name, args.settle)
                print(out / name)
        finally:
            browser.terminate()
            browser.wait(timeout=30)


if __name__ == "__main__":
    main()
