"""The stream's order of an epoch: one deterministic global order of the train rows from (seed, epoch) alone.

Each epoch the split's shards are shuffled and cut into windows of ``data.shuffle_window`` shards, in that order;
the rows of one window are shuffled together; the epoch's order is the windows' rows one window after another::

    shard order   = permutation of the S shards            (seed, epoch)
    window j      = shards shard_order[j*k : (j+1)*k]      k = data.shuffle_window
    window j rows = its shards' rows, shard after shard, permuted   (seed, epoch, j)
    global order  = window 0's rows, then window 1's, ...

A row's id is its position in the manifest's split, in shard order (what the coverage certificate counts and the
node cache indexes). Nothing depends on the world size, so the stream cuts this one order into the per-rank slices
the node cache's sampler uses (rank r takes positions r, r + W, ...: training/loading/batches.py,
``global_positions_of_steps``), and W ranks x b rows train the rows of one rank x W*b. A reader needs only the
window a position falls in: the windows' row ranges are known from the manifest's row counts, and a window's
permutation is drawn when that window is read, so the order costs memory for one window, not the split.

The permutations come from numpy's PCG64 seeded by a ``SeedSequence`` of (seed, epoch, stream), stream 0 for the
shards and 1 + j for window j: the same numbers on every rank and machine of one numpy version.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SEED_MASK = (1 << 64) - 1  # SeedSequence takes non-negative integers: a negative train.seed wraps


def _generator(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & _SEED_MASK, epoch, stream])))


class StreamOrder:
    """The global order of one epoch over shards of ``shard_rows`` rows (the manifest's, in split order)."""

    def __init__(self, shard_rows: Sequence[int], window: int, seed: int, epoch: int):
        if window < 1:
            raise ValueError(f"data.shuffle_window must be at least 1, got {window}")
        self.seed, self.epoch = seed, epoch
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.shard_first = np.concatenate([[0], np.cumsum(self.shard_rows)[:-1]]).astype(np.int64)
        shuffled = _generator(seed, epoch, 0).permutation(len(self.shard_rows))
        self.windows: list[tuple[int, ...]] = [
            tuple(int(s) for s in shuffled[i : i + window]) for i in range(0, len(shuffled), window)
        ]
        window_rows = [int(self.shard_rows[list(shards)].sum()) for shards in self.windows]
        # starts[j]: the global position of window j's first row; starts[-1]: the split's rows.
        self.starts = np.concatenate([[0], np.cumsum(window_rows)]).astype(np.int64)

    @property
    def rows(self) -> int:
        return int(self.starts[-1])

    def __len__(self) -> int:
        return len(self.windows)

    def window_of(self, positions: np.ndarray | int) -> np.ndarray:
        """The window each global position (0 <= p < rows) falls in."""
        return np.searchsorted(self.starts, positions, side="right") - 1

    def row_ids(self, j: int) -> np.ndarray:
        """Window j's row ids as its shards hold them, shard after shard (the order its rows are read in)."""
        shards = self.windows[j]
        return np.concatenate(
            [np.arange(self.shard_first[s], self.shard_first[s] + self.shard_rows[s]) for s in shards]
            or [np.empty(0, np.int64)]
        ).astype(np.int64)

    def shuffle(self, j: int) -> np.ndarray:
        """Window j's permutation: its k-th position holds the row at index ``shuffle(j)[k]`` of ``row_ids(j)``."""
        return _generator(self.seed, self.epoch, 1 + j).permutation(int(self.starts[j + 1] - self.starts[j]))

    def window_order(self, j: int) -> np.ndarray:
        """Window j's rows (ids) in the epoch's order: global positions ``starts[j] ..`` hold them."""
        return self.row_ids(j)[self.shuffle(j)]

    def order(self) -> np.ndarray:
        """The whole epoch's order of row ids (8 bytes a row: for tests and small splits, not what a rank holds)."""
        return np.concatenate([self.window_order(j) for j in range(len(self))] or [np.empty(0, np.int64)])
