"""Launch latency and orchestration overhead, on small data (the fixed costs are the point).

Launch: from the train stage's start (``ddpflow.launch.local.run_training``:
preflight, job file, launch) to rank 0's first training step, minus the wall time of a bare torchrun whose
2 ranks only join the process group and leave.

Orchestration: ``ddpflow run`` (Prefect flow: prepare, train, evaluate,
register in MLflow) in a project whose stack is up (`ddpflow stack up`: the run
finds the stack's Prefect server by itself), minus the bare work: torchrun
``training.train`` then ``evaluate_split`` in a plain process, on the same
prepared data. Next to it, in the same repeat, ``ddpflow run`` in a project
without a stack, which starts and stops a temporary Prefect server of its own
(ddpflow/services/prefect_server.py): the difference is what the temporary server costs
a run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import REPO_ROOT, Result, Row, Stats, Timer, log
from bench.workloads.pipeline import FIRST_STEP, NOOP_RANK, small_config, small_dataset
from devtools.ports import free_port


def run(ctx: Context) -> list[Result]:
    return [launch_latency(ctx), orchestration(ctx)]


# --------------------------------------------------------------------------- launch


def launch_latency(ctx: Context) -> Result:
    noop = ctx.workdir / "noop_rank.py"
    noop.write_text(NOOP_RANK)
    dataset = small_dataset(ctx)
    ours, bare, bare_wall, first_line, whole = [], [], [], [], []
    for repeat in range(ctx.sizes.repeats):
        times = ddpflow_first_step(ctx, dataset, ctx.workdir / "launch" / str(repeat))
        ours.append(times["first step"])
        first_line.append(times.get("first line", float("nan")))
        whole.append(times["end"])
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--tee",
            "3",
            str(noop),
        ]
        ready, wall = processes.run_timed_lines(argv, "ranks ready", timeout=300)
        bare.append(ready)
        bare_wall.append(wall)
        log(
            f"launch repeat {repeat + 1}: ddpflow first step {ours[-1]:.2f} s, "
            f"bare torchrun no-op ready {ready:.2f} s (exit {wall:.2f} s)"
        )
    # The reference: a bare torchrun no-op's whole run (3.8 s when it was filed).
    extra = Stats.of(a - b for a, b in zip(ours, bare_wall))
    # Stricter: only until the no-op's ranks have joined the group.
    extra_to_ready = Stats.of(a - b for a, b in zip(ours, bare))
    return Result(
        name="launch",
        title="Launch latency",
        ratio=extra,
        target=1.0,
        direction="le",
        ratio_label="ddpflow launch → first step, minus a bare torchrun no-op's wall time (seconds)",
        rows=[
            Row("bare torchrun, 2 ranks: init_process_group + barrier → ready", Stats.of(bare), "s"),
            Row(
                "  the same, to exit (the reference)",
                Stats.of(bare_wall),
                "s",
                note="measured when the issue was filed: 3.8 s",
            ),
            Row(
                "ddpflow: preflight + job file + launch (run_training) → rank 0's first line",
                Stats.of(first_line),
                "s",
                note="imports, process group, CPU setup; "
                "DDP's torch._dynamo import runs on a thread from the rank's start",
            ),
            Row(
                "ddpflow: the same → rank 0's first step",
                Stats.of(ours),
                "s",
                extra,
                note="+ load train and val splits, model, DDP",
            ),
            Row("  ddpflow's first step − the no-op's ranks ready (stricter)", extra_to_ready, "s"),
            Row("ddpflow: the same launch to exit (1 epoch, checkpoints, model.pt)", Stats.of(whole), "s"),
        ],
        notes=[
            f"{ctx.sizes.orchestration_rows:,}-row dataset, 2 ranks, 1 epoch; the first step comes after imports, "
            "process group, loading the train and val splits, building the model and DDP. "
            "The Prefect task around the launcher is in the orchestration figure.",
            "Each repeat runs ddpflow's launch and the bare no-op back to back; differences are taken within a repeat.",
        ],
    )


def ddpflow_first_step(ctx: Context, dataset: Path, root: Path) -> dict[str, float]:
    """Seconds from the launcher's start to rank 0's first line, to its first step, and to the end."""
    config = small_config(ctx, root, progress_interval_s=1e-6)
    train_line = ddpflow_api.train_line_prefix()
    seen: dict[str, float] = {}

    def on_line(line) -> None:
        now = time.perf_counter()
        if line.rank == 0 and line.text.startswith(train_line):
            seen.setdefault("first line", now)
        if line.rank in (0, None) and FIRST_STEP in line.text:
            seen.setdefault("first step", now)

    start = time.perf_counter()
    ddpflow_api.launch_training(config, dataset, root / "run", on_line, timeout_s=300)
    seen["end"] = time.perf_counter()
    if "first step" not in seen:
        raise RuntimeError(f"no line with {FIRST_STEP!r} from rank 0 in the launch under {root / 'run'}")
    return {key: value - start for key, value in seen.items()}


# --------------------------------------------------------------------------- orchestration

REFERENCE_FIT = re.compile(r"Baselines: reference: HistGradientBoosting fitted on .*? iterations in ([0-9.]+)s")


def orchestration(ctx: Context) -> Result:
    dataset = small_dataset(ctx)
    env = processes.child_env(threads=1)
    for inherited in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI"):
        env.pop(inherited, None)  # each project finds its own server and keeps its own Prefect home
    stacked, alone = ctx.workdir / "project-with-stack", ctx.workdir / "project-alone"
    alone.mkdir(parents=True, exist_ok=True)
    cold_start, warm_start = temporary_server_starts(alone, env)
    with Timer() as stack_up:
        ddpflow_api.stack_up(
            REPO_ROOT,
            prefect_port=free_port(),
            mlflow_port=free_port(),
            state_dir=stacked / ".ddpflow",
            mlflow_dir=stacked / "mlflow",
        )
    try:
        with_stack, without_stack, bare, imports, reference = [], [], [], [], []
        for repeat in range(ctx.sizes.orchestration_repeats):
            flow_import = [sys.executable, "-c", f"import {ddpflow_api.FLOW_MODULE}"]
            imports.append(processes.run(flow_import, timeout=300, env=env)[1])
            root = ctx.workdir / "orchestration" / str(repeat)
            runs = [(with_stack, "with-stack", stacked, "stack"), (without_stack, "alone", alone, "temporary")]
            for walls, name, project, server in runs if repeat % 2 == 0 else reversed(runs):  # alternate who's first
                wall, fitted = ddpflow_run_wall(ctx, root / name, project, env, expect_server=server)
                walls.append(wall)
                reference.append(fitted)
            bare.append(bare_train_eval_wall(ctx, dataset, root / "bare", env))
            log(
                f"orchestration repeat {repeat + 1}: ddpflow run with the stack {with_stack[-1]:.1f} s, "
                f"without (temporary server) {without_stack[-1]:.1f} s, bare torchrun + evaluate {bare[-1]:.1f} s"
            )
    finally:
        ddpflow_api.stack_down(REPO_ROOT, state_dir=stacked / ".ddpflow")
    extra = Stats.of(a - b for a, b in zip(with_stack, bare))
    temporary_cost = Stats.of(a - b for a, b in zip(without_stack, with_stack))
    return Result(
        name="orchestration",
        title="Orchestration overhead",
        ratio=extra,
        target=10.0,
        direction="le",
        ratio_label="`ddpflow run` wall (stack up) − bare torchrun train + evaluate wall (seconds)",
        rows=[
            Row("bare: torchrun training.train, then evaluate_split in a plain process", Stats.of(bare), "s"),
            Row(
                "`ddpflow run` in a project whose stack is up (uses its Prefect server)",
                Stats.of(with_stack),
                "s",
                extra,
            ),
            Row(
                "`ddpflow run` with no stack (starts and stops a temporary Prefect server)",
                Stats.of(without_stack),
                "s",
                Stats.of(a - b for a, b in zip(without_stack, bare)),
            ),
            Row(
                "  the temporary server's cost to a run (without − with the stack)",
                temporary_cost,
                "s",
                note="its start overlaps the CLI's imports",
            ),
            Row(
                "  in either: the reference model's fit (`eval.reference`, HistGradientBoosting on the train split, "
                "in its own task beside the train task; `false` saves it)",
                Stats.of(reference),
                "s",
                note="its seconds overlap the ranks'; the bare work fits none",
            ),
            Row(
                "  of which: a fresh process importing the flow (Prefect, MLflow, tasks)",
                Stats.of(imports),
                "s",
                note="the CLI process pays this once",
            ),
            Row("a temporary server's start alone, new database (a project's first run)", Stats.of([cold_start]), "s"),
            Row("  the same, existing database", Stats.of([warm_start]), "s"),
            Row(
                "`ddpflow stack up` (Prefect + MLflow servers, work pool, deployments, worker)",
                Stats.of([stack_up.seconds]),
                "s",
            ),
        ],
        notes=[
            f"{ctx.sizes.orchestration_rows:,} rows, 1 epoch, 2 ranks; the dataset was prepared beforehand, so the "
            "flow's prepare is a cache hit. The flow adds: Prefect flow and task runs, the MLflow run (params, "
            "per-epoch metrics, artifacts), logging the model, the registry gate.",
            "Each repeat runs the three back to back (the two `ddpflow run`s in alternating order); differences are "
            "taken within a repeat. The project without a stack has its Prefect database created beforehand (the "
            "first start's cost is the 'new database' figure).",
        ],
    )


def temporary_server_starts(project: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds until a temporary server answers: first with a new database, then with the one it made."""
    server_env = {**env, "PREFECT_HOME": str(project / ".ddpflow" / "prefect")}
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        server = ddpflow_api.start_temporary_server(server_env)
        try:
            server.wait_until_ready(timeout_s=300)
            seconds.append(time.perf_counter() - start)
        finally:
            server.stop()
    return seconds[0], seconds[1]


def cli_overrides(config) -> list[str]:
    flat = {
        "data.source": config.data.source,
        "data.root": config.data.root,
        "train.epochs": config.train.epochs,
        "train.batch_size": config.train.batch_size,
        "train.nproc_per_node": config.train.nproc_per_node,
        "train.run_root": config.train.run_root,
        "train.max_restarts": config.train.max_restarts,
        "mlflow.tracking_uri": config.mlflow.tracking_uri,
        "mlflow.artifact_location": config.mlflow.artifact_location,
        "mlflow.experiment": config.mlflow.experiment,
        "registry.model_name": config.registry.model_name,
    }
    return [arg for key, value in flat.items() for arg in ("--set", f"{key}={value}")]


def ddpflow_run_wall(
    ctx: Context, root: Path, project: Path, env: dict[str, str], expect_server: str
) -> tuple[float, float]:
    """`ddpflow run` in ``project`` (its stack, if any, is found from there): wall seconds, and the seconds of the
    reference model's fit in its evaluate task (its log line; 0 when it fitted none)."""
    root.mkdir(parents=True, exist_ok=True)
    config = small_config(ctx, root)
    argv = [sys.executable, "-m", ddpflow_api.CLI_MODULE, "run", *cli_overrides(config), "--json"]
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise processes.ChildFailed(f"ddpflow run exited {result.returncode}:\n{result.stderr[-3000:]}")
    server = json.loads(result.stdout)["prefect_server"]
    if server != expect_server:
        raise RuntimeError(f"ddpflow run in {project} used the {server!r} Prefect server, not {expect_server!r}")
    fitted = REFERENCE_FIT.search(result.stdout + result.stderr)
    return wall, float(fitted[1]) if fitted else 0.0


def bare_train_eval_wall(ctx: Context, dataset: Path, root: Path, env: dict[str, str]) -> float:
    config = small_config(ctx, root)
    run_dir = root / "run"
    job = ddpflow_api.write_train_job(config, dataset, run_dir)
    bare_env = dict(env, OMP_NUM_THREADS="1")
    bare_env.pop("PREFECT_API_URL", None)
    with Timer() as wall:
        ranks = processes.torchrun_argv(2, ddpflow_api.RANK_MODULE, ["--config", str(job)])
        processes.run(ranks, timeout=600, env=bare_env)
        processes.run(
            [sys.executable, "-c", ddpflow_api.EVALUATE_IN_A_PROCESS, str(run_dir / "model.pt"), str(dataset)],
            timeout=600,
            env=bare_env,
        )
    return wall.seconds
