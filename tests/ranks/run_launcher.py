"""Runs ddpflow.launch.supervisor.launch on the dummy rank in its own process, for signal tests.

    run_launcher.py RUN_DIR [--thread] -- <dummy_rank args>

Prints every line, and "LAUNCH-ERROR: <message>" when launch raises.
--thread: call launch() from a worker thread (as a Prefect task submitted to a thread pool would).
--orphan-thread: the same, and the main thread ends once the ranks are up.
--preempt-grace=S: a first SIGTERM/SIGINT goes to the ranks, which get S seconds (ddpflow.launch.supervisor.Preemption).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_helpers import dummy_rank_argv

from ddpflow.launch.failure import LaunchError
from ddpflow.launch.supervisor import Preemption, launch


def run(run_dir: Path, rank_args: list[str], preemption: Preemption | None = None) -> None:
    try:
        argv = dummy_rank_argv(run_dir, *rank_args)
        launch(argv, run_dir, on_line=lambda line: print(line, flush=True), grace_s=2, preemption=preemption)
    except LaunchError as error:
        print(f"LAUNCH-ERROR: {error}", flush=True)
        raise


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    options, rank_args = argv[:split], argv[split + 1 :]
    run_dir = Path(options[0])
    grace = [float(option.split("=", 1)[1]) for option in options if option.startswith("--preempt-grace=")]
    preemption = Preemption(ranks=2, grace_s=grace[0]) if grace else None
    if "--thread" in options or "--orphan-thread" in options:
        worker = threading.Thread(target=run, args=(run_dir, rank_args))
        worker.start()
        if "--orphan-thread" in options:
            # The main thread waits only until torchrun is up, then ends: the interpreter starts
            # shutting down while the worker thread still runs torchrun (as after Prefect handled a
            # TerminationSignal in the main thread while a task ran in a thread pool).
            pid_file = run_dir / "torchrun.pid"
            while not pid_file.exists() or len(json.loads(pid_file.read_text())["descendants"]) < 3:
                time.sleep(0.2)
            print("MAIN THREAD ENDS", flush=True)
            return
        worker.join()
    else:
        run(run_dir, rank_args, preemption)


if __name__ == "__main__":
    main()
