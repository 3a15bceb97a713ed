"""The torchrun command line and the environment its ranks inherit (plain Python, no Prefect).

    argv = torchrun_command(config, run_dir / "train_config.json", gpus=2)
    env = launch_env(config, run_dir, tracking_uri=uri, gpus=2, grace_s=10)

How many ranks and which backend: training/core/topology.py (``resolve_ranks``), the one
rule that the preflight, the ranks and the MLflow tags use too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ddpflow.launch.agent import AGENT_MODULE
from training.core.config import PipelineConfig
from training.core.layout import JOB_ENV, TRAIN_JOB, run_file
from training.core.topology import available_cores, resolve_ranks

LOG_DIR = "logs"  # RUN_DIR/logs/<torchrun job>/attempt_<n>/<local rank>/{stdout,stderr}.log
ERROR_FILE = "error.json"  # torchrun's @record copies the root-cause rank's error here
RANK_ENTRYPOINT = "training.train"  # what every rank runs; tests point it at a stand-in script
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # where `training` imports from, whatever the caller's cwd


def torchrun_command(
    config: PipelineConfig, job_path: str | os.PathLike, *, gpus: int | None = None, entrypoint: str | None = None
) -> list[str]:
    """The torchrun argv, as a list (never a shell string). Logs go to ``<job dir>/logs``. What every rank runs:
    ``rank_program`` (``entrypoint``: a module of ddpflow's own, batch scoring's)."""
    train = config.train
    layout = resolve_ranks(train, gpus)
    job_path = Path(job_path)
    argv = [sys.executable, "-m", AGENT_MODULE]  # torch.distributed.run's main (ddpflow/launch/agent.py)
    if train.nnodes == 1:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += [
            "--nnodes", str(train.nnodes),
            "--node-rank", str(train.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", str(train.rdzv_endpoint),
            # Every node must pass the same id; a fixed default works for one job per endpoint.
            "--rdzv-id", train.rdzv_id or "ddpflow",
        ]  # fmt: skip
    argv += [
        "--nproc-per-node", str(layout.nproc_per_node),
        "--max-restarts", str(train.max_restarts),
        # Per-rank stdout/stderr files under logs/ AND on torchrun's stdout, each line prefixed "[defaultN]:".
        "--log-dir", str(job_path.parent / LOG_DIR),
        "--tee", "3",
    ]  # fmt: skip
    return [*argv, *rank_program(config, job_path, entrypoint)]


def rank_program(config: PipelineConfig, job_path: str | os.PathLike, entrypoint: str | None = None) -> list[str]:
    """What every rank runs, after torchrun's own options: a user's script (``train.script`` with its
    ``script_args`` and ``script_params``, as a person would type them), else a module of ddpflow's
    (``entrypoint``, default ``RANK_ENTRYPOINT``: the trainer; a path, a tests' stand-in rank) given
    ``--config JOB``."""
    if entrypoint is None and config.train.script:
        return [str(config.train.script), *script_arguments(config.train.script_args, config.train.script_params)]
    module = entrypoint or RANK_ENTRYPOINT
    entry = [module] if module.endswith(".py") else ["-m", module]
    return [*entry, "--config", str(job_path)]


def script_arguments(args: list[str], params: dict[str, Any]) -> list[str]:
    """A script's argv: ``train.script_args`` as given, then each of ``train.script_params`` as ``--key value``
    (a string as it is, any other value as JSON: ``0.01``, ``true``, ``[1, 2]``; ``ddpflow.params()`` reads them
    back the same way)."""
    pairs = [[f"--{key}", value if isinstance(value, str) else json.dumps(value)] for key, value in params.items()]
    return [*args, *(part for pair in pairs for part in pair)]


def launch_env(
    config: PipelineConfig,
    run_dir: str | os.PathLike,
    *,
    tracking_uri: str | None = None,
    gpus: int | None = None,
    grace_s: float = 5.0,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun and its ranks inherit (``base``: default os.environ)."""
    nproc = resolve_ranks(config.train, gpus).nproc_per_node
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"  # ranks write to files under --tee: without this, lines arrive in 8 KiB blocks
    # torchrun would silently force 1 thread per rank; give each local rank its share of the cores instead.
    env["OMP_NUM_THREADS"] = str(config.train.num_threads or max(1, available_cores() // nproc))
    # torchrun's own @record copies the root-cause rank's error file here when the rank used @record.
    env["TORCHELASTIC_ERROR_FILE"] = str(Path(run_dir) / ERROR_FILE)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(max(1, grace_s)))  # torchrun's own TERM -> KILL wait for ranks
    # A signal to torchrun itself goes on to the ranks (they save and stop: training/loop/preemption.py), also
    # train.preempt_signal, which would otherwise end torchrun on the spot (torchrun's --signals-to-handle).
    extra = [config.train.preempt_signal] if config.train.preempt_signal else []
    env["PET_SIGNALS_TO_HANDLE"] = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *extra]))
    # torchrun 2.13 shares one TCP store across restarts, so a restarted rank can read a dead peer's address and
    # fail or hang in gloo's connectFullMesh (pytorch/pytorch#135712; a user's script that calls
    # init_process_group itself meets it on one node too). A fresh store per round avoids it. Only where torchrun
    # can restart: rank 0 hosting a store of its own adds about 0.6 s to the ranks' start (docs/benchmarks.md,
    # Launch latency), and a launch without restarts (batch scoring's) has no second round to isolate.
    if config.train.max_restarts > 0:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    # The rank imports training.* (a script, ddpflow): make sure the project is importable whatever the cwd.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    if config.train.script:  # how ddpflow's API in a user's script finds its run (ddpflow/script/run.py)
        env[JOB_ENV] = str(run_file(run_dir, TRAIN_JOB))
    return env


def rank_workdir(config: PipelineConfig) -> Path:
    """Where the ranks start: a user's script where the run was started (its relative paths mean what they mean
    under a bare torchrun there), ddpflow's own ranks in the project root."""
    return Path.cwd() if config.train.script else PROJECT_ROOT
