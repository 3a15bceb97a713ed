"""How long a preempted run takes from the signal to its exit (docs/reliability.md), one measurement.

    .venv/bin/python -m devtools.preemption_probe [--hidden 10000] [--ranks 2] [--after-steps 3] [--workdir DIR]

Prepares a small synthetic table, then runs the local launcher (``ddpflow.launch.local.run_training``: torchrun,
the real ranks) in a child process on an MLP of 8 -> hidden -> hidden -> 3 (``--hidden 10000``: 100.1M parameters,
a 1.2 GB step checkpoint with AdamW's two moments), no step checkpoints configured. Once rank 0 reports
``--after-steps`` steps, SIGTERM goes to the child: the launcher passes it on to the ranks, which finish their
step, save a step checkpoint and exit (training/loop/preemption.py). Printed: the seconds from the signal to the
child's exit, the ranks' own "seconds_to_save" (RUN_DIR/preempted.json), a step's time, the checkpoint's size,
and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import sys
from ddpflow.launch.local import run_training
from ddpflow.launch.stage import TrainRequest
from training.core.config import load_config
config = load_config(None, sys.argv[3:])
try:
    run_training(TrainRequest(config, sys.argv[1], sys.argv[2], on_line=lambda line: print(line, flush=True)))
except BaseException as error:
    print(f"ENDED: {type(error).__name__}: {error}", flush=True)
    raise
"""
WATCH = """
import sys, time, psutil
root, start, seen = psutil.Process(int(sys.argv[1])), time.monotonic(), {}
def alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
while alive(root):
    try:
        now = {p.pid: p.name() for p in root.children(recursive=True) if alive(p)}
    except psutil.Error:
        break
    for pid in set(seen) - set(now):
        print(f"+{time.monotonic() - start:6.2f}s process {pid} ({seen[pid]}) ended", flush=True)
    seen = now
    time.sleep(0.1)
"""
STEP = re.compile(r"step (\d+)/\d+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=10000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--after-steps", type=int, default=3)
    parser.add_argument("--grace", type=float, default=None, help="train.preempt_grace_s (default: the config's)")
    parser.add_argument("--signal", default="SIGTERM", help="what the launching process is sent (default SIGTERM)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="preemption-probe-"))
    sys.path.insert(0, str(REPO))
    from training.core.config import load_config
    from training.prepare.dataset import prepare_dataset

    source = "synthetic://classification?rows=4000&features=8&classes=3&seed=0"
    data = load_config(None, [f"data.source={source}", f"data.root={workdir / 'shards'}"]).data
    dataset = prepare_dataset(data).dataset_dir
    run_dir = workdir / "run"
    run_dir.mkdir(exist_ok=True)
    overrides = [
        f"train.model_kwargs={json.dumps({'hidden': [args.hidden, args.hidden]})}",
        f"train.nproc_per_node={args.ranks}", "train.backend=gloo", "train.batch_size=64", "train.epochs=1",
        "train.progress_interval_s=0.1", "train.max_restarts=0", "train.timeout_s=3600",
        *([f"train.preempt_grace_s={args.grace}"] if args.grace else []),
    ]  # fmt: skip
    params = 8 * args.hidden + args.hidden * args.hidden + args.hidden * 3 + 2 * args.hidden + 3
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(dataset), str(run_dir), *overrides],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )  # fmt: skip
    step_times: list[float] = []
    sent = None
    assert child.stdout is not None
    for line in child.stdout:
        found = STEP.search(line) if "[rank 0]" in line else None
        if found and sent is None:
            step_times.append(time.monotonic())
            if int(found[1]) >= args.after_steps:
                sent = time.monotonic()
                load = os.getloadavg()
                child.send_signal(signal.Signals[args.signal])
                subprocess.Popen([sys.executable, "-c", WATCH, str(child.pid)])  # when each process ends
        if sent is not None:
            print(f"+{time.monotonic() - sent:6.2f}s {line.rstrip()[:160]}")
    child.wait()
    took = time.monotonic() - sent if sent is not None else float("nan")
    record = json.loads((run_dir / "preempted.json").read_text()) if (run_dir / "preempted.json").exists() else {}
    checkpoint = Path(record["checkpoint"]) if record.get("checkpoint") else None
    step_s = (step_times[-1] - step_times[0]) / max(1, len(step_times) - 1) if len(step_times) > 1 else float("nan")
    print(
        json.dumps(
            {
                "parameters": params,
                "ranks": args.ranks,
                "signal_to_exit_s": round(took, 2),
                "ranks_seconds_to_save": record.get("seconds_to_save"),
                "saved": f"epoch {record.get('epoch')} step {record.get('step')}",
                "checkpoint_bytes": checkpoint.stat().st_size if checkpoint and checkpoint.exists() else None,
                "progress_line_interval_s": round(step_s, 2),
                "exit_status": child.returncode,
                "load_average_at_signal": [round(x, 2) for x in load] if sent is not None else None,
                "cores": os.cpu_count(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
