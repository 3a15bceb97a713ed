"""The coverage certificate: each epoch trained every row of the train split exactly once.

Every rank tallies the rows it trains (``CoverageTally.add``, per batch, padding excluded): how many, and an
order-independent hash of which, ``Σ splitmix64(row)`` mod 2^64. The ranks all-reduce the tally; the
epoch's certificate must equal the one of rows ``0 .. n-1`` of the manifest's train split (the row ids the
sampler draws: positions in the split's shard order, which is what every rank indexes; not the optional
``data.key`` column, which a split need not have). A row skipped and another trained twice keeps the count
and changes the hash (up to a 2^-64 accident).

The sum mod 2^64 is carried exactly in two int64 lanes, the high and the low 32 bits of each row's hash
summed separately: no lane overflows below 2^31 rows per epoch, and any backend sums int64 exactly, where
float64 would round beyond 2^53.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK32 = np.uint64(0xFFFFFFFF)
_CHUNK = 1 << 20  # rows hashed at a time for the expected certificate (8 MiB of uint64)


class CoverageError(RuntimeError):
    """An epoch did not train each row of the train split exactly once."""


def splitmix64(rows: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of each row id (uint64 arithmetic wraps mod 2^64, as the mix wants)."""
    z = rows.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def lanes(rows: np.ndarray) -> tuple[int, int, int]:
    """(rows, Σ high 32 bits, Σ low 32 bits) of the rows' hashes: the tally of a set of rows."""
    mixed = splitmix64(rows)
    return len(rows), int((mixed >> np.uint64(32)).sum(dtype=np.uint64)), int((mixed & _MASK32).sum(dtype=np.uint64))


@dataclass(frozen=True)
class Certificate:
    """An epoch's coverage: the rows trained and their hash (mod 2^64), from the all-reduced lanes."""

    rows: int
    hash: int

    @classmethod
    def from_lanes(cls, rows: int, high: int, low: int) -> Certificate:
        return cls(int(rows), ((int(high) << 32) + int(low)) % (1 << 64))

    @classmethod
    def expected(cls, n_rows: int) -> Certificate:
        """The certificate of rows 0 .. n_rows-1 (the whole train split), hashed in chunks."""
        high = low = 0
        for first in range(0, n_rows, _CHUNK):
            _, h, lo = lanes(np.arange(first, min(n_rows, first + _CHUNK), dtype=np.uint64))
            high, low = high + h, low + lo
        return cls.from_lanes(n_rows, high, low)

    def metrics(self) -> dict[str, int]:
        """Per-epoch metrics: numbers that MLflow holds exactly (32-bit halves of the hash, not one float)."""
        high, low = divmod(self.hash, 1 << 32)
        return {"coverage_rows": self.rows, "coverage_hash_hi": high, "coverage_hash_lo": low}

    def check(self, expected: Certificate, epoch: int) -> None:
        if self != expected:
            raise CoverageError(
                f"epoch {epoch}: the coverage certificate is {self.rows} rows, hash {self.hash:016x}; the train "
                f"split's is {expected.rows} rows, hash {expected.hash:016x}: the epoch did not train each row "
                "exactly once (a sampler or resume bug)"
            )


class CoverageTally:
    """One rank's running tally of an epoch (rows, high lane, low lane); a resumed pass starts from the
    checkpoint's all-reduced tally of the steps before it (on rank 0 only, so the sum counts it once)."""

    def __init__(self) -> None:
        self.rows = self.high = self.low = 0

    def start(self, carried: tuple[int, int, int] | None = None) -> None:
        self.rows, self.high, self.low = carried or (0, 0, 0)

    def add(self, indices: torch.Tensor) -> None:
        rows, high, low = lanes(indices.numpy())
        self.rows, self.high, self.low = self.rows + rows, self.high + high, self.low + low

    def totals(self) -> list[int]:
        return [self.rows, self.high, self.low]
