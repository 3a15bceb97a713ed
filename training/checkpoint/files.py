"""Checkpoints, in one module: what last.pt and a step checkpoint hold (``TrainState``), how rank 0 writes them and
model.pt (``Checkpointer``), and how a rank finds and reads the one it continues.

The files: ``RUN_DIR/checkpoints/last.pt`` after every epoch, ``RUN_DIR/model.pt`` at the end (what it holds is
training/inference/model_file.py's), and step checkpoints inside an epoch, ``RUN_DIR/checkpoints/step-e{E}-s{S}.pt``:
E the epoch (0-based), S the micro-batches of it already trained, so the name alone orders them and resume finds
the newest without opening any. When a step checkpoint is due, the epoch's pass decides (training/loop/step.py:
``StepSchedule``).

What they hold: a resumable state is made of parts, each owning its own ``state_dict()`` and
``load_state_dict()`` (as torchtitan's checkpoint manager holds its stateful parts); ``TrainState`` puts them
under these keys (last.pt and a step checkpoint alike):

    "model"                              the plain module (DDP's wrapped copy shares its tensors)
    "optimizer", "scheduler"             the optimizer and its warmup/cosine schedule (training/loop/optim.py)
    "epoch", "step", "epoch_sums",       ``Position``: epochs done, micro-batches of the next one trained and
    "metrics"                            their all-reduced sums (a step checkpoint), every epoch's metrics line
    "global_batch", "world_size"         the rows of one step over all ranks and the ranks (``check_global_batch``)
    "rng"                                ``RankStreams``: every rank's RNG streams, {"per_rank": [...]}
                                         (``capture_rng``; the per-rank seed rule: training/core/rng.py)
    "selection", "best_model"            ``Selection`` (training/loop/selection.py), ``BestWeights`` (rank 0's)
    "config", "fingerprint"              the resume rule's entries (``identity_entries``)

Every entry is a CPU copy: a step checkpoint is written in the background while training goes on. Building the
state gathers every rank's RNG streams, so every rank calls ``state_dict``/``save_last``/``save_step``; rank 0,
the writer, gets the contents, the others an empty dict.

Writing: rank 0 alone writes, atomically (training/core/fileio.py: a temp file fsynced, then renamed over the old
one), then every rank waits at a barrier of its own, for up to ``train.checkpoint_timeout_s`` (not the
collective timeout: a large checkpoint on a slow shared filesystem may take longer than any collective should).
A failed write (disk full, file size limit, unwritable directory) raises ``CheckpointWriteError`` naming the path
and leaves the previous file intact. A step checkpoint is written by rank 0 in a background thread
(``BackgroundWriter``) while training goes on, and once it is complete the older step checkpoints beyond
``train.keep_checkpoints`` are deleted (``prune``); the next checkpoint, last.pt and model.pt wait for a write
still under way first, so writes never overlap and a failed one fails the run at the next of them.
``torch.distributed.checkpoint``'s async save is not used: it writes a directory per checkpoint (sharded for
FSDP), where a DDP state is one small file rank 0 already holds.

Reading: rank 0 reads (``torch.load(weights_only=True)``: files hold only tensors and plain Python values) and
broadcasts the result, so every rank takes the same decision and only one reads the disk. A run continues the
newest of last.pt and the step checkpoints, and only when it is the same training (the resume rule:
training/checkpoint/identity.py: ``training_identity``); a checkpoint of a different training is an error
(``ResumeMismatchError``), not a silent fresh start: starting over would overwrite the progress of a different
training in that run directory. With ``train.global_batch_size`` a run resumes on another world size, its RNG
streams reseeded (the message says so); without it ``check_global_batch`` refuses what the identity cannot see
(``nproc_per_node: auto`` on a node with another number of GPUs). Both errors name the two world sizes and say
what to do.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from training.checkpoint.identity import identity_differences, training_identity
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write, log_main, log_rank
from training.core.layout import FINAL_MODEL, LAST_CHECKPOINT
from training.core.rng import rank_seed, seed_process
from training.loop.selection import Selection
from training.models.registry import ModelSpec


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous file at that path is untouched."""


class CheckpointReadError(RuntimeError):
    """A checkpoint exists but cannot be loaded."""


class ResumeMismatchError(RuntimeError):
    """last.pt belongs to a different training than the one asked for."""


class Coordinator(Protocol):
    """What the Checkpointer needs from the process group (``DistContext`` or ``SingleProcess``)."""

    is_main: bool

    def checkpoint_barrier(self, path: Path) -> None: ...

    def broadcast_object(self, obj: Any) -> Any: ...


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` through the project's one atomic write; any failure names the path, the old file stays."""
    try:
        return atomic_write(path, lambda handle: torch.save(obj, handle))
    except Exception as error:
        raise CheckpointWriteError(
            f"cannot write checkpoint {path}: {error}; the previous file (if any) is unchanged"
        ) from error


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise CheckpointReadError(f"cannot load checkpoint {path}: {error}") from error


# The entries of last.pt the resume rule reads: ``identity_entries`` writes them, ``resume_mismatches`` reads them.
CONFIG_ENTRY, FINGERPRINT_ENTRY = "config", "fingerprint"


def identity_entries(config: PipelineConfig, fingerprint: str) -> dict[str, Any]:
    """What a last.pt must hold besides the training state, for the resume rule to recognise its training."""
    return {CONFIG_ENTRY: config.model_dump(mode="json"), FINGERPRINT_ENTRY: fingerprint}


def resume_mismatches(saved: dict[str, Any], config: PipelineConfig, fingerprint: str) -> list[str]:
    """Why the checkpoint ``saved`` cannot be continued with ``config``; empty when it can."""
    return identity_differences(
        training_identity(saved.get(CONFIG_ENTRY) or {}, saved.get(FINGERPRINT_ENTRY)),
        training_identity(config, fingerprint),
    )


def world_change_hint(saved: Mapping[str, Any], config: PipelineConfig) -> str:
    """What to do when a checkpoint written without ``train.global_batch_size`` is resumed with other
    ``nproc_per_node`` or ``nnodes`` (the identity's difference names both values); '' for anything else."""
    saved_train = (saved.get(CONFIG_ENTRY) or {}).get("train") or {}
    moved = [name for name in ("nproc_per_node", "nnodes") if saved_train.get(name) != getattr(config.train, name)]
    if not moved or saved_train.get("global_batch_size") is not None:
        return ""
    return "; " + _world_advice(saved)


def check_global_batch(state: Mapping[str, Any], rank_batch: int, world_size: int, source: object) -> None:
    """A resume trains the global batch its checkpoint was trained with (the rows of one step over all ranks).
    With ``train.global_batch_size`` the identity holds it, so only a run without it gets here with another:
    ``nproc_per_node: auto`` on a node with another number of GPUs. ``ResumeMismatchError`` naming both world
    sizes and both global batches; a checkpoint without the entry is not checked."""
    saved = state.get("global_batch")
    wanted = rank_batch * world_size
    if saved is None or int(saved) == wanted:
        return
    step, epoch = int(state.get("step") or 0), int(state["epoch"])
    where = f"at step {step} of epoch {epoch}" if step else f"after {epoch} epoch(s)"
    raise ResumeMismatchError(
        f"{source}: checkpointed {where} with a global batch of {int(saved)} rows on {state.get('world_size')} "
        f"rank(s); this run has {world_size} rank(s) x {rank_batch} = {wanted}, and without "
        f"train.global_batch_size the world size changes the weights; {_world_advice(state)}"
    )


def _world_advice(saved: Mapping[str, Any]) -> str:
    return (
        f"resume it on its {saved.get('world_size')} rank(s): only a run started with train.global_batch_size "
        f"(this one's: {saved.get('global_batch')}) resumes on another world size"
    )


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


class Checkpointer:
    """Rank 0's writes of last.pt, the step checkpoints and model.pt, and the reading of the checkpoint a run
    continues or the model.pt it starts warm from (module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        coordinator: Coordinator,
        before_write: Callable[[Path], None] = lambda _: None,
        after_write: Callable[[Path], None] = lambda _: None,
        keep_steps: int = 2,
    ):
        self.run_dir = Path(run_dir)
        self.coordinator = coordinator
        # Test hooks (training/loop/hooks.py: KEEP_CHECKPOINTS_ENV, the slow_checkpoint action), on the writer.
        self.before_write, self.after_write = before_write, after_write
        self.last_path = self.run_dir / LAST_CHECKPOINT
        self.final_path = self.run_dir / FINAL_MODEL
        self.keep_steps = keep_steps  # train.keep_checkpoints
        self.resumed_from: Path | None = None  # the file load_resumable continued, on rank 0
        self._writer = BackgroundWriter()  # step checkpoints, on rank 0

    def save_last(self, state: dict[str, Any]) -> None:
        """last.pt after an epoch; then the step checkpoints it supersedes go (rank 0: ``state["epoch"]``)."""
        self._save(state, self.last_path)
        if self.coordinator.is_main:
            prune(self.last_path.parent, self.keep_steps, before=(int(state["epoch"]), 0))

    def save_step(self, snapshot: dict[str, Any], epoch: int, micro_batches: int) -> None:
        """A step checkpoint of the state once ``micro_batches`` micro-batches of ``epoch`` are trained, written by
        rank 0 in the background: ``snapshot`` must be CPU copies no training step touches. The other ranks go on
        at once."""
        if not self.coordinator.is_main:
            return
        path = self.path_at(epoch, micro_batches)

        def write() -> None:
            self.before_write(path)
            atomic_save(snapshot, path)
            self.after_write(path)
            prune(path.parent, self.keep_steps)  # only now: the new one is complete

        self._writer.submit(write)

    def path_at(self, epoch: int, micro_batches: int) -> Path:
        """The checkpoint once ``micro_batches`` micro-batches of ``epoch`` are trained: a step checkpoint, or
        last.pt at an epoch's end (``micro_batches`` 0)."""
        if not micro_batches:
            return self.last_path
        return step_checkpoint_path(self.last_path.parent, epoch, micro_batches)

    def wait_for_writes(self, raise_error: bool = True) -> None:
        """Rank 0: the step checkpoint under way is complete, or its error raised here (``raise_error``) or
        logged (the run is failing already: its own error is the one to report)."""
        if not self.coordinator.is_main:
            return
        try:
            self._writer.wait()
        except Exception as error:
            if raise_error:
                raise
            log_rank(f"rank 0: a step checkpoint write failed too: {error}")

    def save_final(self, payload: dict[str, Any]) -> None:
        self._save(payload, self.final_path)

    def _save(self, obj: dict[str, Any], path: Path) -> None:
        if self.coordinator.is_main:
            self._writer.wait()  # one write at a time; a failed step checkpoint fails the run here
            self.before_write(path)
            atomic_save(obj, path)
            self.after_write(path)
        # Nobody runs ahead (or exits) before the file is complete.
        self.coordinator.checkpoint_barrier(path)

    def load_resumable(self, config: PipelineConfig, fingerprint: str) -> dict[str, Any] | None:
        """last.pt's contents when this run should continue from it; None when there is none."""

        def read() -> dict[str, Any] | None:
            remove_torn_writes(self.last_path.parent)
            path, saved = self._newest_resumable()
            if path is None:
                return None
            problems = resume_mismatches(saved, config, fingerprint)
            if problems:
                raise ResumeMismatchError(
                    f"{path} belongs to a different training ({'; '.join(problems)}); "
                    "it is left untouched: use a new run directory, or delete it to start over"
                    + world_change_hint(saved, config)
                )
            self.resumed_from = path
            return saved

        return self._read_on_main(read)

    def _newest_resumable(self) -> tuple[Path | None, dict[str, Any] | None]:
        """last.pt or the newest step checkpoint, whichever is further into the training, and its contents."""
        steps = step_checkpoints(self.last_path.parent)
        last = load_checkpoint(self.last_path) if self.last_path.exists() else None
        # last.pt after E epochs is at position (E, 0); a step checkpoint's name holds its position.
        if steps and (last is None or step_position(steps[-1]) > (int(last["epoch"]), 0)):
            return steps[-1], load_checkpoint(steps[-1])
        return (self.last_path, last) if last is not None else (None, None)

    def load_warm_start(
        self, init_weights: str | None, model_spec: dict[str, Any], features: list[str]
    ) -> dict[str, torch.Tensor] | None:
        """Weights of a previous model.pt when its architecture and features match; else None (with a message)."""
        if not init_weights:
            return None

        def read() -> dict[str, torch.Tensor] | None:
            path = Path(init_weights)
            if not path.exists():
                log_rank(f"warm start: {path} does not exist; training from scratch")
                return None
            payload = load_checkpoint(path)
            # A spec without ``inputs`` compares with its features as numeric inputs.
            saved_spec, wanted_spec = payload.get("model_spec"), ModelSpec.from_dict(model_spec, features).to_dict()
            if isinstance(saved_spec, dict):
                saved_spec = ModelSpec.from_dict(saved_spec, payload.get("features")).to_dict()
            if warm_start_shape(saved_spec) != warm_start_shape(wanted_spec) or payload.get("features") != features:
                saved_features = len(payload.get("features") or [])
                log_rank(
                    f"warm start: {path} has model_spec {payload.get('model_spec')} on {saved_features} "
                    f"features, this run needs {model_spec} on {len(features)} features; training from scratch"
                )
                return None
            log_rank(f"warm start: weights from {path}")
            return payload["model"]

        return self._read_on_main(read)

    def _read_on_main(self, read):
        """Rank 0 runs ``read``; every rank gets its result or raises its error."""
        result, error = None, None
        if self.coordinator.is_main:
            try:
                result = read()
            except Exception as exc:
                error = exc
        result, error = self.coordinator.broadcast_object((result, error))
        if error is not None:
            raise error
        return result


def warm_start_shape(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A model spec as a warm start compares it: each numeric input's bins (training/models/numeric_embeddings.py)
    by their count alone. The weights' shapes depend on the counts; the edges are the train quantiles of the data
    at hand, which a model warm-started on new data should encode with."""
    if not isinstance(spec, dict) or not spec.get("inputs"):
        return spec
    inputs = [{**entry, "bins": len(entry["bins"])} if entry.get("bins") else entry for entry in spec["inputs"]]
    return {**spec, "inputs": inputs}


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


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams; plain tensors and tuples (no numpy) for weights_only loading."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
        goes on (``Checkpointer.save_step``). Every rank calls it, between two optimizer steps."""
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
