"""The ddpflow entry points the benchmarks drive, in one place.

Benchmarks call ddpflow only through these functions, so that when a stage's
API moves only this file changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def load_train_split(dataset_dir: str | Path):
    """ddpflow's preallocated load of the train split (``training.loading.load_split``)."""
    from training.data.manifest import read_manifest
    from training.loading import load_split

    return load_split(dataset_dir, read_manifest(dataset_dir), "train")


def open_train_loader(
    dataset_dir: str | Path, *, batch: int, rank: int = 0, world_size: int = 1, seed: int = 0, device: str | torch.device = "cpu"
) -> Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """One rank's batches as ddpflow's training loop gets them; each call starts the next epoch."""
    from training.loading import TrainBatches

    split = load_train_split(dataset_dir)
    device = torch.device(device)
    batches = TrainBatches(split, rank, world_size, batch, seed, device, pin_memory=device.type == "cuda")
    epochs = itertools.count()

    def epoch() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in batches.epoch(next(epochs)):
            yield step.features, step.labels

    return epoch


def prepare(data_config):
    """``training.data.prepare.prepare_dataset`` -> the dataset directory."""
    from training.data.prepare import prepare_dataset

    return Path(prepare_dataset(data_config).dataset_dir)
