"""Helpers for launcher tests: the dummy-rank argv and tiny manifests (imported by path: tests are not a package)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from ddpflow.launch.command import RANK_ENTRYPOINT, torchrun_command
from training.core.config import PipelineConfig
from training.core.manifest import Manifest, ShardInfo, SplitInfo, write_manifest

DUMMY_RANK = Path(__file__).parent / "dummy_rank.py"


def dummy_rank_argv(run_dir: Path, *rank_args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    """The real torchrun argv from torchrun_command, with the rank program swapped for the dummy."""
    config = PipelineConfig.model_validate({"train": {"nproc_per_node": nproc, "max_restarts": max_restarts}})
    argv = torchrun_command(config, run_dir / "train_config.json", gpus=0)
    tail = argv.index("-m", 3)  # the "-m training.train --config ..." after torchrun's options
    assert argv[tail + 1] == RANK_ENTRYPOINT
    return [*argv[:tail], str(DUMMY_RANK), *rank_args]


def make_manifest(dataset_dir: Path, train_rows: int = 1000) -> Path:
    """A manifest.json only (no shards): enough for preflight's row counts."""
    dataset_dir.mkdir(parents=True, exist_ok=True)
    splits = {
        name: SplitInfo(rows=rows, shards=[ShardInfo(file=f"{name}/part-00000.parquet", rows=rows, bytes=1)])
        for name, rows in (("train", train_rows), ("val", 10), ("test", 10))
    }
    manifest = Manifest(
        fingerprint=dataset_dir.name, source="synthetic://test", task="classification", label="label", key=None,
        features=["f0", "f1"], label_mapping=[0, 1], feature_mean=[0.0, 0.0], feature_std=[1.0, 1.0], splits=splits,
        schema=[], config={}, created_at="2026-01-01T00:00:00Z", versions={},
    )  # fmt: skip
    write_manifest(dataset_dir, manifest)
    return dataset_dir


def still_alive(pids: list[int], within_s: float = 30) -> list[int]:
    """The PIDs still running (zombies count as gone) after waiting up to within_s."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
