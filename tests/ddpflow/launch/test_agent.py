"""ddpflow/launch/agent.py: torchrun's own ``main``, then, once it returned, an exit without the interpreter's
teardown; a failure leaves through Python's own exit, as ``python -m torch.distributed.run`` would. Real torchrun,
one no-op rank. The teardown is seen by an ``atexit`` handler that a ``sitecustomize`` on ``PYTHONPATH`` registers in
the agent: it writes a file when the agent's interpreter tears down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpflow.launch.agent import AGENT_MODULE

REPO = Path(__file__).resolve().parents[3]
SITECUSTOMIZE = """
import atexit, os, sys
def _torn_down():
    if sys.argv and sys.argv[0].endswith(os.path.join("ddpflow", "launch", "agent.py")):
        open(os.environ["AGENT_TEARDOWN_MARK"], "w").close()
atexit.register(_torn_down)
"""
RANK = "import sys; print('rank done', flush=True); sys.exit(int(sys.argv[1]))"


def run_agent(tmp_path: Path, rank_exit: int) -> tuple[subprocess.CompletedProcess, Path]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    mark = tmp_path / f"torn-down-{rank_exit}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "AGENT_TEARDOWN_MARK": str(mark)}
    argv = [sys.executable, "-m", AGENT_MODULE, "--standalone", "--nproc-per-node", "1", str(rank), str(rank_exit)]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    return done, mark


@pytest.mark.torchrun
def test_the_agent_skips_its_teardown_after_its_ranks_succeed_and_fails_as_torchrun_does(tmp_path):
    done, mark = run_agent(tmp_path, 0)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank done" in done.stdout + done.stderr
    assert not mark.exists(), "the agent tore its interpreter down after a run that succeeded"

    failed, mark = run_agent(tmp_path, 3)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert "ChildFailedError" in failed.stderr  # torchrun's own report of the failed rank
    assert mark.exists(), "a failed run leaves through Python's own exit (the teardown's handler ran)"
