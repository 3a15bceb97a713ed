"""The ddpflow stage entry points the benchmarks drive, in one place.

Benchmarks call the stages (prepare, load, training loop, evaluate, launch)
only through these functions, so that when a stage's API moves only this file
changes. The foundation contracts (config, manifest, models, job, synthetic
data) are imported directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def load_split(dataset_dir: str | Path, split: str):
    """ddpflow's preallocated load of a split (``training.loading.batches.load_split``)."""
    from training.core.manifest import read_manifest
    from training.loading.batches import load_split as ddpflow_load_split

    return ddpflow_load_split(dataset_dir, read_manifest(dataset_dir), split)


def load_train_split(dataset_dir: str | Path):
    return load_split(dataset_dir, "train")


def node_splits(dataset_dir: str | Path, splits=("train", "val"), cache_dir: str | Path | None = None):
    """Splits the way every rank gets them (``training.loading.node_cache.open_splits``): mapped from the node
    cache, built there first when missing (in the rank or the builder child: ``builds_in_rank``).
    Split name -> ``CachedSplit`` (``.tensors``, ``.how``, ``.seconds``)."""
    from training.core.manifest import read_manifest
    from training.loading.node_cache import open_splits

    return open_splits(dataset_dir, read_manifest(dataset_dir), splits, None if cache_dir is None else str(cache_dir))


def build_node_cache_file(dataset_dir: str | Path, split: str, cache_dir: str | Path) -> Path:
    """What the node cache's builder process does for one split (``training.loading.node_cache._build``: the file
    sized up front, mapped, filled record batch by record batch, published atomically), in THIS process."""
    from training.core.manifest import read_manifest
    from training.loading.node_cache import _build, _expected_header, cache_path

    manifest, cache_dir = read_manifest(dataset_dir), str(cache_dir)
    path = cache_path(dataset_dir, manifest, split, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _build(dataset_dir, manifest, split, path, _expected_header(manifest, split), cache_dir)
    return path


def record_batch_bytes(dataset_dir: str | Path, split: str) -> int:
    """Arrow bytes of one record batch as the loader reads the split's shards (``fill_split``'s ``read_rows``
    rows of the columns its inputs, label and weight need), from the first shard."""
    import inspect

    import pyarrow.parquet as pq

    from training.core.manifest import read_manifest
    from training.kinds.inputs import inputs_from_manifest
    from training.loading.batches import fill_split

    manifest = read_manifest(dataset_dir)
    read_rows = inspect.signature(fill_split).parameters["read_rows"].default
    columns = [*inputs_from_manifest(manifest), manifest.label, *([manifest.weight] if manifest.weight else [])]
    shard = manifest.split_files(dataset_dir, split)[0]
    return next(pq.ParquetFile(shard).iter_batches(batch_size=read_rows, columns=columns)).nbytes


def train_batches(
    split, *, batch: int, rank: int = 0, world_size: int = 1, seed: int = 0, device: str | torch.device = "cpu"
):
    """ddpflow's per-rank batches (``training.loading.batches.TrainBatches``: DistributedSampler, one gather per
    batch)."""
    from training.loading.batches import TrainBatches

    device = torch.device(device)
    return TrainBatches(split, rank, world_size, batch, seed, device, pin_memory=device.type == "cuda")


def on_device(split, device: str | torch.device):
    """The split copied to ``device`` once, as ``train.data_on_device=true`` does (``training.loading.placement``)."""
    from training.loading.placement import place_splits

    placed, _ = place_splits({"train": split}, True, torch.device(device), torch.nn.Module())
    return placed["train"]


def first_rows(split, rows: int):
    """The split's first ``rows`` rows (repeated when it has fewer): a split whose epoch is exactly N steps."""
    from training.loading.batches import SplitTensors

    repeats = -(-rows // len(split))
    features, labels = split.features, split.labels
    if repeats > 1:
        features, labels = features.repeat(repeats, 1), labels.repeat(repeats)
    return SplitTensors(features[:rows], labels[:rows])


def train_epoch(
    model,
    optimizer,
    batches,
    epoch: int,
    *,
    device: str | torch.device = "cpu",
    grad_accum: int = 1,
    bf16: bool = False,
) -> int:
    """ddpflow's training epoch: ``Trainer.run_epoch``'s loop over ``training.loop.step.TrainStep`` (the exact update),
    without the Trainer's validation and hooks; returns the samples trained."""
    from training.loop.step import StepSettings, TrainStep

    device = torch.device(device)
    train_step = TrainStep(
        model, optimizer, None, batches, StepSettings("classification", device, grad_accum, bf16=bf16)
    )
    model.train()
    loss = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device, as a rank does
    samples = 0
    for step, batch in enumerate(batches.epoch(epoch)):
        loss.add_(train_step(step, batch))
        samples += batch.samples
    return samples


@dataclass(frozen=True)
class DdpflowRank:
    """A rank joined and configured by ddpflow's own code, as ``training.train.Trainer`` sets one up."""

    ctx: Any  # training.distributed.context.DistContext
    setup: Any  # training.distributed.process.ProcessSetup: threads, cores, whether it polls for the all-reduce

    def wrap(self, model):
        """``training.distributed.context.wrap_model``: DDP with ddpflow's bucket size, and its polling hook when
        asked."""
        from training.distributed.context import wrap_model

        return wrap_model(model, self.ctx, self.setup.poll_allreduce)


@contextmanager
def ddpflow_rank(overrides: list[str]) -> Iterator[DdpflowRank]:
    """Join the process group and configure this process exactly as every training rank does
    (``training.distributed.context.distributed``, ``training.distributed.process.configure_process``), for ddpflow's
    defaults
    plus ``overrides`` (``train.num_threads=1``, ``train.cpu_poll_allreduce=true``, ...); leave it after."""
    from training.core.config import load_config
    from training.distributed.context import distributed
    from training.distributed.process import configure_process

    train = load_config(None, overrides).train
    with distributed(train) as ctx:
        yield DdpflowRank(ctx, configure_process(train, ctx))


def bucket_cap_mb() -> float:
    """The DDP bucket size ddpflow passes (one bucket for models whose gradients fit)."""
    from training.distributed.context import BUCKET_CAP_MB

    return float(BUCKET_CAP_MB)


def prepare(data_config):
    """``training.prepare.dataset.prepare_dataset`` -> the dataset directory."""
    from training.prepare.dataset import prepare_dataset

    return Path(prepare_dataset(data_config).dataset_dir)


def evaluate(model_path: str | Path, dataset_dir: str | Path, split: str = "test") -> int:
    """``training.inference.evaluate.evaluate_split``; returns the rows scored."""
    from training.inference.evaluate import evaluate_split

    return evaluate_split(model_path, dataset_dir, split).samples


EVALUATE_IN_A_PROCESS = (
    "import sys; from training.inference.evaluate import evaluate_split; "
    "print(evaluate_split(sys.argv[1], sys.argv[2]).metrics)"
)


def launch_training(request, timeout_s: float = 600):
    """The train stage exactly as the Prefect task runs it: ``request`` (a ``ddpflow.launch.stage.TrainRequest``)
    through the launcher its ``train.launcher`` names (local: preflight, job file, torchrun; slurm: preflight,
    job files, sbatch, following), limited to ``timeout_s``. The Slurm commands and SLURM_CONF come from the
    environment. Returns the ``TrainResult``."""
    from dataclasses import replace

    from ddpflow.launch.stage import run_train_stage

    train = request.config.train.model_copy(update={"timeout_s": timeout_s})
    return run_train_stage(replace(request, config=request.config.model_copy(update={"train": train})))


RANK_MODULE = "training.train"  # what every rank runs: python -m training.train --config RUN_DIR/train_config.json


def step_checkpointer(run_dir: str | Path):
    """ddpflow's checkpointer for one process (``training.checkpoint.files.Checkpointer``): ``save_step`` writes a step
    checkpoint in the background, ``wait_for_writes`` joins it."""
    from training.checkpoint.files import Checkpointer
    from training.distributed.context import SingleProcess

    return Checkpointer(run_dir, SingleProcess(), keep_steps=2)


def training_snapshot(model, optimizer) -> dict[str, Any]:
    """The copy a step checkpoint writes, as ``Trainer.state_dict`` takes it (``training.train.on_cpu``, copy)."""
    from training.train import on_cpu

    return {"model": on_cpu(model.state_dict(), copy=True), "optimizer": on_cpu(optimizer.state_dict(), copy=True)}
