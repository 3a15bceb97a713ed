"""What last.pt and a step checkpoint hold, built and restored in this one module: ``TrainState``.

A resumable state is made of parts, each owning its own ``state_dict()`` and ``load_state_dict()`` (as
torchtitan's checkpoint manager holds its stateful parts); ``TrainState`` puts them under these keys, the
ones last.pt had before this module (a file written then resumes):

    "model"                              the plain module (DDP's wrapped copy shares its tensors)
    "optimizer", "scheduler"             the optimizer and its warmup/cosine schedule (training/loop/optim.py)
    "epoch", "step", "epoch_sums",       ``Position``: epochs done, micro-batches of the next one trained and
    "metrics"                            their all-reduced sums (a step checkpoint), every epoch's metrics line
    "global_batch", "world_size"         the rows of one step over all ranks and the ranks (``check_global_batch``)
    "rng"                                ``RankStreams``: every rank's RNG streams, {"per_rank": [...]}
    "selection", "best_model"            ``Selection`` (training/loop/selection.py), ``BestWeights`` (rank 0's)
    "config", "fingerprint"              the resume rule's entries (training/checkpoint/files.py: identity_entries)

Every entry is a CPU copy: a step checkpoint is written in the background while training goes on. Building the
state gathers every rank's RNG streams, so every rank calls ``state_dict``/``save_last``/``save_step``; rank 0,
the writer, gets the contents, the others an empty dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from training.checkpoint.files import Checkpointer, check_global_batch, identity_entries
from training.core.config import PipelineConfig
from training.core.log import log_main
from training.core.rng import capture_rng, rank_seed, restore_rng, seed_process
from training.loop.selection import Selection


def on_cpu(tree: Any, copy: bool = False) -> Any:
    """Tensors moved to the CPU, so a checkpoint written on a GPU loads anywhere; ``copy``: fresh tensors and
    containers even where they already are on the CPU (a snapshot that later steps do not change)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=copy)
    if isinstance(tree, dict):
        return {key: on_cpu(value, copy) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(value, copy) for value in tree)
    return tree


@dataclass
class Position:
    """Where training is: ``epochs_done`` complete epochs, each one's metrics line (``history``), and on a resume
    mid-epoch the micro-batch it continues at (``start_micro_batch``) with the epoch's sums so far (``carried``,
    rank 0's alone, so the epoch's all-reduce counts them once)."""

    epochs_done: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    start_micro_batch: int = 0
    carried: dict[str, Any] | None = None

    def take_start(self) -> tuple[int, dict[str, Any] | None]:
        """The resumed micro-batch and sums for the epoch starting now; the next epoch starts at 0."""
        start, carried = self.start_micro_batch, self.carried
        self.start_micro_batch, self.carried = 0, None
        return start, carried

    def end_epoch(self, epoch: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """``epoch`` (0-based) is complete with ``metrics``: its line of the history, returned."""
        record = {"epoch": epoch, **metrics}
        self.epochs_done = epoch + 1
        self.history.append(record)
        return record

    def state_dict(self, micro_batches: int = 0, epoch_sums: dict[str, Any] | None = None) -> dict[str, Any]:
        """``micro_batches``: of the epoch in progress, trained (a step checkpoint; 0: at an epoch's end)."""
        return {
            "epoch": self.epochs_done, "step": micro_batches, "epoch_sums": epoch_sums, "metrics": list(self.history)
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], keeps_sums: bool) -> None:
        self.epochs_done = int(state["epoch"])
        self.history = list(state.get("metrics") or [])
        self.start_micro_batch = int(state.get("step") or 0)
        sums = state.get("epoch_sums") if self.start_micro_batch else None
        self.carried = None
        if sums is not None:
            self.carried = {
                "loss": sums["loss"] if keeps_sums else 0.0,
                "rows": sums["rows"] if keeps_sums else 0,
                "coverage": tuple(sums["coverage"]) if keeps_sums else None,
            }


class BestWeights:
    """Rank 0's copy of the best epoch's weights, on the CPU (``train.select: best``), for model.pt."""

    def __init__(self, is_main: bool):
        self.is_main, self.weights = is_main, None

    def keep(self, model: nn.Module) -> None:
        if self.is_main:
            self.weights = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.weights

    def load_state_dict(self, weights: dict[str, torch.Tensor] | None) -> None:
        self.weights = weights if self.is_main else None


class RankStreams:
    """Every rank's RNG streams: gathered into the checkpoint, restored on the same world size, reseeded per rank
    (``rank_seed``) on another one or on a fresh start."""

    def __init__(self, ctx, seed: int):
        self.ctx, self.seed = ctx, seed

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": self.ctx.gather_objects(capture_rng())}  # a collective: every rank calls it

    def load_state_dict(self, state: dict[str, Any], epochs_done: int) -> bool:
        """True when this rank's own stream was restored; False when the world size changed (reseeded)."""
        per_rank = state["per_rank"]
        if len(per_rank) == self.ctx.world_size:
            restore_rng(per_rank[self.ctx.rank])
            return True
        seed_process(rank_seed(self.seed, self.ctx.rank, epochs_done))
        return False

    def seed_fresh(self) -> None:
        """Different streams per rank from here on (e.g. dropout masks), still reproducible."""
        seed_process(rank_seed(self.seed, self.ctx.rank))


class TrainState:
    """Everything a training continues from (module docstring): ``state_dict``/``load_state_dict`` build and
    restore it; ``save_last``, ``save_step`` and ``resume_or_seed`` are the Checkpointer's calls with it."""

    def __init__(
        self,
        config: PipelineConfig,
        fingerprint: str,
        ctx,
        checkpointer: Checkpointer,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        rank_batch: int,
    ):
        self.config, self.fingerprint, self.ctx, self.checkpointer = config, fingerprint, ctx, checkpointer
        self.model, self.optimizer, self.scheduler, self.rank_batch = model, optimizer, scheduler, rank_batch
        self.position = Position()
        self.selection = Selection.from_config(config.train)  # which epoch model.pt holds, when to stop
        self.best = BestWeights(ctx.is_main)
        self.streams = RankStreams(ctx, config.train.seed)

    def state_dict(self, micro_batches: int = 0, epoch_sums: dict[str, Any] | None = None) -> dict[str, Any]:
        """last.pt (after an epoch) or a step checkpoint (``micro_batches`` into epoch ``epochs_done``,
        with the epoch's all-reduced sums so far); rank 0 gets the contents, the others {}."""
        rng = self.streams.state_dict()
        if not self.ctx.is_main:
            return {}
        scheduler = self.scheduler
        return {
            "model": on_cpu(self.model.state_dict(), copy=True),
            "optimizer": on_cpu(self.optimizer.state_dict(), copy=True),
            "scheduler": on_cpu(scheduler.state_dict(), copy=True) if scheduler is not None else None,
            **self.position.state_dict(micro_batches, epoch_sums),
            "global_batch": self.rank_batch * self.ctx.world_size,  # rows of one step over all ranks
            "rng": rng,
            "world_size": self.ctx.world_size,
            "selection": self.selection.state_dict(),
            "best_model": self.best.state_dict(),
            **identity_entries(self.config, self.fingerprint),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s contents (every rank loads the same, broadcast state). Any resume
        keeps the global batch (one step covers the same rows at any world size: training/loading/batches.py
        ``global_positions_of_steps``); ``ResumeMismatchError`` otherwise."""
        source = self.checkpointer.resumed_from or "the checkpoint"
        check_global_batch(state, self.rank_batch, self.ctx.world_size, source)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.position.load_state_dict(state, keeps_sums=self.ctx.is_main)
        self.selection.load_state_dict(state.get("selection"))
        self.best.load_state_dict(state.get("best_model"))
        same_world = self.streams.load_state_dict(state["rng"], self.position.epochs_done)
        self._say_resumed(len(state["rng"]["per_rank"]), same_world)

    def resume_or_seed(self, saved: dict[str, Any] | None) -> None:
        """``saved`` (the Checkpointer's ``load_resumable``), or a fresh start with each rank's own seed."""
        if saved is not None:
            self.load_state_dict(saved)
        else:
            self.streams.seed_fresh()

    def save_last(self) -> None:
        """last.pt after an epoch (every rank calls it: the RNG streams are gathered)."""
        self.checkpointer.save_last(self.state_dict())

    def save_step(self, epoch: int, micro_batches: int, sums) -> None:
        """A step checkpoint once ``micro_batches`` micro-batches of ``epoch`` are trained: ``sums`` (``EpochSums``,
        this rank's) all-reduced, then the state as CPU copies that rank 0 writes in the background while training
        goes on (training/checkpoint/steps.py). Every rank calls it, between two optimizer steps."""
        epoch_sums = sums.all_reduced(self.ctx)
        self.checkpointer.save_step(self.state_dict(micro_batches, epoch_sums), epoch, micro_batches)

    def _say_resumed(self, saved_world: int, same_world: bool) -> None:
        position = self.position
        start = position.start_micro_batch
        at_step = f", at step {start} of epoch {position.epochs_done}" if start else ""
        resumed = f"resumed from {self.checkpointer.resumed_from} after {position.epochs_done} epoch(s){at_step}"
        if not same_world:
            resumed += (
                f"; world size {saved_world} -> {self.ctx.world_size}: RNG streams reseeded, data order per rank "
                "differs"
            )
        log_main(self.ctx.is_main, resumed)
