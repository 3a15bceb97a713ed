"""Preemption in the ranks: told to stop, every rank saves at the same optimizer step and exits, resumable.

    watch = PreemptionWatch.install(train)   # main(), first thing: SIGTERM, SIGINT, train.preempt_signal
    watch.attach(ctx, steps_per_epoch, grad_accum)         # the Trainer, once the group exists
    watch.begin(step)                        # before each micro-batch step, on every rank (starts the flags' sum)
    if watch.due(step): ...                  # after it: whether any rank was told (waits for that sum)

A signal (a spot reclaim, a Kubernetes eviction, Slurm's time limit or ``--signal``, Ctrl-C, ``ddpflow run`` or
torchrun passing one on, or one sent to any one rank) only sets a flag in the handler: no I/O, no collective, no
exception in the middle of a step or a checkpoint write. At each optimizer-step boundary every rank all-reduces its
flag (one int64, SUM > 0: "some rank was told"), so all ranks learn it at the same step and none runs ahead into a
collective the others left. The all-reduce is started before the step (``begin``: the flag as it is then) and
waited for after it (``due``): it runs beside the step's forward and backward instead of holding every rank after
it. The Trainer then writes that step's checkpoint, whatever ``train.checkpoint_every_*``
says: the same atomic step checkpoint as any other (training/checkpoint/steps.py), so a kill during the save leaves
the previous checkpoint intact. The epoch's last step is not a boundary here (as for the schedule): a flag seen
there is acted on once last.pt is written at the epoch's end, and that is the checkpoint.

``stopped`` waits for the write, rank 0 records the stop in ``RUN_DIR/preempted.json`` (signal, epoch, step,
checkpoint, seconds from the signal to the saved file) and returns ``Preempted``; ``main`` catches it and every rank
exits with status 0. That pair, exit 0 with ``preempted.json`` and no model.pt, is the documented "preempted,
resumable" status: a non-zero exit would make torchrun restart the group (``--max-restarts``) when only a rank was
signalled, and the restarted ranks would resume and train on. The launchers read the file
(``ddpflow/launch/supervisor.py``: ``LaunchPreempted``). The same command resumes from the checkpoint, to the
weights of an uninterrupted run (the step checkpoint's exact resume).

A second signal changes nothing in a rank: the hard stop is the parent's SIGKILL after ``train.preempt_grace_s``.

Cost: one all-reduce of one int64 per optimizer step, started before the step and waited for after it, so its
latency hides behind the step (docs/reliability.md). The stop is exact (every rank saves at the same step) and
comes at the end of the first boundary step that STARTS after the signal: a signal before a step stops the run
at that step's end; one during a step, at the next boundary's end (two optimizer steps at most).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from training.checkpoint.steps import step_checkpoint_path
from training.core.config import TrainConfig
from training.core.fileio import atomic_write_json
from training.core.layout import LAST_CHECKPOINT, PREEMPTED, run_file
from training.core.log import log_main

BASE_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Every rank saved at the same step and stops; ``main`` exits 0 (see the module doc)."""


class Collectives(Protocol):
    is_main: bool

    def all_reduce_int_sum(self, values: list[int]) -> list[int]: ...

    def all_reduce_int_sum_async(self, values: list[int]) -> Callable[[], list[int]]: ...

    def checkpoint_barrier(self, path: str | Path) -> None: ...


class Writes(Protocol):
    last_path: Path

    def wait_for_writes(self, raise_error: bool = True) -> None: ...


def preempt_signals(train: TrainConfig) -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT and ``train.preempt_signal`` (validated: a signal name)."""
    extra = (signal.Signals[train.preempt_signal],) if train.preempt_signal else ()
    return tuple(dict.fromkeys(BASE_SIGNALS + extra))


class PreemptionWatch:
    """This rank's flag, set by its signal handler, and the step boundaries where the ranks compare flags."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.received_at: float | None = None  # time.monotonic() when it came
        self.ctx: Collectives | None = None
        self.steps_per_epoch, self.grad_accum = 0, 1
        self.pending: tuple[int, Callable[[], list[int]]] | None = None  # (step, its flags' sum, in flight)

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

    def attach(self, ctx: Collectives, steps_per_epoch: int, grad_accum: int) -> PreemptionWatch:
        """The group the flags are compared over, and where an epoch's optimizer steps end."""
        self.ctx, self.steps_per_epoch, self.grad_accum = ctx, steps_per_epoch, grad_accum
        return self

    def boundary(self, step: int) -> bool:
        """Micro-batch step ``step`` (0-based) ends an optimizer step before the epoch's last: where flags meet."""
        done = step + 1
        return self.ctx is not None and not done % self.grad_accum and done < self.steps_per_epoch

    def begin(self, step: int) -> None:
        """Before micro-batch step ``step``: at a boundary, start the all-reduce of the flags as they are now."""
        if self.boundary(step):
            self.pending = (step, self.ctx.all_reduce_int_sum_async([int(self.signum is not None)]))

    def due(self, step: int) -> bool:
        """After micro-batch step ``step`` (0-based) of an epoch: whether any rank was told to stop. The same
        answer on every rank; a collective only at an optimizer-step boundary before the epoch's last step (the
        one ``begin`` started; without it, one now)."""
        if not self.boundary(step):
            return False
        if self.pending is None or self.pending[0] != step:
            return self.requested()
        sums, self.pending = self.pending[1], None
        return sums()[0] > 0

    def requested(self) -> bool:
        """Any rank's flag, on every rank (every rank must call it at the same point)."""
        if self.ctx is None:
            return False
        return self.ctx.all_reduce_int_sum([int(self.signum is not None)])[0] > 0

    def stopped(self, checkpointer: Writes, epoch: int, step: int, run_dir: str | Path) -> Preempted:
        """Once the checkpoint at (``epoch``, ``step``) is written (step 0: last.pt): wait for it, record the stop
        (rank 0), and the exception that ends the rank. A failed write raises ``CheckpointWriteError`` instead."""
        checkpointer.wait_for_writes()  # the step checkpoint is complete and renamed into place, or its error
        folder = checkpointer.last_path.parent
        path = step_checkpoint_path(folder, epoch, step) if step else run_file(run_dir, LAST_CHECKPOINT)
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal to another rank"
        waited = time.monotonic() - self.received_at if self.received_at is not None else None
        where = f"step {step} of epoch {epoch + 1}" if step else f"the end of epoch {epoch}"
        if self.ctx is not None and self.ctx.is_main:
            record = {
                "signal": name,
                "epoch": epoch,  # 0-based: the epoch the checkpoint is in (last.pt: the epochs done)
                "step": step,  # micro-batch steps of that epoch trained (0: last.pt, at the epoch's end)
                "checkpoint": str(path),
                "seconds_to_save": None if waited is None else round(waited, 3),
                "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            atomic_write_json(run_file(run_dir, PREEMPTED), record)
            took = "" if waited is None else f" {waited:.1f}s after the signal"
            log_main(True, f"preempted by {name}: saved {where} to {path}{took}; the same command resumes there")
        if self.ctx is not None:  # no rank leaves before both files are complete: a node's exit may end the job
            self.ctx.checkpoint_barrier(path)
        return Preempted(f"preempted by {name} at {where}")
