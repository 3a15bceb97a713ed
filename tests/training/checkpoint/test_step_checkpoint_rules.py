"""Step checkpoints without torchrun: when one is due, pruning, the background write, which file resume takes."""

from __future__ import annotations

import pytest
import torch

from ddpflow.rundirs import find_resumable_run
from tests.training.test_train_ddp import job_config
from training.checkpoint.files import (
    Checkpointer,
    CheckpointWriteError,
    identity_entries,
    prune,
    step_checkpoint_path,
    step_checkpoints,
    step_position,
)
from training.distributed.context import SingleProcess
from training.loop.counting import OptimizerSteps
from training.loop.step import StepSchedule


def due_steps(schedule: StepSchedule, epochs: int = 2) -> list[tuple[int, int]]:
    """(epoch, steps trained) of each checkpoint the schedule asks for."""
    return [(e, s + 1) for e in range(epochs) for s in range(schedule.steps.micro_batches) if schedule.due(e, s)]


def test_a_step_checkpoint_is_due_every_n_optimizer_steps_of_the_run_never_mid_step_or_at_an_epoch_end():
    every_4 = StepSchedule(4, None, OptimizerSteps(grad_accum=1, micro_batches=10), rank0_flag=bool)
    assert due_steps(every_4) == [(0, 4), (0, 8), (1, 2), (1, 6)]  # run steps 4, 8, 12, 16 (20 is an epoch end)
    # grad_accum 2: 5 optimizer steps an epoch; every 2 of them, at the micro-batch closing the step.
    accumulated = StepSchedule(2, None, OptimizerSteps(grad_accum=2, micro_batches=10), rank0_flag=bool)
    assert due_steps(accumulated) == [(0, 4), (0, 8), (1, 2), (1, 6)]
    assert due_steps(StepSchedule(None, None, OptimizerSteps(1, 10), bool)) == []


def test_a_time_interval_asks_rank_0_and_restarts_after_each_write():
    asked = []

    def rank0_flag(due: bool) -> bool:
        asked.append(due)
        return due

    schedule = StepSchedule(None, 3600.0, OptimizerSteps(grad_accum=1, micro_batches=5), rank0_flag=rank0_flag)
    assert due_steps(schedule, 1) == [] and asked == [False] * 4  # one question per step, not the last
    schedule.last_at -= 3600.0
    assert schedule.due(0, 0)
    schedule.written()
    assert not schedule.due(0, 1)


def test_pruning_keeps_the_newest_and_drops_what_last_pt_covers(tmp_path):
    for epoch, step in [(0, 4), (0, 8), (1, 2), (1, 6), (1, 10)]:
        step_checkpoint_path(tmp_path, epoch, step).write_bytes(b"x")
    (tmp_path / ".step-e00001-s00000012.pt-abc.tmp").write_bytes(b"torn")
    prune(tmp_path, keep=3)
    assert [step_position(p) for p in step_checkpoints(tmp_path)] == [(1, 2), (1, 6), (1, 10)]
    prune(tmp_path, keep=3, before=(1, 6))
    assert [step_position(p) for p in step_checkpoints(tmp_path)] == [(1, 6), (1, 10)]


def state(epoch: int, step: int, config) -> dict:
    return {"epoch": epoch, "step": step, "model": {"w": torch.ones(1)}, **identity_entries(config, "fp")}


def test_resume_takes_the_newest_of_last_pt_and_the_step_checkpoints(tmp_path):
    config, run_dir = job_config(), tmp_path / "runs" / "run-1"
    checkpointer = Checkpointer(run_dir, SingleProcess(), keep_steps=2)
    checkpointer.save_step(state(0, 4, config), 0, 4)
    checkpointer.wait_for_writes()
    (run_dir / "checkpoints" / ".last.pt-x.tmp").write_bytes(b"torn")  # a write killed mid-way
    saved = checkpointer.load_resumable(config, "fp")
    assert (saved["epoch"], saved["step"], checkpointer.resumed_from.name) == (0, 4, "step-e00000-s00000004.pt")
    assert not (run_dir / "checkpoints" / ".last.pt-x.tmp").exists()
    # The pipeline resumes a run directory holding only a step checkpoint too.
    config.write_json(run_dir / "config.json")
    (run_dir / "train_config.json").write_text('{"dataset_dir": "data/fp"}')
    assert find_resumable_run(run_dir.parent, "fp", config) == run_dir
    checkpointer.save_last(state(1, 0, config))  # the epoch's end: its step checkpoints go
    assert step_checkpoints(run_dir / "checkpoints") == []
    checkpointer.save_step(state(1, 3, config), 1, 3)
    checkpointer.wait_for_writes()
    assert checkpointer.load_resumable(config, "fp")["step"] == 3
    checkpointer.save_step(state(1, 6, config), 1, 6)
    checkpointer.save_step(state(1, 9, config), 1, 9)  # waits for the write before
    checkpointer.wait_for_writes()
    assert [step_position(p) for p in step_checkpoints(run_dir / "checkpoints")] == [(1, 6), (1, 9)]


def test_a_failed_background_write_fails_the_next_checkpoint_naming_the_path(tmp_path):
    checkpointer = Checkpointer(tmp_path, SingleProcess())
    checkpointer.save_step({"unpicklable": lambda: None}, 0, 2)
    with pytest.raises(CheckpointWriteError, match=r"step-e00000-s00000002\.pt"):
        checkpointer.save_last({"epoch": 1})
    assert step_checkpoints(tmp_path / "checkpoints") == []  # complete or absent


def test_a_resumed_pass_starts_at_its_step_without_reading_the_batches_before_it(monkeypatch):
    from training.loading.batches import InMemoryDataset, SplitTensors, TrainBatches

    split = SplitTensors(torch.randn(50, 3), torch.randint(0, 2, (50,)))
    batches = TrainBatches(split, 1, 2, 4, seed=0, device=torch.device("cpu"), pin_memory=False)
    whole = [batch.indices.tolist() for batch in batches.epoch(1)]
    read = []
    gather = InMemoryDataset.__getitem__
    monkeypatch.setattr(
        InMemoryDataset,
        "__getitem__",
        lambda self, request: read.append(request.rows.tolist()) or gather(self, request),
    )
    torch.manual_seed(7)
    before = torch.get_rng_state()
    resumed = [batch.indices.tolist() for batch in batches.epoch(1, start=4)]
    assert resumed == whole[4:] and len(read) == len(whole) - 4  # steps 0-3 never gathered
    assert torch.equal(torch.get_rng_state(), before), "a resumed pass does not draw the loader's seed again"
