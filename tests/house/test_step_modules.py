"""An optimizer step crosses at most ``MAX_STEP_MODULES`` modules of training/, an epoch at most
``MAX_EPOCH_MODULES``: counted from a trace of a real run, not from a hand-kept list. Both bounds are the aims
(8 and 12; a step crosses 7, an epoch 12: the rank program, the pass and validation, the counts and records, the
selection with its stop request, the one checkpoint module, how a rank writes (atomic files, appended lines, log
lines), the process group's collectives (DDP's gradient all-reduce carrying the stop flags among them), the
batches, the model and its objective with its metric tallies), so a module more in either fails.

The run: the real ``Trainer`` (training/train.py) in one process, a gloo group of one (as ``python -m
training.train`` runs without torchrun), 3 epochs of 8 micro-batches, ``train.grad_accum`` 2 (4 optimizer
steps an epoch; a step's first micro-batch runs under ``no_sync``, its last all-reduces and updates), step
checkpoints and step curves switched on so that their decisions run (the traced step writes neither, as most
steps do not; the traced epoch writes both), progress lines only at the epoch's end. ``sys.setprofile``
records the module of every Python function called on the training thread; the windows are cut where the
pass starts a micro-batch (``TrainHooks.micro_batches``, the test hooks' view of them; with no test hook the
micro-batches pass through untouched):

- one optimizer step: from its first micro-batch's start to the next step's first (epoch 1, step 1: the
  fetch of the batches, forward, backward, the update, the sums, the progress line, the checkpoint decision);
- one epoch: from epoch 1's first micro-batch to epoch 2's (its steps, the end of the epoch, validation,
  model selection, last.pt and metrics.jsonl, and the next epoch's start).

A module counts when code defined in it runs in the window (a repository module under training/). The
test prints both lists with each module's lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_STEP_MODULES, MAX_EPOCH_MODULES = 8, 12
MICRO_BATCHES, GRAD_ACCUM, EPOCHS, BATCH = 8, 2, 3, 16
TRACED_EPOCH, TRACED_STEP = 1, 1  # neither the first nor the last: a step and an epoch in the middle of a run


def module_of(filename: str) -> str | None:
    """``training/loop/step.py`` for a file of the training package; None for any other code."""
    path = Path(filename)
    if not path.is_absolute() or REPO / "training" not in path.parents:
        return None
    return str(path.relative_to(REPO))


class Recorder:
    """The training modules whose functions are called, per window; a window opens at each micro-batch."""

    def __init__(self) -> None:
        self.windows: dict[tuple[int, int], set[str]] = {}
        self.current: set[str] = set()
        self._modules: dict[str, str | None] = {}

    def open(self, epoch: int, index: int) -> None:
        self.current = self.windows.setdefault((epoch, index), set())

    def profile(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename not in self._modules:
            self._modules[filename] = module_of(filename)
        if self._modules[filename]:
            self.current.add(self._modules[filename])

    def between(self, first: tuple[int, int], stop: tuple[int, int]) -> list[str]:
        """The modules of the windows from ``first`` (included) to ``stop`` (excluded)."""
        found: set[str] = set()
        for key, modules in self.windows.items():
            if first <= key < stop:
                found |= modules
        return sorted(found)


def trace_run(job_path: str, out_path: str) -> None:
    """The rank side (a fresh interpreter): train the job, traced; write the step's and the epoch's modules."""
    from training.core.job import TrainJob
    from training.distributed.context import distributed
    from training.loop.hooks import TrainHooks
    from training.train import Trainer

    recorder = Recorder()

    class Marks(TrainHooks):
        """Opens a window as each micro-batch starts, in this module (not under training/: not counted). Every other
        hook point is a no-op of this module too, so the trace counts what a user's run (no hooks) runs."""

        def micro_batches(self, epoch, batches, start):
            for index, batch in enumerate(batches, start):
                recorder.open(epoch, index)
                yield index, batch

        def on_model(self, model):
            pass

        def epoch_rows(self, epoch, rows):
            return rows

        def end_epoch(self, epoch):
            pass

        def before_checkpoint_write(self, path):
            pass

        def after_checkpoint_write(self, path):
            pass

    job = TrainJob.read(job_path)
    with distributed(job.config.train) as ctx:
        trainer = Trainer(job, ctx, Marks())
        sys.setprofile(recorder.profile)
        try:
            trainer.train()
        finally:
            sys.setprofile(None)
    first = TRACED_STEP * GRAD_ACCUM
    step = recorder.between((TRACED_EPOCH, first), (TRACED_EPOCH, first + GRAD_ACCUM))
    epoch = recorder.between((TRACED_EPOCH, 0), (TRACED_EPOCH + 1, 0))
    Path(out_path).write_text(json.dumps({"step": step, "epoch": epoch}))


def traced_modules(tmp_path: Path) -> dict[str, list[str]]:
    from tests.training.test_train_ddp import job_config, write_dataset, write_job

    rows = {"train": MICRO_BATCHES * BATCH, "val": 24, "test": 8}
    dataset = write_dataset(tmp_path, rows, seed=5, name="fp-trace")
    settings = {"epochs": EPOCHS, "batch_size": BATCH, "grad_accum": GRAD_ACCUM, "backend": "gloo"}
    # A step checkpoint at run step 5 and a step line at 4 and 8 (in the epoch), none in the step (run step 6).
    config = job_config(1, 0, **settings, checkpoint_every_steps=5, log_every_steps=4, progress_interval_s=3600)
    job = write_job(tmp_path / "run", dataset, config)
    out = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a group of one on loopback, as without torchrun
    script = f"from tests.house.test_step_modules import trace_run; trace_run({str(job)!r}, {str(out)!r})"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "run" / "model.pt").exists()
    return json.loads(out.read_text())


def describe(title: str, modules: list[str]) -> str:
    lines = {module: len((REPO / module).read_text().splitlines()) for module in modules}
    shown = "\n".join(f"  {count:5d}  {module}" for module, count in lines.items())
    return f"{title}: {len(modules)} modules, {sum(lines.values())} lines\n{shown}"


def test_a_step_and_an_epoch_cross_few_modules(tmp_path):
    traced = traced_modules(tmp_path)
    step, epoch = traced["step"], traced["epoch"]
    print(describe("one optimizer step", step))
    print(describe("one epoch", epoch))
    assert "training/loop/step.py" in step and set(step) <= set(epoch)  # the trace saw the pass
    assert len(step) <= MAX_STEP_MODULES, describe("one optimizer step", step)
    assert len(epoch) <= MAX_EPOCH_MODULES, describe("one epoch", epoch)
