"""Child processes for the benchmarks: torchrun launches and measured Python scripts.

Every child runs in its own session so that a timeout kills its whole tree
(torchrun's ranks included), never anything else on the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench import ddpflow_api
from bench.ddpflow_api import session_members, stop_processes
from bench.harness.results import REPO_ROOT


class ChildFailed(RuntimeError):
    pass


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    env.update(extra)
    return env


def run(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> tuple[str, float]:
    """Run to completion; (combined output, wall seconds). Raises ChildFailed with the output's tail."""
    start = time.perf_counter()
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        output, _ = process.communicate()
        raise ChildFailed(f"{' '.join(argv[:6])} ... timed out after {timeout:.0f} s:\n{output[-2000:]}") from None
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise ChildFailed(
            f"{' '.join(argv)} exited {process.returncode}:\n{_first_error(output)}\n...\n{output[-2000:]}"
        )
    return output, wall


def run_timed_lines(
    argv: list[str], marker: str, *, timeout: float, env: dict[str, str] | None = None
) -> tuple[float, float]:
    """Run to completion; (seconds until the first line containing ``marker``, wall seconds)."""
    start = time.perf_counter()
    process = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    seen, tail = None, []
    try:
        for line in process.stdout:
            if seen is None and marker in line:
                seen = time.perf_counter() - start
            tail = (tail + [line])[-40:]
            if time.perf_counter() - start > timeout:
                raise ChildFailed(f"{' '.join(argv)} timed out after {timeout:.0f} s")
        process.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
    finally:
        if process.poll() is None:
            kill_tree(process)
    wall = time.perf_counter() - start
    if process.returncode != 0 or seen is None:
        raise ChildFailed(
            f"{' '.join(argv)} exited {process.returncode}, marker {marker!r} "
            f"{'seen' if seen else 'not seen'}:\n{''.join(tail)}"
        )
    return seen, wall


def kill_tree(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the child, everything in its session (it was started with start_new_session) and its descendants."""
    tree = {member.pid: member for member in session_members(process.pid)}  # its session id is its PID
    try:  # and what left the session: torchrun starts every rank in a session of its own
        tree.update((child.pid, child) for child in psutil.Process(process.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    stop_processes(tree.values(), grace_s)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def torchrun_argv(nproc: int, module: str, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


def python_argv(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def read_json_lines(output: str, prefix: str = "BENCH ") -> list[dict[str, Any]]:
    """Children report figures as lines ``BENCH {json}`` on stdout."""
    return [json.loads(line[len(prefix) :]) for line in output.splitlines() if line.startswith(prefix)]


def report(**figures: Any) -> None:
    """Inside a child: print one figure line for the parent."""
    print("BENCH " + json.dumps(figures), flush=True)


def read_rank_files(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("rank-*.json"))]


def _first_error(output: str) -> str:
    """The first traceback or error line of a child: the cause, not the launcher's echo of it."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if "Traceback" in line or "Error" in line or "terminate called" in line:
            return "\n".join(lines[index : index + 25])
    return ""


# ----------------------------------------------------------------------------- a rank's memory, sampled

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def rank_memory(pid: int) -> tuple[int, int] | None:
    """(Pss_Anon, PSS of the node-cache files it maps) in bytes; None once the process is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    anon = next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss_Anon:")), 0)
    cache, in_cache_file = 0, False
    for line in smaps.splitlines():
        if _MAPPING.match(line):
            in_cache_file = line.rstrip().endswith(".bin")
        elif in_cache_file and line.startswith("Pss:"):
            cache += int(line.split()[1]) * 1024
    return anon, cache


AGENTS = ("torch.distributed.run", ddpflow_api.AGENT_MODULE)  # a torchrun agent's argv names its ranks' program too


def rank_pids() -> list[int]:
    """This process's descendants that run the rank program (not torchrun's agent)."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            argv = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if ddpflow_api.RANK_MODULE in argv and not any(agent in argv for agent in AGENTS):
            pids.append(child.pid)
    return pids
