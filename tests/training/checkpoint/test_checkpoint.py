"""The Checkpointer on its own (no torchrun): atomic writes, rank-0-only writes, resume and warm-start rules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from training.checkpoint.files import Checkpointer, ResumeMismatchError, atomic_save, identity_entries
from training.core.config import load_config
from training.distributed.context import SingleProcess

REPO = Path(__file__).resolve().parents[3]


class NotMain(SingleProcess):
    is_main = False

    def __init__(self):
        self.barriers = []

    def checkpoint_barrier(self, path) -> None:
        self.barriers.append(path.name)


def saved_state(config, epoch: int = 1, fingerprint: str = "fp") -> dict:
    """A last.pt of the shape ``Trainer.state_dict()`` writes."""
    return {
        "model": {"w": torch.ones(3)},
        "optimizer": {},
        "scheduler": None,
        "epoch": epoch,
        "rng": {"per_rank": []},
        "world_size": 2,
        "metrics": [],
        **identity_entries(config, fingerprint),  # what the resume rule reads, under its own key names
    }


def run_python(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter of its own (its rlimits, its process group), from the repository."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_a_failed_write_names_the_path_and_keeps_the_good_checkpoint(tmp_path):
    # A real write failure: RLIMIT_FSIZE in a child process (root ignores chmod),
    # SIGXFSZ ignored so that write() fails with EFBIG.
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from training.checkpoint.files import Checkpointer, CheckpointWriteError
        from training.distributed.context import SingleProcess
        checkpointer = Checkpointer({str(tmp_path)!r}, SingleProcess())
        checkpointer.save_last({{"model": {{"w": torch.ones(100)}}, "epoch": 1}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            checkpointer.save_last({{"model": {{"w": torch.ones(1_000_000)}}, "epoch": 2}})
        except CheckpointWriteError as error:
            print("ERROR", error)
        """
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr
    assert "ERROR cannot write checkpoint" in done.stdout and str(tmp_path / "checkpoints" / "last.pt") in done.stdout
    last = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == 1 and last["model"]["w"].shape == (100,)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.pt"]  # the temp file was removed


def test_an_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=str(blocker / "last.pt")):
        atomic_save({"x": 1}, blocker / "last.pt")


def test_only_the_main_rank_writes_but_every_rank_waits(tmp_path):
    coordinator = NotMain()
    hooked = []
    checkpointer = Checkpointer(tmp_path, coordinator, before_write=hooked.append)
    checkpointer.save_last({"epoch": 1})
    checkpointer.save_final({"model": {}})
    assert not any(tmp_path.rglob("*.pt")) and coordinator.barriers == ["last.pt", "model.pt"]
    assert hooked == []  # the write hook (faults.py: slow_checkpoint) runs on the writer only

    main = Checkpointer(tmp_path, SingleProcess(), before_write=lambda path: hooked.append(path.exists()))
    main.save_last({"epoch": 1})
    assert hooked == [False]  # before the file is written


def test_a_single_process_group_has_its_own_checkpoint_barrier():
    """DistContext's barrier after a write runs on a gloo group of its own, apart from the collectives' group
    (one-rank gloo here). That its timeout is train.checkpoint_timeout_s, not the collective one, is shown by a
    real write that outlasts it: tests/training/test_train_ddp.py, test_a_checkpoint_write_beyond_checkpoint_timeout."""
    script = textwrap.dedent(
        """
        import datetime, torch.distributed as dist
        from training.core.config import load_config
        from training.distributed.context import distributed
        config = load_config(None, ["train.checkpoint_timeout_s=7", "train.backend=gloo"])
        with distributed(config.train) as ctx:
            group = ctx.checkpoint_group
            assert group is not None and group is not dist.group.WORLD
            assert dist.distributed_c10d._get_pg_default_device(group).type == "cpu"
            ctx.checkpoint_barrier("last.pt")
            print("BARRIER PASSED")
        """
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr
    assert "BARRIER PASSED" in done.stdout


def test_resume_continues_the_same_training_only(tmp_path):
    config = load_config(None, ["train.epochs=2", "train.lr=0.01"])
    checkpointer = Checkpointer(tmp_path, SingleProcess())
    assert checkpointer.load_resumable(config, "fp") is None  # nothing to resume
    checkpointer.save_last(saved_state(config))

    assert checkpointer.load_resumable(config, "fp")["epoch"] == 1
    # More epochs is another training (training/checkpoint/identity.py: the resume rule).
    with pytest.raises(ResumeMismatchError, match=r"train\.epochs 2 != 5"):
        checkpointer.load_resumable(load_config(None, ["train.epochs=5", "train.lr=0.01"]), "fp")
    # Settings that do not change the training itself may differ.
    assert checkpointer.load_resumable(
        load_config(None, ["train.epochs=2", "train.lr=0.01", "train.progress_interval_s=1"]), "fp"
    )
    with pytest.raises(ResumeMismatchError, match=r"train\.lr 0\.01 != 0\.1"):
        checkpointer.load_resumable(load_config(None, ["train.epochs=2", "train.lr=0.1"]), "fp")
    with pytest.raises(ResumeMismatchError, match="fingerprint"):
        checkpointer.load_resumable(config, "another")


def test_a_cosine_schedule_pins_the_epoch_count(tmp_path):
    config = load_config(None, ["train.epochs=3", "train.lr_schedule=cosine"])
    checkpointer = Checkpointer(tmp_path, SingleProcess())
    checkpointer.save_last(saved_state(config))
    assert checkpointer.load_resumable(config, "fp") is not None
    with pytest.raises(ResumeMismatchError, match=r"train\.epochs 3 != 4"):
        checkpointer.load_resumable(load_config(None, ["train.epochs=4", "train.lr_schedule=cosine"]), "fp")


def test_warm_start_needs_the_same_architecture_and_features(tmp_path, capsys):
    spec = {"model": "mlp", "n_features": 2, "n_outputs": 3, "model_kwargs": {}}
    atomic_save(
        {"model": {"w": torch.full((2,), 7.0)}, "model_spec": spec, "features": ["a", "b"]}, tmp_path / "model.pt"
    )
    checkpointer = Checkpointer(tmp_path / "run", SingleProcess())

    weights = checkpointer.load_warm_start(str(tmp_path / "model.pt"), spec, ["a", "b"])
    assert torch.equal(weights["w"], torch.full((2,), 7.0))
    assert checkpointer.load_warm_start(str(tmp_path / "model.pt"), {**spec, "n_outputs": 4}, ["a", "b"]) is None
    assert checkpointer.load_warm_start(str(tmp_path / "model.pt"), spec, ["b", "a"]) is None
    assert checkpointer.load_warm_start(str(tmp_path / "missing.pt"), spec, ["a", "b"]) is None
    assert checkpointer.load_warm_start(None, spec, ["a", "b"]) is None
    out = capsys.readouterr().out
    assert out.count("training from scratch") == 3 and "does not exist" in out


# --- what last.pt holds: training/checkpoint/files.py: TrainState ------------------------------------------------

# The keys of last.pt and a step checkpoint (docs/architecture.md): files written before TrainState existed hold them.
LAST_PT_KEYS = {
    "model", "optimizer", "scheduler", "epoch", "step", "epoch_sums", "global_batch", "rng", "world_size", "metrics",
    "selection", "best_model", "config", "fingerprint",
}  # fmt: skip


class OneRank(SingleProcess):
    """A one-rank group with the collectives ``TrainState`` and ``EpochSums`` call."""

    device = torch.device("cpu")

    def all_reduce_sum(self, values):
        return [float(torch.as_tensor(value, dtype=torch.float64)) for value in values]

    def all_reduce_int_sum(self, values):
        return [int(value) for value in values]


def train_state(config, run_dir, seed: int):
    from training.checkpoint.files import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    ctx = OneRank()
    return TrainState(config, "fp", ctx, Checkpointer(run_dir, ctx), model, optimizer, scheduler, rank_batch=4)


def test_the_train_state_writes_last_pts_keys_and_resumes_a_step_checkpoint_exactly(tmp_path):
    from types import SimpleNamespace

    from training.loop.counting import EpochSums

    config = load_config(None, ["train.epochs=3", "train.select=best"])
    state = train_state(config, tmp_path, seed=0)
    state.model(torch.ones(5, 3)).sum().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.position.epochs_done, state.position.history = 1, [{"epoch": 0, "val_loss": 0.5}]
    assert state.selection.observe(0, {"val_loss": 0.5, "val_samples": 10})
    state.best.keep(state.model)
    sums = EpochSums(torch.device("cpu"))
    sums.add(SimpleNamespace(indices=torch.arange(4), samples=4), torch.tensor(2.5, dtype=torch.float64))
    state.save_step(1, 2, sums)  # rank 0 writes in the background
    state.checkpointer.wait_for_writes()
    saved = torch.load(tmp_path / "checkpoints" / "step-e00001-s00000002.pt", weights_only=True)
    assert set(saved) == LAST_PT_KEYS
    assert saved["epoch_sums"] == {"loss": 2.5, "rows": 4, "coverage": sums.coverage.totals()}

    resumed = train_state(config, tmp_path, seed=1)  # other initial weights
    resumed.resume_or_seed(resumed.checkpointer.load_resumable(config, "fp"))
    for name, value in state.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value)
    momentum = resumed.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, state.optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert resumed.scheduler.state_dict() == state.scheduler.state_dict()
    assert resumed.position.take_start() == (2, {"loss": 2.5, "rows": 4, "coverage": tuple(sums.coverage.totals())})
    assert (resumed.position.epochs_done, resumed.position.history) == (1, [{"epoch": 0, "val_loss": 0.5}])
    assert resumed.selection.best_epoch == 0 and resumed.best.weights is not None


def test_the_train_state_resumes_a_last_pt_of_the_oldest_format(tmp_path):
    """A last.pt from before step checkpoints, the global batch, selection and best weights (``saved_state``)."""
    config = load_config(None, ["train.epochs=3"])
    old = train_state(config, tmp_path, seed=0)
    atomic_save(
        {**saved_state(config), "model": old.model.state_dict(), "optimizer": old.optimizer.state_dict()},
        tmp_path / "checkpoints" / "last.pt",
    )
    state = train_state(config, tmp_path, seed=1)
    state.resume_or_seed(state.checkpointer.load_resumable(config, "fp"))
    assert state.position.epochs_done == 1 and state.position.take_start() == (0, None)
    assert torch.equal(state.model.weight, old.model.weight) and state.best.weights is None


def test_warm_start_on_new_data_takes_the_weights_when_the_bin_counts_match(tmp_path, capsys):
    """A champion's numeric embeddings on new data: the bins (the new train quantiles) differ, their count is
    what the weights' shapes depend on: the same count warm-starts, another trains from scratch."""
    entry = {"name": "amount", "kind": "numeric", "dtype": "float32", "shape": [], "cardinality": None, "options": {}}
    spec = {"model": "mlp", "n_features": 1, "n_outputs": 2, "model_kwargs": {}}
    saved = {**spec, "inputs": [{**entry, "bins": [0.0, 1.0, 2.0]}]}
    atomic_save({"model": {"w": torch.ones(2)}, "model_spec": saved, "features": ["amount"]}, tmp_path / "model.pt")
    checkpointer = Checkpointer(tmp_path / "run", SingleProcess())
    moved = {**spec, "inputs": [{**entry, "bins": [0.0, 1.5, 2.5]}]}
    assert checkpointer.load_warm_start(str(tmp_path / "model.pt"), moved, ["amount"]) is not None
    more = {**spec, "inputs": [{**entry, "bins": [0.0, 1.0, 2.0, 3.0]}]}
    assert checkpointer.load_warm_start(str(tmp_path / "model.pt"), more, ["amount"]) is None
    assert capsys.readouterr().out.count("training from scratch") == 1
