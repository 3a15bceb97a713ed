"""What one rank counts and records as it trains, and nothing more: which micro-batches form an optimizer step
(``OptimizerSteps``), the epoch's running sums and its coverage certificate (``EpochSums``, ``Certificate``), rank
0's progress lines (``Progress``), its per-step curves (``StepMetricsSink``, steps.jsonl) and its per-epoch record
(``MetricsSink``, metrics.jsonl). The loop that feeds them is ``EpochPass`` (training/loop/step.py); the Trainer
(training/train.py) checks the certificate and writes the epoch's line.

Two counts, two words: an epoch is ``micro_batches`` micro-batches (this rank's batches of ``TrainBatches``)
and ``optimizer_steps`` optimizer steps. The one rule between them (``train.grad_accum``): optimizer step k is
micro-batches ``[k * grad_accum, (k + 1) * grad_accum)``, the last one short when ``grad_accum`` does not
divide the epoch. ``steps_optimizer(i)`` says whether micro-batch i ends its optimizer step (``TrainStep``
all-reduces and updates there); ``boundary(i)`` whether it ends one before the epoch's last, where a step
checkpoint or a stop may come (the epoch's end has last.pt). The learning-rate schedule, the step checkpoints'
``train.checkpoint_every_steps`` and the step curves count optimizer steps; the progress lines, micro-batches.

``EpochSums``: the weighted loss Σ w·ℓ (a device tensor, so no step waits on a device->host copy), the rows
and the coverage lanes (``CoverageTally``). A resumed epoch starts from its step checkpoint's sums
(``carried``: the micro-batches already trained, summed over all ranks), on rank 0 alone, so the epoch's
all-reduce counts them once. ``all_reduced`` is what the epoch's end reads and what a step checkpoint stores
(``epoch_sums``: {"loss", "rows", "coverage"}).

The coverage certificate: each epoch trained every row of the train split exactly once. Every rank tallies the
rows it trains (``CoverageTally.add``, per batch, padding excluded): how many, and an order-independent hash of
which, ``Σ splitmix64(row)`` mod 2^64. The ranks all-reduce the tally; the epoch's ``Certificate`` must equal
the one of rows ``0 .. n-1`` of the manifest's train split (the row ids the sampler draws: positions in the
split's shard order, which is what every rank indexes; not the optional ``data.key`` column, which a split need
not have). A row skipped and another trained twice keeps the count and changes the hash (up to a 2^-64
accident). The sum mod 2^64 is carried exactly in two int64 lanes, the high and the low 32 bits of each row's
hash summed separately: no lane overflows below 2^31 rows per epoch, and any backend sums int64 exactly, where
float64 would round beyond 2^53. Batch scoring certifies its rows the same way
(training/inference/batch_scoring.py).

``Progress``: at most one line every ``train.progress_interval_s``, plus one per epoch. The loss shown
mid-epoch is rank 0's own running mean (no collective just to print); samples/s is rank 0's rate times the
world size. The epoch line shows the exact, all-rank metrics.

The records are files, and the files are the record: ranks never talk to MLflow. ``MetricsSink``:
``RUN_DIR/metrics.jsonl``, one JSON object per epoch (rank 0); the process that launched torchrun follows it
and mirrors each epoch into the pipeline's MLflow run (ddpflow/tracking/metrics.py: ``EpochMetricsFollower``),
reading it with training/core/fileio.py's ``read_metrics_lines``, so the rank and the mirror read the file one
way. ``StepMetricsSink``: ``RUN_DIR/steps.jsonl``, one line every ``train.log_every_steps`` optimizer steps
(rank 0), its keys training/core/layout.py's (``STEP_KEY``, ``STEP_CURVES``). It costs no collective and no
device sync of its own: it uses the loss sum and gradient norm ``TrainStep`` copies to the host anyway
(``StepReport``, its report of an optimizer step). The loss is rank 0's own (its rows of the steps since the
last line, like the progress lines); the gradient norm is over all ranks (after the all-reduce), the mean of
those steps; the lr is the logged step's. Each line is flushed and fsynced (training/core/fileio.py:
``append_line``), and a resumed run (torchrun restart, task retry) writes no epoch and no step twice: each sink
remembers what its file holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from training.core.fileio import append_line, log_rank, read_metrics_lines
from training.core.layout import METRICS, STEP_CURVES, STEP_KEY, STEP_METRICS

if TYPE_CHECKING:
    from training.loading.batches import Batch

_EPOCH_KEYS = ("train_loss", "val_loss", "val_accuracy", "val_rmse")
_MASK32 = np.uint64(0xFFFFFFFF)
_CHUNK = 1 << 20  # rows hashed at a time for the expected certificate (8 MiB of uint64)


@dataclass(frozen=True)
class OptimizerSteps:
    """How an epoch of ``micro_batches`` micro-batches is cut into optimizer steps of ``grad_accum`` each."""

    grad_accum: int
    micro_batches: int  # in one epoch, this rank's

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in one epoch."""
        return -(-self.micro_batches // self.grad_accum)

    def group(self, index: int) -> range:
        """The micro-batches ``[first, stop)`` of micro-batch ``index``'s optimizer step."""
        first = (index // self.grad_accum) * self.grad_accum
        return range(first, min(first + self.grad_accum, self.micro_batches))

    def steps_optimizer(self, index: int) -> bool:
        """Whether micro-batch ``index`` is the last of its optimizer step: the one that all-reduces and updates."""
        return index == self.group(index)[-1]

    def boundary(self, index: int) -> bool:
        """Whether micro-batch ``index`` ends an optimizer step before the epoch's last: where the ranks may stop
        or write a step checkpoint between two optimizer steps."""
        return self.steps_optimizer(index) and index + 1 < self.micro_batches

    def step_of(self, index: int) -> int:
        """The optimizer step (0-based, in its epoch) micro-batch ``index`` belongs to."""
        return index // self.grad_accum

    def run_steps(self, epoch: int, index: int) -> int:
        """Optimizer steps of the run done once micro-batch ``index`` of ``epoch`` (0-based) ends its step."""
        return steps_of_run(epoch, self.optimizer_steps, self.step_of(index))


def steps_of_run(epoch: int, optimizer_steps: int, step: int) -> int:
    """Optimizer steps of the run done once optimizer step ``step`` (0-based) of ``epoch`` ends, at
    ``optimizer_steps`` an epoch: the run's step count of step checkpoints and steps.jsonl."""
    return epoch * optimizer_steps + step + 1


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


class EpochSums:
    """One rank's running sums of the epoch it trains (module docstring)."""

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


def _eta(seconds: float) -> str:
    return str(timedelta(seconds=max(0, int(seconds))))


class Progress:
    """Rank 0's progress lines (module docstring); losses times ``loss_scale`` (the target's own scale)."""

    def __init__(
        self, enabled: bool, interval_s: float, epochs: int, micro_batches: int, world_size: int, loss_scale: float
    ):
        self.enabled, self.interval_s = enabled, interval_s
        self.epochs, self.micro_batches, self.world_size = epochs, micro_batches, world_size
        self.loss_scale = loss_scale
        self.epoch = 0
        self.started = self.last_print = time.monotonic()

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.started = self.last_print = time.monotonic()

    def step(self, done: int, sums: EpochSums) -> None:
        """After micro-batch ``done - 1``; the loss is only read (a device sync) when a line is printed."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last_print < self.interval_s:
            return
        self.last_print = now
        elapsed = now - self.started
        remaining = (self.micro_batches - done) + self.micro_batches * (self.epochs - self.epoch - 1)
        rate = sums.rows * self.world_size / max(elapsed, 1e-9)
        loss = self.loss_scale * sums.loss.item() / max(1, sums.rows)
        log_rank(
            f"epoch {self.epoch + 1}/{self.epochs} step {done}/{self.micro_batches} "
            f"loss {loss:.4f} {rate:,.0f} samples/s ETA {_eta(elapsed / max(1, done) * remaining)}"
        )

    def end_epoch(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        remaining_epochs = self.epochs - self.epoch - 1
        shown = " ".join(f"{key} {metrics[key]:.4f}" for key in _EPOCH_KEYS if key in metrics)
        if "selected_epoch" in metrics:  # counted from 1, as this line counts epochs (training/loop/selection.py)
            shown += f" selected epoch {metrics['selected_epoch'] + 1}"
        log_rank(
            f"epoch {self.epoch + 1}/{self.epochs} done: {shown} {metrics['train_samples_per_s']:,.0f} samples/s "
            f"{metrics['epoch_seconds']:.1f}s ETA {_eta(metrics['epoch_seconds'] * remaining_epochs)}"
        )


class MetricsSink:
    """Appends each epoch to metrics.jsonl (rank 0 only: ``enabled``), fsynced, at most once per epoch."""

    def __init__(self, run_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.logged = {record.get("epoch") for record in read_metrics_lines(self.path)} if enabled else set()

    def log_epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        if not self.enabled or epoch in self.logged:
            return
        self._append({"epoch": epoch, **metrics})
        self.logged.add(epoch)

    def _append(self, record: dict[str, Any]) -> None:
        append_line(self.path, record)


@dataclass(frozen=True)
class StepReport:
    """One optimizer step on this rank: its index in the epoch, loss sum Σ w·ℓ and real rows, gradient norm, lr,
    and the weight Σ w of its real rows (the rows without data.weight or class weights; None: the rows)."""

    index: int
    loss_sum: float
    rows: int
    grad_norm: float
    lr: float
    weight: float | None = None


class StepMetricsSink:
    """Appends a line to steps.jsonl every ``every`` optimizer steps (rank 0 only; ``every`` None: never)."""

    def __init__(
        self, run_dir: str | Path, enabled: bool, every: int | None, optimizer_steps: int, loss_scale: float = 1.0
    ):
        self.enabled = enabled and every is not None
        self.every, self.optimizer_steps, self.loss_scale = every, optimizer_steps, loss_scale
        self.path = Path(run_dir) / STEP_METRICS
        lines = read_metrics_lines(self.path) if self.enabled else []
        self.logged_through = max((line.get(STEP_KEY, 0) for line in lines), default=0)
        self.epoch = 0  # the epoch being trained (``start_epoch``): ``add_step`` reports in it
        self._window()

    def _window(self) -> None:
        self.loss_sum, self.weight, self.norm_sum, self.count = 0.0, 0.0, 0.0, 0

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def add_step(self, report: StepReport) -> None:
        """``TrainStep``'s report of an optimizer step of the current epoch."""
        self.add(self.epoch, report)

    def add(self, epoch: int, report: StepReport) -> None:
        if not self.enabled:
            return
        step = steps_of_run(epoch, self.optimizer_steps, report.index)
        # Σ w·ℓ / Σ w, the weighted mean the step optimises (a report without a weight: its rows weigh 1).
        weight = report.rows if report.weight is None else report.weight
        self.loss_sum, self.weight = self.loss_sum + report.loss_sum, self.weight + weight
        self.norm_sum, self.count = self.norm_sum + report.grad_norm, self.count + 1
        if step % self.every or step <= self.logged_through:
            return
        loss, lr, norm = STEP_CURVES
        record = {STEP_KEY: step, "epoch": epoch, lr: report.lr, norm: self.norm_sum / self.count}
        if self.weight:
            record[loss] = self.loss_scale * (self.loss_sum / self.weight)
        append_line(self.path, record)
        self.logged_through = step
        self._window()
