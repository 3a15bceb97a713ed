"""Checkpoints: ``RUN_DIR/checkpoints/last.pt`` after every epoch, ``RUN_DIR/model.pt`` at the end.

Writing: rank 0 alone writes, atomically (``training/core/fileio.py``: a temp
file fsynced, then renamed over the old one), then every rank waits at a barrier of its own,
for up to ``train.checkpoint_timeout_s`` (not the collective timeout: a large
checkpoint on a slow shared filesystem may take longer than any collective
should). A failed write (disk full, file size limit, unwritable directory)
raises ``CheckpointWriteError`` naming the path and leaves the previous file
intact.

Reading: rank 0 reads (``torch.load(weights_only=True)``: files hold only
tensors and plain Python values) and broadcasts the result, so every rank takes
the same decision and only one reads the disk.

What last.pt holds is ``TrainState``'s business (training/checkpoint/state.py);
the Checkpointer knows only the entries the resume rule reads
(``identity_entries``: ``CONFIG_ENTRY``, ``FINGERPRINT_ENTRY``).

Resume rule, the only one (ddpflow/rundirs.py picks the run directory to
resume with it too): a run continues only the SAME training, and two trainings
are the same when ``training_identity(config, fingerprint)`` is equal: the
dataset fingerprint plus the train settings that change the trained weights, each
declared so on the field itself in training/core/config.py (``ChangesWeights[...]``: the
model, the optimisation, the batch, the seed, the world, the numerics). Every other
setting (``KeepsWeights[...]``: timeouts, restarts, threads, paths, backend,
init_from, progress interval) may change between attempts.
``train.epochs`` is part of it: raising it is a new training (the pipeline
opens a fresh run directory; last.pt of another epoch count is refused here).
Why: one rule anyone can predict, and a resumed run ends with the weights an
uninterrupted run of the same config would have (also with a cosine schedule,
which depends on the epoch count). To train an existing model longer, start a
new run with ``train.init_from`` pointing at its model.pt.
A last.pt of a different training is an error (``ResumeMismatchError``), not a
silent fresh start: starting over would overwrite the progress of a different
training in that run directory.
Another world size: with ``train.global_batch_size`` (in the identity instead of the
per-rank batch and the ranks) a run resumes on any world size that divides it; the
RNG streams are then reseeded and the message says so. Without it the world size
changes the weights (the global batch is the per-rank batch x the ranks): a changed
``nproc_per_node`` or ``nnodes`` is an identity difference, and ``check_global_batch``
refuses what the identity cannot see (``nproc_per_node: auto`` on a node with another
number of GPUs). Both errors name the two world sizes and say what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from training.checkpoint.steps import (
    BackgroundWriter,
    prune,
    remove_torn_writes,
    step_checkpoint_path,
    step_checkpoints,
    step_position,
)
from training.core.config import DataConfig, PipelineConfig, TrainConfig
from training.core.fileio import atomic_write
from training.core.layout import FINAL_MODEL, LAST_CHECKPOINT
from training.core.log import log_rank
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


def training_identity(config: PipelineConfig | Mapping[str, Any], fingerprint: str | None) -> dict[str, Any]:
    """What makes two trainings the same one: the data's fingerprint and the train fields that change the weights.

    ``config`` is a PipelineConfig or its JSON form (a run's config.json, a checkpoint's
    "config"). Equal identities: a run may continue the other's checkpoint, and two models
    were trained the same way on the same data.
    """
    if isinstance(config, PipelineConfig):
        train = config.train.model_dump(mode="json")
        data = config.data.model_dump(mode="json") if config.data is not None else {}
    else:
        train = dict(config.get("train") or {})
        data = dict(config.get("data") or {})
    omitted = TrainConfig.identity_defaults()  # at its default (or absent: recorded before it existed): left out
    fields = {name: train.get(name, omitted.get(name)) for name in TrainConfig.weight_fields()}
    if fields.get("global_batch_size") is not None:  # the global batch, not how it splits over ranks
        fields = {name: value for name, value in fields.items() if name not in TrainConfig.world_fields()}
    identity = {
        "fingerprint": fingerprint,
        "train": {name: value for name, value in fields.items() if name not in omitted or value != omitted[name]},
    }
    order = DataConfig.order_identity(data)  # the stream's order; {} on the node cache: no entry at all
    return {**identity, "data": order} if order else identity


def identity_differences(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """Each way two ``training_identity`` values differ ("train.lr 0.01 != 0.1"); empty when equal."""
    problems = []
    if saved["fingerprint"] != wanted["fingerprint"]:
        problems.append(f"dataset fingerprint {saved['fingerprint']!r} != {wanted['fingerprint']!r}")
    for name in TrainConfig.weight_fields():
        if saved["train"].get(name) != wanted["train"].get(name):
            problems.append(f"train.{name} {saved['train'].get(name)!r} != {wanted['train'].get(name)!r}")
    saved_data, wanted_data = saved.get("data") or {}, wanted.get("data") or {}
    for name in sorted(saved_data.keys() | wanted_data.keys()):
        absent = False if name == "stream" else None  # the node cache: stream false, no window
        before, now = saved_data.get(name, absent), wanted_data.get(name, absent)
        if before != now:
            problems.append(f"data.{name} {before!r} != {now!r}")
    return problems


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


class Checkpointer:
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
        self._writer = BackgroundWriter()  # step checkpoints, on rank 0 (training/checkpoint/steps.py)

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
        path = step_checkpoint_path(self.last_path.parent, epoch, micro_batches)

        def write() -> None:
            self.before_write(path)
            atomic_save(snapshot, path)
            self.after_write(path)
            prune(path.parent, self.keep_steps)  # only now: the new one is complete

        self._writer.submit(write)

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
