"""The ways of feeding the same training step that the benchmarks compare.

- ``presliced``: the compute limit; batches cut in advance, the loop only indexes a list.
- ``shuffled_gather``: the least a loader of a shuffled epoch does: a fresh permutation, one gather a batch.
- ``per_row``: a map-style Dataset returning one row, DataLoader(shuffle=True) collating 512 of them.
- ``batch_sampler``: the Dataset takes a list of indices (BatchSampler), one gather per batch.
- ``pandas_rows``: the plain way a user writes it: per-row Dataset over a pandas DataFrame.

Each factory returns a function that starts one epoch (an iterator of (x, y)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

Epoch = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def presliced(x: torch.Tensor, y: torch.Tensor, batch: int, batches: int, seed: int = 0) -> Epoch:
    """``batches`` ready-made contiguous batches of shuffled rows: no loader work at all."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=generator)[: batch * batches]
    xs = [chunk.contiguous() for chunk in x[order].split(batch)]
    ys = [chunk.contiguous() for chunk in y[order].split(batch)]
    return lambda: iter(zip(xs, ys))


def shuffled_gather(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int = 0) -> Epoch:
    """A fresh permutation of the rows each epoch, and one ``index_select`` of a batch's rows from ``x`` and ``y``:
    what any in-memory loader must do to shuffle every epoch, and nothing else (its floor)."""
    generator = torch.Generator().manual_seed(seed)

    def epoch() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(y), generator=generator)
        for rows in order[: len(y) // batch * batch].split(batch):
            yield x.index_select(0, rows), y.index_select(0, rows)

    return epoch


class RowDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def per_row(x: torch.Tensor, y: torch.Tensor, batch: int) -> Epoch:
    loader = DataLoader(RowDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
    return lambda: iter(loader)


class IndexBatchDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, indices: list[int]):
        index = torch.as_tensor(indices)
        return self.x[index], self.y[index]


def batch_sampler(x: torch.Tensor, y: torch.Tensor, batch: int) -> Epoch:
    dataset = IndexBatchDataset(x, y)
    sampler = BatchSampler(RandomSampler(dataset), batch_size=batch, drop_last=True)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None)
    return lambda: iter(loader)


class PandasRowDataset(Dataset):
    """What a user writes first: one DataFrame row per item, converted to tensors."""

    def __init__(self, frame, features: list[str], label: str):
        self.frame, self.features, self.label = frame, features, label

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, index: int):
        row = self.frame.iloc[index]
        x = torch.tensor(row[self.features].to_numpy(dtype="float32"))
        return x, torch.tensor(int(row[self.label]))


def pandas_rows(frame, features: list[str], label: str, batch: int, sampler=None) -> Epoch:
    dataset = PandasRowDataset(frame, features, label)
    loader = DataLoader(dataset, batch_size=batch, shuffle=sampler is None, sampler=sampler, drop_last=True)

    def epoch():
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(getattr(epoch, "count", 0))
        epoch.count = getattr(epoch, "count", 0) + 1
        return iter(loader)

    return epoch
