"""Launch overhead through Slurm, on a real two-node cluster on this machine.

ddpflow: the train stage with ``train.launcher: slurm`` (``run_training_on_slurm``: preflight,
job files, ``sbatch``, scheduling, the node check step, the rendezvous, a torchrun agent per node,
the rank's imports, data, model and DDP) from its start to the line of rank 0's first training
step. Reference: a bare ``srun torchrun`` no-op on the same cluster, from this process: its
allocation, one agent per node, the c10d rendezvous and a rank per node that joins the process
group and leaves, to exit. The headline is the difference, 2 nodes x 1 rank each.

The cluster is devtools/slurm_local_cluster.py (one slurmctld, two slurmd, Debian's
packages, root). Where that cannot run, the family is skipped with the reason.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, log, skipped, turns
from bench.workloads.pipeline import FIRST_STEP, NOOP_RANK, small_config, small_dataset
from devtools.ports import free_port
from devtools.slurm_local_cluster import LocalSlurmCluster, missing_requirements, start, stop

NAME, TITLE = "slurm", "Launch through Slurm"
NODES = 2
TARGET_S = 1.5


def run(ctx: Context) -> list[Result]:
    missing = missing_requirements()
    if missing:
        return [skipped(NAME, TITLE, f"Slurm cannot run here: needs {', '.join(missing)} (.ci/run installs it)")]
    cluster = start(ctx.workdir / "slurm-cluster")
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # the launcher's commands find the cluster like on a login node
    try:
        return [launch_overhead(ctx, cluster)]
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        stop(cluster)


def launch_overhead(ctx: Context, cluster: LocalSlurmCluster) -> Result:
    noop = ctx.workdir / "noop_rank.py"
    noop.write_text(NOOP_RANK)
    dataset = small_dataset(ctx)
    ours: list[dict[str, float]] = []
    bare: list[float] = []
    for repeat in range(ctx.sizes.repeats):
        for side in turns(("ddpflow", "bare"), repeat):
            if side == "ddpflow":
                ours.append(ddpflow_first_step(ctx, dataset, ctx.workdir / "slurm-launch" / str(repeat)))
            else:
                bare.append(bare_srun_torchrun(cluster, noop))
        log(
            f"slurm repeat {repeat + 1}: ddpflow first step {ours[-1]['first step']:.2f} s, "
            f"bare srun torchrun no-op {bare[-1]:.2f} s"
        )
    first_step = [times["first step"] for times in ours]
    extra = Stats.of(a - b for a, b in zip(first_step, bare))
    return Result(
        name=NAME,
        title=TITLE,
        ratio=extra,
        target=TARGET_S,
        direction="le",
        ratio_label="ddpflow's train stage through Slurm → rank 0's first step, minus a bare srun torchrun no-op (s)",
        rows=[
            Row(
                f"bare srun torchrun, {NODES} nodes x 1 rank: allocation, rendezvous, no-op → exit", Stats.of(bare), "s"
            ),
            Row(
                "ddpflow: preflight, files, sbatch, queue, node check step → the job's rendezvous line",
                _stats(ours, "rendezvous"),
                "s",
                note="the batch script's first line, just before torchrun starts",
            ),
            Row("ddpflow: the same → rank 0's first line", _stats(ours, "first line"), "s"),
            Row(
                "ddpflow: the same → rank 0's first step",
                Stats.of(first_step),
                "s",
                extra,
                note="+ node check step, rendezvous, imports, data, model, DDP",
            ),
            Row("ddpflow: the same → job COMPLETED (1 epoch, checkpoints, model.pt)", _stats(ours, "end"), "s"),
        ],
        notes=[
            f"{ctx.sizes.orchestration_rows:,}-row dataset, {NODES} nodes x 1 rank, 1 epoch, on a two-node "
            "cluster on this machine (devtools/slurm_local_cluster.py): both nodes share its cores.",
            "Each repeat runs ddpflow's launch and the bare no-op back to back (order alternating); "
            "differences are taken within a repeat.",
            "The cluster schedules a batch job when it is submitted (batch_sched_delay=0); with Slurm's "
            "default a job may wait up to 3 s more in the queue, which is the cluster's time, not ddpflow's.",
        ],
    )


def _stats(samples: list[dict[str, float]], key: str) -> Stats:
    return Stats.of(times.get(key, float("nan")) for times in samples)


def ddpflow_first_step(ctx: Context, dataset: Path, root: Path) -> dict[str, float]:
    """Seconds from the train stage's start to the job's rendezvous line, rank 0's first line, first step, the end."""
    config = small_config(ctx, root, launcher="slurm", nnodes=NODES, nproc_per_node=1, progress_interval_s=1e-6)
    train_line = ddpflow_api.train_line_prefix()
    seen: dict[str, float] = {}

    def on_line(line) -> None:
        now = time.perf_counter()
        if line.rank is None and line.text.startswith("ddpflow: rendezvous on "):
            seen.setdefault("rendezvous", now)
        if line.rank == 0 and line.text.startswith(train_line):
            seen.setdefault("first line", now)
        if line.rank == 0 and FIRST_STEP in line.text:
            seen.setdefault("first step", now)

    start = time.perf_counter()
    ddpflow_api.launch_training(config, dataset, root / "run", on_line, timeout_s=600)
    seen["end"] = time.perf_counter()
    if "first step" not in seen:
        raise RuntimeError(f"no line with {FIRST_STEP!r} from rank 0 in the Slurm launch under {root / 'run'}")
    return {key: value - start for key, value in seen.items()}


def bare_srun_torchrun(cluster: LocalSlurmCluster, noop: Path) -> float:
    """Wall seconds of ``srun`` starting one torchrun agent per node whose rank joins the group and leaves."""
    port = free_port()
    agent = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NODES), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bare-{port}",
        str(noop),
    ]  # fmt: skip
    # Node 0 hosts the rendezvous store, as in ddpflow's job (the other agent would fail to bind its port).
    per_node = 'export PET_RDZV_CONF="is_host=$(( SLURM_NODEID == 0 ))"; exec "$@"'
    argv = ["srun", f"--nodes={NODES}", "--ntasks-per-node=1", "/bin/sh", "-c", per_node, "bare", *agent]
    env = processes.child_env(SLURM_CONF=str(cluster.conf), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    output, wall = processes.run(argv, timeout=300, env=env)
    if output.count("ranks ready") != NODES:
        raise RuntimeError(f"the bare srun torchrun no-op did not get both ranks ready:\n{output[-2000:]}")
    return wall
