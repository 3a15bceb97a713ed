"""The small pipeline workload: a whole run's config on a small synthetic dataset, where fixed costs (launch,
orchestration, memory of a real run) are the point, and the no-op rank that a bare torchrun is timed with."""

from __future__ import annotations

from pathlib import Path

from bench import ddpflow_api
from bench.harness.context import Context
from bench.workloads.tabular import BATCH, synthetic_url

NOOP_RANK = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print("ranks ready", flush=True)
dist.destroy_process_group()
"""
FIRST_STEP = "step 1/"  # rank 0's progress line after its first step (progress_interval_s is tiny)


def small_config(ctx: Context, root: Path, **train):
    """The whole pipeline's config on the small synthetic dataset (``Sizes.orchestration_rows``): 1 epoch, 2 ranks,
    MLflow on SQLite under ``root``; ``train`` overrides ``train.*``."""
    rows = ctx.sizes.orchestration_rows
    return ddpflow_api.pipeline_config(
        {
            "data": {"source": synthetic_url(rows), "root": str(ctx.workdir / "small-shards")},
            "train": {
                "epochs": 1,
                "batch_size": BATCH,
                "nproc_per_node": 2,
                "run_root": str(root / "runs"),
                "max_restarts": 0,
                **train,
            },
            "mlflow": {
                "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                "artifact_location": (root / "mlartifacts").as_uri(),
                "experiment": "bench",
            },
            "registry": {"model_name": "bench-model"},
        }
    )


def small_dataset(ctx: Context) -> Path:
    """``small_config``'s dataset, prepared once per run."""
    return ctx.cached("small-dataset", lambda: ddpflow_api.prepare(small_config(ctx, ctx.workdir).data))
