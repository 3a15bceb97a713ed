"""A stand-in rank for launcher tests: prints, sleeps, raises, hangs or spawns children.

    dummy_rank.py --mode ok|raise|flaky|hang|spawn|stubborn|nccl-timeout|preemptible [--lines N] [--interval S]
                  [--fail-rank R]

preemptible: catches SIGTERM and SIGINT as a real rank's preemption handler does (training/loop/preemption.py),
says so ("rank R got SIGTERM"), and never ends: a save that outlasts train.preempt_grace_s.

nccl-timeout: the fail rank dies as NCCL's watchdog makes a rank die on a collective timeout
(on stderr, the log text of a real rank that NCCL's watchdog aborted: nccl_watchdog_abort.log; then SIGABRT);
the others stall, as the peer that never joined the collective would.

Defaults come from DUMMY_RANK_* environment variables, so the Prefect task (which always
passes only ``--config RUN_DIR/train_config.json``) can drive it too. Run with --config, every
rank writes its environment to RUN_DIR/rank-env/RANK.json, and rank 0 writes RUN_DIR/metrics.jsonl
(epoch e of train.epochs: val_loss 1/(e+1), the world size) and a RUN_DIR/model.pt marker.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    env = os.environ.get
    parser.add_argument(
        "--mode",
        default=env("DUMMY_RANK_MODE", "ok"),
        choices=["ok", "raise", "flaky", "hang", "spawn", "stubborn", "nccl-timeout", "preemptible"],
    )
    parser.add_argument("--lines", type=int, default=int(env("DUMMY_RANK_LINES", "3")))
    parser.add_argument("--interval", type=float, default=float(env("DUMMY_RANK_INTERVAL", "0.1")))
    parser.add_argument("--fail-rank", type=int, default=int(env("DUMMY_RANK_FAIL_RANK", "1")))
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.mode == "flaky" and rank == args.fail_rank and attempt == 0:
        raise RuntimeError(f"flaky failure on rank {rank}, attempt {attempt}")
    print(f"rank {rank} started pid={os.getpid()}", flush=True)

    if args.mode == "spawn":
        # A grandchild in its own session, like a data-loader worker or a helper daemon.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print(f"rank {rank} spawned a child", flush=True)
    if args.mode == "preemptible":

        def told(signum, frame):
            print(f"rank {rank} got {signal.Signals(signum).name}", flush=True)

        signal.signal(signal.SIGTERM, told)
        signal.signal(signal.SIGINT, told)
    if args.mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this rank
        print(f"rank {rank} ignores SIGTERM", flush=True)

    for step in range(args.lines):
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(args.interval)
        if args.mode == "raise" and rank == args.fail_rank:
            raise ValueError(f"dummy failure on rank {rank} at step {step}")

    if args.mode == "nccl-timeout" and rank == args.fail_rank:
        from pathlib import Path

        sys.stderr.write((Path(__file__).parent / "nccl_watchdog_abort.log").read_text())
        sys.stderr.flush()
        os.abort()  # SIGABRT, no Python exception: what std::terminate does to the real rank

    if args.mode in ("hang", "spawn", "stubborn", "nccl-timeout", "preemptible"):
        time.sleep(600)  # silent: only a kill ends it
    if args.config:
        write_outputs(args.config, rank)
    print(f"rank {rank} done", flush=True)


def write_outputs(config_path: str, rank: int) -> None:
    """What a real run leaves, from the job: every rank its environment (RUN_DIR/rank-env/RANK.json, for the
    tests of what ranks are given); rank 0 one metrics line per train.epochs and a model.pt marker."""
    import json
    from pathlib import Path

    job = json.loads(Path(config_path).read_text())
    run_dir = Path(job["run_dir"])
    (run_dir / "rank-env").mkdir(exist_ok=True)
    (run_dir / "rank-env" / f"{rank}.json").write_text(json.dumps(dict(os.environ)))
    if rank != 0:
        return
    world_size = int(os.environ["WORLD_SIZE"])
    epochs = [
        {"epoch": e, "val_loss": 1 / (e + 1), "world_size": world_size} for e in range(job["config"]["train"]["epochs"])
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in epochs))
    (run_dir / "model.pt").write_bytes(b"stand-in")


if __name__ == "__main__":
    main()
