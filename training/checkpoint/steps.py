"""Step checkpoints: a resumable state inside an epoch, ``RUN_DIR/checkpoints/step-e{E}-s{S}.pt``.

E is the epoch (0-based) and S the micro-batches of it already trained; the name alone orders them, so
resume finds the newest without opening any. What one holds is ``TrainState``'s business, as for last.pt
(training/checkpoint/state.py: ``save_step``); when one is due, the epoch's pass decides
(training/loop/step.py: ``StepSchedule``); here: its name, and HOW rank 0 writes it without stopping training
(``BackgroundWriter``) and prunes the older ones.

How: ``TrainState`` copies the state off the device into fresh CPU tensors (the snapshot, taken between steps,
so it is one consistent state), then rank 0 writes it in a background thread while training goes on
(atomically: training/core/fileio.py, complete or absent) and, once it is complete, deletes the older step
checkpoints beyond ``train.keep_checkpoints``. The next checkpoint, last.pt and model.pt wait for a write
still under way first, so writes never overlap and a failed one fails the run at the next of them.
``torch.distributed.checkpoint``'s async save is not used: it writes a directory per checkpoint (sharded
for FSDP), where a DDP state is one small file rank 0 already holds.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

STEP_PATTERN = re.compile(r"^step-e(\d+)-s(\d+)\.pt$")


def step_checkpoint_path(checkpoints: Path, epoch: int, micro_batches: int) -> Path:
    """The step checkpoint once ``micro_batches`` micro-batches of ``epoch`` (0-based) are trained."""
    return checkpoints / f"step-e{epoch:05d}-s{micro_batches:08d}.pt"


def step_position(path: Path) -> tuple[int, int] | None:
    """(epoch, micro-batches trained) of a step checkpoint's file name; None for any other file."""
    found = STEP_PATTERN.match(path.name)
    return (int(found[1]), int(found[2])) if found else None


def step_checkpoints(checkpoints: Path) -> list[Path]:
    """The step checkpoints in ``checkpoints``, oldest first (a temp file of a torn write is not one)."""
    found = [path for path in checkpoints.glob("step-*.pt") if step_position(path) is not None]
    return sorted(found, key=step_position)


class BackgroundWriter:
    """Rank 0's writes, one at a time, in a thread; ``wait`` joins the one under way and raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as error:  # re-raised in the training thread by wait()
                self._error = error

        self._thread = threading.Thread(target=run, name="ddpflow-step-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def prune(checkpoints: Path, keep: int, before: tuple[int, int] | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` step checkpoints, and every one at a position before ``before``
    (what a newer last.pt covers); returns what was deleted. Only rank 0 calls it, once the newer file is
    complete."""
    found = step_checkpoints(checkpoints)
    doomed = found[: max(0, len(found) - keep)]
    if before is not None:
        doomed += [path for path in found[len(doomed) :] if step_position(path) < before]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def remove_torn_writes(checkpoints: Path) -> None:
    """A write killed mid-way (SIGKILL: no cleanup) leaves its temp file (training/core/fileio.py): remove them.
    Rank 0 at start, before any write of its own."""
    for path in checkpoints.glob(".*.pt-*.tmp"):
        path.unlink(missing_ok=True)
