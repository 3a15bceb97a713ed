"""Test hooks for fault and coverage tests. Inert unless their variable is set.

``DDPFLOW_FAULT=ACTION:rank=R:epoch=E[:step=S]`` makes global rank R, in epoch E
(0-based) before training step S (0-based; default 0), do one of:

- ``kill``:  SIGKILL itself, as an OOM kill or a lost node would. Once per run
  directory: a marker file ``RUN_DIR/.fault-kill-done`` keeps the restarted
  worker (torchrun ``--max-restarts``) from repeating it.
- ``hang``:  sleep forever without entering a collective (a stuck rank). Once per
  run directory, like ``kill`` (marker ``.fault-hang-done``).
- ``preempt``: send itself SIGUSR1 (``train.preempt_signal``'s default), as Slurm's ``--signal`` or a
  person signalling one rank would: every rank must save at the end of that step and stop
  (training/loop/preemption.py). Once per run directory (marker ``.fault-preempt-done``).
- ``pause``: sleep ``seconds`` (default 5) once per run directory (marker ``.fault-pause-done``, written before
  the sleep): a window in which a test knows where training is while it signals the run from outside.
- ``raise``: ``RuntimeError("injected fault ...")``, every time: a permanent error.
- ``nan``:   the model's output in that training step is NaN, every time (a diverged
  step: the non-finite check, training/loop/nonfinite.py, must stop the run there).
- ``skip_row``: a broken sampler, every time: in epoch E rank R trains its first row of
  the epoch twice and skips its second (the same row count; only the coverage certificate,
  training/loop/counting.py: ``Certificate``, can tell).

``DDPFLOW_FAULT=slow_checkpoint:rank=0:epoch=E:seconds=S`` makes rank 0 (the
checkpoint writer) sleep S seconds before writing the checkpoint that ends
epoch E, as a large checkpoint on a slow shared filesystem would; the other
ranks wait at the checkpoint barrier (``train.checkpoint_timeout_s``).

``DDPFLOW_KEEP_CHECKPOINTS=1`` makes rank 0 copy last.pt, after each epoch's write,
to ``RUN_DIR/checkpoints/epoch{e}.pt`` (e: the epoch just finished, 0-based), so a test
can compare model.pt with the selected epoch's weights.

``DDPFLOW_RECORD_INDICES=1`` makes every rank append the dataset rows it
trained on in an epoch, once the epoch is complete, to
``RUN_DIR/indices/rank{r}-epoch{e}.jsonl``: one line (a JSON list, in order)
per completed pass. An epoch trained again after a restart shows up as a
second line, so a test can tell a resume from a retrain; a pass resumed from a step
checkpoint records the rows from its first step on (the steps before it are not trained
again), so a test can see where it began.

They reach the training program through ONE object, ``TrainHooks``: the
Trainer calls its methods at fixed points. ``hooks_from_env`` builds the hooks these variables ask for, and
None when none is set: a user's run calls no code of this module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from training.core.fileio import log_rank

if TYPE_CHECKING:
    from training.loading.batches import Batch

FAULT_ENV = "DDPFLOW_FAULT"
RECORD_INDICES_ENV = "DDPFLOW_RECORD_INDICES"
KEEP_CHECKPOINTS_ENV = "DDPFLOW_KEEP_CHECKPOINTS"
ACTIONS = ("kill", "hang", "raise", "nan", "slow_checkpoint", "skip_row", "preempt", "pause")
_FIELDS = ("rank", "epoch", "step", "seconds")


class TrainHooks:
    """Where tests reach into a rank's training. Every method does nothing here: a test overrides the ones it needs."""

    def on_model(self, model: torch.nn.Module) -> None:
        """The plain module, once built (before DDP wraps it)."""

    def micro_batches(self, epoch: int, batches: Iterable[Batch], start: int) -> Iterable[tuple[int, Batch]]:
        """The epoch's micro-batches from ``start`` on, numbered, as the pass trains them: each one's ``at_step``
        and ``on_batch`` run before it is trained."""
        for index, batch in enumerate(batches, start):
            self.at_step(epoch, index)
            self.on_batch(batch.indices)
            yield index, batch

    def at_step(self, epoch: int, step: int) -> None:
        """Before training micro-batch ``step`` of ``epoch`` (both 0-based)."""

    def on_batch(self, indices: torch.Tensor) -> None:
        """The dataset rows of the batch about to be trained (sampler padding excluded)."""

    def epoch_rows(self, epoch: int, rows: torch.Tensor) -> torch.Tensor:
        """The sampler's order of this rank's rows in ``epoch`` (padded positions included), as it is trained. The
        stream (``data.stream``) never holds an epoch's order: it passes each batch's positions in the order."""
        return rows

    def end_epoch(self, epoch: int) -> None:
        """After the last training step of ``epoch``, before validation."""

    def before_checkpoint_write(self, path: Path) -> None:
        """On the writing rank, just before ``path`` is written."""

    def after_checkpoint_write(self, path: Path) -> None:
        """On the writing rank, once ``path`` is complete."""


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    epoch: int
    step: int = 0
    seconds: int = 0  # slow_checkpoint only

    @classmethod
    def parse(cls, text: str) -> Fault:
        action, *fields = text.strip().split(":")
        if action not in ACTIONS:
            raise ValueError(f"{FAULT_ENV}={text!r}: action must be one of {ACTIONS}")
        values: dict[str, int] = {}
        for field in fields:
            name, _, value = field.partition("=")
            if name not in _FIELDS or not value.lstrip("-").isdigit():
                raise ValueError(f"{FAULT_ENV}={text!r}: {field!r} is not rank=N, epoch=N, step=N or seconds=N")
            values[name] = int(value)
        if "rank" not in values or "epoch" not in values:
            raise ValueError(f"{FAULT_ENV}={text!r}: needs rank=N and epoch=N")
        return cls(action, **values)


class FaultInjector:
    def __init__(self, fault: Fault | None, rank: int, run_dir: str | Path):
        self.fault = fault if fault is not None and fault.rank == rank else None
        self.marker = Path(run_dir) / f".fault-{fault.action}-done" if fault else None
        self.epoch = -1  # the epoch of the last step seen
        self.slowed = False
        self.poison_next_output = False  # nan: the next training forward returns NaN

    @classmethod
    def from_env(cls, rank: int, run_dir: str | Path) -> FaultInjector:
        text = os.environ.get(FAULT_ENV)
        return cls(Fault.parse(text) if text else None, rank, run_dir)

    def on_model(self, model: torch.nn.Module) -> None:
        if self.fault is not None and self.fault.action == "nan":
            model.register_forward_hook(self._poison)

    def _poison(self, module: torch.nn.Module, inputs, output):
        if not (self.poison_next_output and module.training):
            return None
        self.poison_next_output = False
        return output * float("nan")

    def at_step(self, epoch: int, step: int) -> None:
        self.epoch = epoch
        fault = self.fault
        not_a_step_fault = fault is None or fault.action in ("slow_checkpoint", "skip_row")
        if not_a_step_fault or (fault.epoch, fault.step) != (epoch, step):
            return
        where = f"rank {fault.rank} epoch {epoch} step {step}"
        if fault.action == "raise":
            raise RuntimeError(f"injected fault ({FAULT_ENV}) at {where}")
        if fault.action == "nan":
            log_rank(f"{FAULT_ENV}: NaN output at {where}")
            self.poison_next_output = True
            return
        if self.marker.exists():
            return
        self.marker.write_text(where)
        log_rank(f"{FAULT_ENV}: {fault.action} at {where}")
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "preempt":
            os.kill(os.getpid(), signal.SIGUSR1)
            return
        if fault.action == "pause":
            time.sleep(fault.seconds or 5)
            return
        while True:  # hang: no collectives, so peers block until their timeout
            time.sleep(3600)

    def epoch_rows(self, epoch: int, rows: torch.Tensor) -> torch.Tensor:
        """``skip_row``: the rank's first row of the epoch in place of its second."""
        fault = self.fault
        if fault is None or fault.action != "skip_row" or fault.epoch != epoch or len(rows) < 2:
            return rows
        log_rank(f"{FAULT_ENV}: rank {fault.rank} epoch {epoch} trains row {int(rows[0])} twice, skips {int(rows[1])}")
        rows = rows.clone()
        rows[1] = rows[0]
        return rows

    def before_checkpoint_write(self, path: Path) -> None:
        """``slow_checkpoint``: the first checkpoint written after a step of the fault's epoch is late."""
        fault = self.fault
        if fault is None or fault.action != "slow_checkpoint" or fault.epoch != self.epoch or self.slowed:
            return
        self.slowed = True
        log_rank(f"{FAULT_ENV}: writing {path} {fault.seconds}s late (rank {fault.rank} epoch {fault.epoch})")
        time.sleep(fault.seconds)


class IndexRecorder:
    def __init__(self, enabled: bool, rank: int, run_dir: str | Path):
        self.enabled, self.rank = enabled, rank
        self.folder = Path(run_dir) / "indices"
        self.parts: list[torch.Tensor] = []

    @classmethod
    def from_env(cls, rank: int, run_dir: str | Path) -> IndexRecorder:
        return cls(os.environ.get(RECORD_INDICES_ENV) == "1", rank, run_dir)

    def add(self, indices: torch.Tensor) -> None:
        if self.enabled:
            self.parts.append(indices)

    def write(self, epoch: int) -> None:
        if not self.enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = torch.cat(self.parts).tolist() if self.parts else []
        with open(self.folder / f"rank{self.rank}-epoch{epoch}.jsonl", "a") as handle:
            handle.write(json.dumps(rows) + "\n")
        self.parts = []


class CheckpointKeeper:
    """``DDPFLOW_KEEP_CHECKPOINTS``: a copy of each epoch's last.pt as ``epoch{e}.pt`` beside it."""

    def __init__(self, enabled: bool):
        self.enabled, self.epoch = enabled, -1

    def end_epoch(self, epoch: int) -> None:
        """The epoch whose last.pt the next write is."""
        self.epoch = epoch

    def after_write(self, path: Path) -> None:
        if self.enabled and path.name == "last.pt" and self.epoch >= 0:
            shutil.copyfile(path, path.with_name(f"epoch{self.epoch}.pt"))


class EnvironmentHooks(TrainHooks):
    """The hooks ``DDPFLOW_FAULT``, ``DDPFLOW_KEEP_CHECKPOINTS`` and ``DDPFLOW_RECORD_INDICES`` ask for."""

    def __init__(self, faults: FaultInjector, indices: IndexRecorder, keeper: CheckpointKeeper | None = None):
        self.faults, self.indices = faults, indices
        self.keeper = keeper or CheckpointKeeper(False)

    def on_model(self, model: torch.nn.Module) -> None:
        self.faults.on_model(model)

    def at_step(self, epoch: int, step: int) -> None:
        self.faults.at_step(epoch, step)

    def on_batch(self, indices: torch.Tensor) -> None:
        self.indices.add(indices)

    def epoch_rows(self, epoch: int, rows: torch.Tensor) -> torch.Tensor:
        return self.faults.epoch_rows(epoch, rows)

    def end_epoch(self, epoch: int) -> None:
        self.indices.write(epoch)
        self.keeper.end_epoch(epoch)

    def before_checkpoint_write(self, path: Path) -> None:
        self.faults.before_checkpoint_write(path)

    def after_checkpoint_write(self, path: Path) -> None:
        self.keeper.after_write(path)


def hooks_from_env(rank: int, run_dir: str | Path) -> TrainHooks | None:
    """None unless a test hook's variable is set."""
    keep = os.environ.get(KEEP_CHECKPOINTS_ENV) == "1"
    if not os.environ.get(FAULT_ENV) and os.environ.get(RECORD_INDICES_ENV) != "1" and not keep:
        return None
    return EnvironmentHooks(
        FaultInjector.from_env(rank, run_dir), IndexRecorder.from_env(rank, run_dir), CheckpointKeeper(keep)
    )
