"""The torchrun command line and the environment its ranks inherit (plain Python, no Prefect).

    argv = torchrun_command(config, run_dir / "train_config.json", gpus=2)
    env = launch_env(config, run_dir, tracking_uri=uri, gpus=2, grace_s=10)

How many ranks and which backend: training/core/topology.py (``resolve_ranks``), the one
rule that the preflight, the ranks and the MLflow tags use too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from training.core.config import PipelineConfig
from training.core.topology import available_cores, resolve_ranks

LOG_DIR = "logs"  # RUN_DIR/logs/<torchrun job>/attempt_<n>/<local rank>/{stdout,stderr}.log
ERROR_FILE = "error.json"  # torchrun's @record copies the root-cause rank's error here
RANK_ENTRYPOINT = "training.train"  # what every rank runs; tests point it at a stand-in script
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # where `training` imports from, whatever the caller's cwd


def torchrun_command(
    config: PipelineConfig, job_path: str | os.PathLike, *, gpus: int | None = None, entrypoint: str | None = None
) -> list[str]:
    """The torchrun argv, as a list (never a shell string). Logs go to ``<job dir>/logs``. ``entrypoint``: the
    module every rank runs (default ``RANK_ENTRYPOINT``, training; batch scoring passes its own)."""
    train = config.train
    layout = resolve_ranks(train, gpus)
    job_path = Path(job_path)
    argv = [sys.executable, "-m", "torch.distributed.run"]
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
    # A module runs as "-m module"; a path (tests' stand-in ranks) runs as a script.
    module = entrypoint or RANK_ENTRYPOINT
    entry = [module] if module.endswith(".py") else ["-m", module]
    return [*argv, *entry, "--config", str(job_path)]


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
    # torchrun 2.13 shares one TCP store across restarts, so a restarted rank can read a dead peer's
    # address and hang in gloo's connectFullMesh (pytorch/pytorch#135712). A fresh store per round avoids it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    # The rank imports training.* : make sure the project is importable whatever the caller's cwd.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return env
