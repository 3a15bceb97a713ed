"""Prepared shards -> tensors in memory -> one rank's batches.

A split is read ONCE into tensors allocated up front from the manifest's row
counts, then filled record batch by record batch: peak memory is the tensors
plus one record batch, never a concatenation or a DataFrame copy. Features
(and a regression target) are normalised in place by ``training/normalisation.py``,
the same function evaluation and serving use.

Training batches come from a ``DistributedSampler`` (rank r takes
``perm[r::W]`` of a permutation seeded by ``train.seed`` and the epoch) and
are fetched with ONE tensor index per batch, not row by row: the rank's
epoch order is one tensor, sliced into batches (no Python list of every row).

``global_rows_in_steps`` counts the real rows all ranks train in a run of
steps: the divisor that makes each optimizer step's gradient the mean over the
whole global batch (``training/loop.py``), written next to the sampler rule
it mirrors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from training.data.manifest import Manifest
from training.normalisation import Normaliser


class ShardError(ValueError):
    """A shard does not match its manifest (rows, columns)."""


@dataclass(frozen=True)
class SplitTensors:
    features: torch.Tensor  # [rows, n_features] float32, normalised
    labels: torch.Tensor  # [rows] int64 (classification) or float32 (regression, standardised)

    def __len__(self) -> int:
        return self.features.shape[0]


def label_dtype(task: str) -> torch.dtype:
    return torch.int64 if task == "classification" else torch.float32


def load_split(dataset_dir: str | Path, manifest: Manifest, split: str, read_rows: int = 16_384) -> SplitTensors:
    rows = manifest.rows(split)
    features = torch.empty(rows, manifest.n_features, dtype=torch.float32)
    labels = torch.empty(rows, dtype=label_dtype(manifest.task))
    normaliser = Normaliser.from_manifest(manifest)
    columns = [*manifest.features, manifest.label]
    offset = 0
    for shard, path in zip(manifest.splits[split].shards, manifest.split_files(dataset_dir, split)):
        start = offset
        for batch in _record_batches(path, columns, read_rows):
            stop = offset + batch.num_rows
            if stop > rows:
                raise ShardError(f"{path}: the {split} split holds more rows than the manifest's {rows}")
            # Written through numpy views of the preallocated tensors: no temporaries, dtype cast on copy.
            block = features[offset:stop].numpy()
            for j, name in enumerate(manifest.features):
                block[:, j] = batch.column(name).to_numpy(zero_copy_only=False)
            labels[offset:stop].numpy()[:] = batch.column(manifest.label).to_numpy(zero_copy_only=False)
            normaliser.features_(features[offset:stop])
            normaliser.target_(labels[offset:stop])
            offset = stop
        # Hand the shard's decode buffers back now: the allocator would keep them resident,
        # and the split's peak memory would grow by a shard's worth on top of the tensors.
        pa.default_memory_pool().release_unused()
        if offset - start != shard.rows:
            raise ShardError(f"{path}: holds {offset - start} rows, the manifest says {shard.rows}")
    if offset != rows:
        raise ShardError(f"{dataset_dir}: the {split} split's shards hold {offset} rows, the manifest says {rows}")
    return SplitTensors(features, labels)


def _record_batches(path: Path, columns: list[str], read_rows: int):
    try:
        parquet = pq.ParquetFile(path)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard listed in the manifest does not exist") from None
    missing = [name for name in columns if name not in parquet.schema_arrow.names]
    if missing:
        raise ShardError(f"{path}: lacks columns {missing}")
    return parquet.iter_batches(batch_size=read_rows, columns=columns)


class InMemoryDataset(Dataset):
    """Map-style dataset over in-memory tensors, indexed by a whole batch of row numbers at once."""

    def __init__(self, split: SplitTensors):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # One gather per tensor for the whole batch (index_select: ~3x faster than x[rows] on CPU), where the
        # split lives: on the device (train.data_on_device) only the row numbers cross over; on the CPU .to is a no-op.
        where = rows.to(self.split.features.device, non_blocking=True)
        return rows, self.split.features.index_select(0, where), self.split.labels.index_select(0, where)

    def __getitems__(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self[torch.as_tensor(rows, dtype=torch.int64)]


class RankSampler(DistributedSampler):
    """``DistributedSampler`` (shuffle, seed, ``set_epoch``, padding: unchanged) whose epoch
    order is also available as ONE tensor, so no Python list of every row is built."""

    def rank_indices(self) -> torch.Tensor:
        return self.epoch_order()[self.rank : self.total_size : self.num_replicas]

    def epoch_order(self) -> torch.Tensor:
        """The epoch's padded permutation, the same on every rank: rank r takes positions r, r + W, ..."""
        # The same steps as DistributedSampler.__iter__ (tests/model/test_loading.py checks it).
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = (
            torch.randperm(len(self.dataset), generator=generator) if self.shuffle else torch.arange(len(self.dataset))
        )
        padding = self.total_size - len(order)
        if padding > 0 and not self.drop_last:
            order = torch.cat([order, order.repeat(math.ceil(padding / len(order)))[:padding]])
        return order


def global_rows_in_steps(n_rows: int, world_size: int, batch_size: int, start: int, stop: int) -> int:
    """Real (unpadded) rows that ALL ranks together train in steps ``[start, stop)`` of an epoch.

    ``DistributedSampler(drop_last=False)`` pads the permutation to
    ``W * ceil(n / W)`` entries and gives rank r positions ``r, r + W, ...``, so
    step s of every rank together covers the contiguous padded positions
    ``[s*b*W, min((s+1)*b, ceil(n/W)) * W)``; the real ones are those below n.
    Every rank computes the same number, with no collective.
    """
    first, last = global_positions_of_steps(n_rows, world_size, batch_size, start, stop)
    return last - first


def global_positions_of_steps(n_rows: int, world_size: int, batch_size: int, start: int, stop: int) -> tuple[int, int]:
    """The real positions ``[first, last)`` of the epoch's padded permutation that steps ``[start, stop)`` of
    all ranks train (``global_rows_in_steps``' rule; the rows there are ``epoch_order()[first:last]``)."""
    per_rank = math.ceil(n_rows / world_size)  # DistributedSampler.num_samples
    first = min(start * batch_size, per_rank) * world_size
    last = min(stop * batch_size, per_rank) * world_size
    return min(first, n_rows), max(min(first, n_rows), min(last, n_rows))


class BatchSlices(Sampler):
    """Consecutive slices of this rank's epoch order: one index tensor per batch (the last may be short)."""

    def __init__(self, sampler: RankSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.sampler.rank_indices().split(self.batch_size))


def _batch_as_is(batch):
    # The dataset already returns the stacked batch; nothing to collate.
    return batch


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor  # CPU, the dataset rows this rank trains on (padding excluded)
    features: torch.Tensor  # on the device
    labels: torch.Tensor  # on the device
    weights: torch.Tensor | None  # on the device: the row's weight (1 without), 0 sampler padding; None: all 1
    samples: int  # real rows in the batch


class TrainBatches:
    """One rank's training batches, epoch by epoch.

    ``DistributedSampler`` with ``drop_last=False`` pads the permutation so that
    every rank gets the same number of rows (and so of steps, which DDP needs).
    The padded entries are rows at padded-permutation positions >= ``n_rows``;
    they get weight 0 so every row counts exactly once per epoch.
    """

    def __init__(
        self,
        split: SplitTensors,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        pin_memory: bool,
        row_weights: torch.Tensor | None = None,
    ):
        self.dataset = InMemoryDataset(split)
        # Each train row's loss weight ([rows] float32; None: all 1): its class weight (train.class_weights).
        self.row_weights = None if row_weights is None else row_weights.to("cpu", torch.float32)
        self._weight_before: torch.Tensor | None = None  # this epoch: weight of padded positions [0, p), float64
        self.rank, self.world_size, self.batch_size, self.device = rank, world_size, batch_size, device
        self.sampler = RankSampler(
            self.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        self.loader = DataLoader(
            self.dataset,
            batch_size=None,  # the sampler yields whole batches of row numbers
            sampler=BatchSlices(self.sampler, batch_size),
            collate_fn=_batch_as_is,
            num_workers=0,  # the data is already in memory: workers would only copy it
            pin_memory=pin_memory and device.type == "cuda" and split.features.device.type == "cpu",
        )
        self.padded = len(split) % world_size != 0

    def __len__(self) -> int:
        return len(self.loader)

    def global_rows(self, start: int, stop: int) -> int:
        """Real rows of steps ``[start, stop)`` summed over all ranks (``global_rows_in_steps``)."""
        return global_rows_in_steps(len(self.dataset), self.world_size, self.batch_size, start, stop)

    def global_weight(self, start: int, stop: int) -> float:
        """The weight Σ w_i of the real rows of steps ``[start, stop)`` on all ranks: the exact update's divisor
        (training/loop.py). Every rank computes it from the epoch's permutation, which all ranks share, with no
        collective; ``global_rows`` when every row weighs 1."""
        if self._weight_before is None:
            return float(self.global_rows(start, stop))
        first, last = global_positions_of_steps(len(self.dataset), self.world_size, self.batch_size, start, stop)
        return float(self._weight_before[last] - self._weight_before[first])

    def epoch(self, epoch: int) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
        if self.row_weights is not None:
            order = self.sampler.epoch_order()[: len(self.dataset)]  # the real positions
            in_order = self.row_weights.index_select(0, order).double()
            self._weight_before = torch.cat([torch.zeros(1, dtype=torch.float64), in_order.cumsum(0)])
        for step, (indices, features, labels) in enumerate(self.loader):
            real = self._real_rows(step, len(indices))
            yield Batch(
                indices=indices if real is None else indices[real],
                features=features.to(self.device, non_blocking=True),
                labels=labels.to(self.device, non_blocking=True),
                weights=self._weights(indices, real),
                samples=len(indices) if real is None else int(real.sum()),
            )

    def _weights(self, indices: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor | None:
        """The batch's row weights times its padding mask (None: every row weighs 1)."""
        if self.row_weights is None:
            return None if real is None else real.to(self.device, torch.float32, non_blocking=True)
        weights = self.row_weights.index_select(0, indices)
        if real is not None:
            weights = weights * real
        return weights.to(self.device, non_blocking=True)

    def _real_rows(self, step: int, size: int) -> torch.Tensor | None:
        if not self.padded:
            return None
        # DistributedSampler: rank r's j-th row is padded-permutation position r + j * W.
        first = step * self.batch_size
        positions = self.rank + self.world_size * torch.arange(first, first + size)
        return positions < len(self.dataset)
