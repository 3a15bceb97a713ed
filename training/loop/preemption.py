"""Preemption in the ranks: told to stop, every rank saves at the same optimizer step and exits, resumable.

    watch = PreemptionWatch.install(train)   # main(), first thing: SIGTERM, SIGINT, train.preempt_signal
    watch.signum                             # the flag: the first signal received, None until then
    raise watch.stopped(checkpointer, ctx, epoch, micro_batches, run_dir)  # once every rank saved there

A signal (a spot reclaim, a Kubernetes eviction, Slurm's time limit or ``--signal``, Ctrl-C, ``ddpflow run`` or
torchrun passing one on, or one sent to any one rank) only sets a flag in the handler: no I/O, no collective, no
exception in the middle of a step or a checkpoint write. Every rank's flag rides on the gradient all-reduce of each
optimizer step (training/distributed/context.py: GradientAllReduce: appended to bucket 0, summed with it; SUM > 0:
"some rank was told"), so all ranks learn it at the same step, and none runs ahead into a collective the others
left, without a collective of its own (training/loop/step.py: ``StopFlags``). The epoch's pass then writes that
step's checkpoint, whatever ``train.checkpoint_every_*`` says: the same atomic step checkpoint as any other
(training/checkpoint/files.py), so a kill during the save leaves the previous checkpoint intact. The epoch's last
optimizer step is not a boundary (as for the schedule): a flag seen there is acted on once last.pt is written at the
epoch's end (``StopFlags.requested``: a collective, once an epoch), and that is the checkpoint.

``stopped`` waits for the write, rank 0 records the stop in ``RUN_DIR/preempted.json`` (signal, epoch, step,
checkpoint, seconds from the signal to the saved file) and returns ``Preempted``; ``main`` catches it and every rank
exits with status 0. That pair, exit 0 with ``preempted.json`` and no model.pt, is the documented "preempted,
resumable" status: a non-zero exit would make torchrun restart the group (``--max-restarts``) when only a rank was
signalled, and the restarted ranks would resume and train on. The launchers read the file
(``ddpflow/launch/supervisor.py``: ``LaunchPreempted``). The same command resumes from the checkpoint, to the
weights of an uninterrupted run (the step checkpoint's exact resume).

A second signal changes nothing in a rank: the hard stop is the parent's SIGKILL after ``train.preempt_grace_s``.

Cost: one number more in the step's first gradient bucket; no collective of its own. The stop is exact (every
rank saves at the same step) and comes at the end of the first optimizer step whose gradient all-reduce starts
after the signal: a signal before a step's backward stops the run at that step's end; one later in the step, at
the next boundary's end (two optimizer steps at most).
"""

from __future__ import annotations

import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from training.core.config import TrainConfig
from training.core.fileio import atomic_write_json, log_main
from training.core.layout import PREEMPTED, run_file

BASE_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Every rank saved at the same step and stops; ``main`` exits 0 (see the module doc)."""


class Collectives(Protocol):
    is_main: bool

    def checkpoint_barrier(self, path: str | Path) -> None: ...


class Writes(Protocol):
    """What ``stopped`` needs of the checkpointer (training/checkpoint/files.py: ``Checkpointer``)."""

    def path_at(self, epoch: int, micro_batches: int) -> Path: ...

    def wait_for_writes(self, raise_error: bool = True) -> None: ...


def preempt_signals(train: TrainConfig) -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT and ``train.preempt_signal`` (validated: a signal name)."""
    extra = (signal.Signals[train.preempt_signal],) if train.preempt_signal else ()
    return tuple(dict.fromkeys(BASE_SIGNALS + extra))


class PreemptionWatch:
    """This rank's flag, set by its signal handler (the ranks compare flags: training/loop/step.py, ``StopFlags``),
    and the record of a stop."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.received_at: float | None = None  # time.monotonic() when it came

    @classmethod
    def install(cls, train: TrainConfig) -> PreemptionWatch:
        """Handlers for SIGTERM, SIGINT and ``train.preempt_signal`` that only set the flag (main thread only)."""
        watch = cls()
        for sig in preempt_signals(train):
            signal.signal(sig, watch._handle)
        return watch

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # only a flag: the work happens at the next step boundary
            self.signum, self.received_at = signum, time.monotonic()

    def stopped(
        self, checkpointer: Writes, ctx: Collectives, epoch: int, micro_batches: int, run_dir: str | Path
    ) -> Preempted:
        """Once the checkpoint after ``micro_batches`` micro-batches of ``epoch`` is written (0: last.pt): wait for
        it, record the stop (rank 0), and the exception that ends the rank. A failed write raises
        ``CheckpointWriteError`` instead."""
        checkpointer.wait_for_writes()  # the step checkpoint is complete and renamed into place, or its error
        path = checkpointer.path_at(epoch, micro_batches)
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal to another rank"
        waited = time.monotonic() - self.received_at if self.received_at is not None else None
        where = f"step {micro_batches} of epoch {epoch + 1}" if micro_batches else f"the end of epoch {epoch}"
        if ctx.is_main:
            record = {
                "signal": name,
                "epoch": epoch,  # 0-based: the epoch the checkpoint is in (last.pt: the epochs done)
                "step": micro_batches,  # micro-batches of that epoch trained (0: last.pt, at the epoch's end)
                "checkpoint": str(path),
                "seconds_to_save": None if waited is None else round(waited, 3),
                "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            atomic_write_json(run_file(run_dir, PREEMPTED), record)
            took = "" if waited is None else f" {waited:.1f}s after the signal"
            log_main(True, f"preempted by {name}: saved {where} to {path}{took}; the same command resumes there")
        ctx.checkpoint_barrier(path)  # no rank leaves before both files are complete: a node's exit may end the job
        return Preempted(f"preempted by {name} at {where}")
