"""A stop that every rank obeys at the same epoch boundary, asked for from outside the ranks (a sweep's pruner).

The process that launched the ranks (``ddpflow/sweep/pruning.py``) reads each epoch's line of
metrics.jsonl, asks its pruner, and answers with a verdict file, ``RUN_DIR/verdicts/epoch-<n>``
holding ``stop`` or ``continue``. The directory exists only when such a process follows the run
(it creates it before the launch), and every rank sees it (RUN_DIR is shared, as checkpoints need):
without it nothing is waited for and no collective runs.

With it, rank 0 waits for the epoch's verdict (up to ``VERDICT_WAIT_S``; no verdict by then means
continue) and the flag is all-reduced, so every rank leaves after the same epoch and none runs ahead
into a collective the others have left. The Trainer then ends as after early stopping: model.pt holds
the selected epoch's weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from training.core.fileio import atomic_write_text

if TYPE_CHECKING:
    from training.distributed.context import DistContext

VERDICTS = "verdicts"
STOP, CONTINUE = "stop", "continue"
VERDICT_WAIT_S = 120.0
POLL_S = 0.05


def verdicts_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / VERDICTS


def verdict_path(run_dir: str | os.PathLike, epoch: int) -> Path:
    return verdicts_dir(run_dir) / f"epoch-{epoch}"


def write_verdict(run_dir: str | os.PathLike, epoch: int, stop: bool) -> Path:
    """The launching process's answer for ``epoch`` (0-based), written atomically."""
    return atomic_write_text(verdict_path(run_dir, epoch), STOP if stop else CONTINUE, durable=False)


def read_verdict(run_dir: str | os.PathLike, epoch: int, wait_s: float) -> bool | None:
    """True: stop, False: continue, None: no verdict within ``wait_s``."""
    path, deadline = verdict_path(run_dir, epoch), time.monotonic() + wait_s
    while True:
        try:
            return path.read_text().strip() == STOP
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)


TRIAL_STOP = "stop"  # a training script's trial: stop at the script's next should_stop() (ddpflow/script/)


def write_stop(run_dir: str | os.PathLike) -> Path:
    """Stop a training script's trial at its next ``ddpflow.should_stop()``: it has no epochs of ddpflow's own."""
    return atomic_write_text(verdicts_dir(run_dir) / TRIAL_STOP, STOP, durable=False)


def stop_written(run_dir: str | os.PathLike) -> bool:
    """Whether ``write_stop`` stopped this run."""
    return (verdicts_dir(run_dir) / TRIAL_STOP).is_file()


def stop_requested(run_dir: str | os.PathLike, epoch: int, ctx: DistContext, wait_s: float = VERDICT_WAIT_S) -> bool:
    """After ``epoch``'s metrics line: whether every rank stops here (the same answer on every rank)."""
    if not verdicts_dir(run_dir).is_dir():
        return False
    local = int(bool(read_verdict(run_dir, epoch, wait_s))) if ctx.is_main else 0
    return ctx.all_reduce_int_sum([local])[0] > 0
