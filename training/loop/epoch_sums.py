"""One rank's running sums of the epoch it trains: the weighted loss Σ w·ℓ (a device tensor, so no step waits
on a device->host copy), the rows and the coverage lanes (training/loop/coverage.py).

A resumed epoch starts from its step checkpoint's sums (``carried``: the steps already trained, summed over
all ranks), on rank 0 alone, so the epoch's all-reduce counts them once. ``all_reduced`` is what the epoch's
end reads and what a step checkpoint stores (``epoch_sums``: {"loss", "rows", "coverage"}).
"""

from __future__ import annotations

from typing import Any

import torch

from training.loading.batches import Batch
from training.loop.coverage import CoverageTally


class EpochSums:
    def __init__(self, device: torch.device, carried: dict[str, Any] | None = None):
        carried = carried or {}
        self.loss = torch.tensor(carried.get("loss", 0.0), dtype=torch.float64, device=device)
        self.rows = int(carried.get("rows", 0))
        self.coverage = CoverageTally()  # this rank's rows of the epoch
        self.coverage.start(carried.get("coverage"))

    def add(self, batch: Batch, loss: torch.Tensor) -> None:
        """A trained micro-batch: its rows, their coverage lanes and its weighted loss sum."""
        self.coverage.add(batch.indices)
        self.loss.add_(loss)
        self.rows += batch.samples

    def all_reduced(self, ctx) -> dict[str, Any]:
        """The sums over every rank (collectives: every rank calls it): {"loss", "rows", "coverage"}."""
        loss, rows = ctx.all_reduce_sum([self.loss, self.rows])
        return {"loss": loss, "rows": int(rows), "coverage": ctx.all_reduce_int_sum(self.coverage.totals())}
