"""Ragged sections of the node cache: rows of different lengths as ``values`` plus int64 ``offsets``.

Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``; ``offsets`` has ``rows + 1`` entries, the first 0. No
tabular kind is ragged; token ids (text) and encoded image bytes are, and their sections use this layout:
two fixed-width arrays a file can hold and every local rank can map, gathered with one index per batch.

    ragged = RaggedArray.from_rows([[1, 2], [], [3]])
    values, offsets = ragged.gather(torch.tensor([2, 0]))   # the rows [3] and [1, 2], packed again

A ragged input's codec (training/kinds/registry.py: ``ragged_dtype`` set) stores its rows so and turns gathered
rows into batch-dict entries with ``collate(values, offsets, BatchContext(...))``: in training (inside the
DataLoader's workers when there are any), in validation, evaluation and serving alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchContext:
    """What a ragged codec's ``collate`` may depend on besides the rows' values.

    A random transform (image augmentation) is a function of (``seed``, ``epoch``, row) only, never of the rank,
    the worker or the batch a row lands in: so a row gets the same view at any world size and worker count."""

    rows: torch.Tensor  # int64 [B]: the split's row numbers of the batch, in batch order
    epoch: int = 0
    seed: int = 0  # train.seed
    train: bool = False  # True: the training transform (augmentation); False: the deterministic one


def evaluation_context(rows: torch.Tensor) -> BatchContext:
    """Validation, evaluation and serving: the deterministic transform, whatever the epoch."""
    return BatchContext(rows=rows, train=False)


@dataclass(frozen=True)
class RaggedArray:
    values: torch.Tensor  # [total values, *value shape]
    offsets: torch.Tensor  # [rows + 1] int64, non-decreasing, offsets[0] == 0, offsets[-1] == len(values)

    def __post_init__(self) -> None:
        if self.offsets.dtype != torch.int64 or self.offsets.ndim != 1 or len(self.offsets) == 0:
            raise ValueError("offsets must be a 1-d int64 tensor of rows + 1 entries")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != len(self.values):
            raise ValueError(
                f"offsets must run from 0 to the {len(self.values)} values, not {int(self.offsets[0])} to "
                f"{int(self.offsets[-1])}"
            )

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence], dtype: torch.dtype = torch.int64) -> RaggedArray:
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, dim=0, out=offsets[1:])
        flat = [value for row in rows for value in row]
        return cls(torch.tensor(flat, dtype=dtype), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, index: int) -> torch.Tensor:
        return self.values[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``rows`` packed in their order: (values, offsets of rows + 1), with one index over the values."""
        starts, lengths = self.offsets[rows], self.lengths()[rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, dim=0, out=offsets[1:])
        # Each packed value's source position: its row's start plus its place within the row.
        row_of_value = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        within = torch.arange(int(offsets[-1])) - offsets[:-1][row_of_value]
        return self.values.index_select(0, starts[row_of_value] + within), offsets

    def section_bytes(self) -> dict[str, int]:
        """Bytes of the two fixed-width sections a node cache file holds for it."""
        return {
            "values": self.values.numel() * self.values.element_size(),
            "offsets": self.offsets.numel() * self.offsets.element_size(),
        }
