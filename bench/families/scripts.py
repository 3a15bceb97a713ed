"""Your own script: a training script's steps under `ddpflow run` against the same file under a bare torchrun,
and the seconds ddpflow adds around it.

The script (``SCRIPT``: a user's plain DDP loop, gloo, a ``DistributedSampler``; no ddpflow call in it) trains an MLP
on synthetic rows, and rank 0 prints its steady steps per second (after ``WARMUP`` steps) and its last line. Each
repeat runs the same file both ways, back to back, in the same project directory: a bare
``torchrun --nproc_per_node 2 script.py`` and ``ddpflow run`` of a config naming it (no stack: the run starts its own
temporary Prefect server). The first pair runs in a new project, where ``ddpflow run`` also creates Prefect's and
MLflow's databases, once: its own row. The repeats after it are the project's later runs, what a scheduled retrain
pays every time. The ratio is ddpflow's steps/s over the bare run's, over every pair (the ranks are the same
processes: ddpflow adds nothing to a step); the fixed cost is the difference of the wall times in the later runs
(the flow, the temporary server, MLflow, the imports).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import yaml

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, log

WARMUP = 20
STEPS_PER_S = re.compile(r"steady steps/s ([0-9.]+)")

SCRIPT = """
import argparse, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--warmup", type=int, default=20)
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
x = torch.randn(65536, 32)
data = TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long())
sampler = DistributedSampler(data, seed=0)
loader = DataLoader(data, batch_size=256, sampler=sampler)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step, epoch, started = 0, 0, None
while step < args.steps:
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        if step == args.warmup:
            started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        step += 1
        if step == args.steps:
            break
    epoch += 1
if dist.get_rank() == 0:
    print(f"steady steps/s {(args.steps - args.warmup) / (time.perf_counter() - started):.3f}", flush=True)
dist.destroy_process_group()
"""


def run(ctx: Context) -> list[Result]:
    project = ctx.workdir / "script-project"
    project.mkdir(parents=True, exist_ok=True)
    (project / "train.py").write_text(SCRIPT)
    steps = 60 if ctx.quick else 600
    env = processes.child_env(threads=1)
    for inherited in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI"):
        env.pop(inherited, None)
    bare_rate, ours_rate, bare_wall, ours_wall = [], [], [], []
    for repeat in range(1 + ctx.sizes.orchestration_repeats):  # 0: the project's first run
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
        start = time.perf_counter()
        output, _ = processes.run([*argv, "--steps", str(steps)], timeout=900, env=env, cwd=project)
        bare_wall.append(time.perf_counter() - start)
        bare_rate.append(steps_per_s(output))
        wall, rate = ddpflow_run(project, repeat, steps, env)
        ours_wall.append(wall)
        ours_rate.append(rate)
        log(
            f"script {'first run' if repeat == 0 else f'repeat {repeat}'}: bare torchrun {bare_rate[-1]:.1f} "
            f"steps/s in {bare_wall[-1]:.1f} s, ddpflow run {ours_rate[-1]:.1f} steps/s in {ours_wall[-1]:.1f} s"
        )
    rate_ratio = Stats.of(a / b for a, b in zip(ours_rate, bare_rate))
    fixed = Stats.of(a - b for a, b in zip(ours_wall[1:], bare_wall[1:]))
    first = Stats.of([ours_wall[0] - bare_wall[0]])
    shape = f"{steps} steps of 256 rows a rank, 2 gloo ranks, {WARMUP} warm-up steps left out of the rate"
    return [
        Result(
            name="script_steps",
            title="Your own script: steps",
            ratio=rate_ratio,
            target=0.95,
            ratio_label="the script's steady steps/s under `ddpflow run` ÷ under a bare torchrun",
            rows=[
                Row("bare `torchrun --nproc_per_node 2 train.py`", Stats.of(bare_rate), "steps/s"),
                Row("`ddpflow run` of the same file (train.script)", Stats.of(ours_rate), "steps/s", rate_ratio),
            ],
            notes=[f"{shape}; each repeat runs both, back to back, in one project directory."],
        ),
        Result(
            name="script_fixed",
            title="Your own script: fixed cost",
            ratio=fixed,
            target=8.0,
            direction="le",
            ratio_label="`ddpflow run` wall − a bare torchrun's wall, the same script and steps (seconds)",
            rows=[
                Row("bare torchrun, whole run", Stats.of(bare_wall[1:]), "s"),
                Row(
                    "`ddpflow run`, whole run (a temporary Prefect server, MLflow, the flow)",
                    Stats.of(ours_wall[1:]),
                    "s",
                    fixed,
                ),
                Row(
                    "`ddpflow run` in a new project, its first run (creates Prefect's and MLflow's databases)",
                    Stats.of(ours_wall[:1]),
                    "s",
                    first,
                    f"the bare torchrun beside it: {bare_wall[0]:.1f} s",
                ),
            ],  # fmt: skip
            notes=[
                f"{shape}. `ddpflow run` with no stack up: it starts and stops its own Prefect server each time; "
                "the script logs no model, so nothing is registered. The judged figure is the project's later runs "
                f"({ctx.sizes.orchestration_repeats}, after its first), what a scheduled retrain pays every time; "
                "the first run, which creates the databases once, is its own row. Where the seconds go: "
                "'Orchestration overhead' above."
            ],
        ),
    ]


def ddpflow_run(project: Path, repeat: int, steps: int, env: dict[str, str]) -> tuple[float, float]:
    """`ddpflow run` of train.py in ``project``: (wall seconds, the script's steady steps/s)."""
    config = {
        "train": {
            "script": "train.py",
            "script_args": ["--steps", str(steps)],
            "nproc_per_node": 2,
            "backend": "gloo",
            "run_root": str(project / "runs"),
        },
        "registry": {"model_name": "bench-script"},
        "mlflow": {"tracking_uri": f"sqlite:///{project / 'mlflow.db'}", "experiment": "bench-script"},
    }
    (project / f"run-{repeat}.yaml").write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", ddpflow_api.CLI_MODULE, "run", "--config", f"run-{repeat}.yaml"]
    start = time.perf_counter()
    output, _ = processes.run(argv, timeout=900, env=env, cwd=project)
    wall = time.perf_counter() - start
    if not re.search(r"^\s*decision: tracked$", output, re.MULTILINE):
        raise RuntimeError(f"ddpflow run of the script did not end tracked:\n{output[-3000:]}")
    return wall, steps_per_s(output)


def steps_per_s(output: str) -> float:
    found = STEPS_PER_S.findall(output)
    if not found:
        raise RuntimeError(f"no 'steady steps/s' line from rank 0:\n{output[-2000:]}")
    return float(found[-1])
