"""ddpflow/rundirs.py: confined, unique run directories, and the resume rule it shares with the checkpointer."""

from __future__ import annotations

import fcntl
import json
import re
from pathlib import Path

import pytest
import torch

from ddpflow.launch.failure import LaunchError
from ddpflow.launch.supervisor import LOCK_FILE, is_locked, run_dir_lock
from ddpflow.rundirs import find_resumable_run, new_run_dir, record_mlflow_run, resume_epoch
from training.checkpoint.files import Checkpointer, ResumeMismatchError
from training.core.config import PipelineConfig, load_config
from training.distributed.context import SingleProcess


@pytest.mark.parametrize(
    "name", ["../../etc", "/etc/passwd", "a/b/../../..", "..", "", "  ", "nested/name", "~root", "x" * 500]
)
def test_run_names_cannot_leave_run_root(tmp_path, name):
    root = tmp_path / "runs"
    run_dir = new_run_dir(root, name)
    assert run_dir.parent == root.resolve() and run_dir.is_dir()
    assert re.fullmatch(r"\d{8}-\d{6}-[A-Za-z0-9._-]+", run_dir.name), run_dir.name
    assert ".." not in run_dir.name and "/" not in run_dir.name


def test_a_readable_name_is_kept(tmp_path):
    assert new_run_dir(tmp_path, "mlp-synthetic_v2").name.endswith("-mlp-synthetic_v2")


def test_two_runs_with_the_same_name_never_share_a_directory(tmp_path):
    dirs = {new_run_dir(tmp_path, "same") for _ in range(5)}
    assert len(dirs) == 5 and all(d.is_dir() for d in dirs)


def make_run(root: Path, name: str, config: PipelineConfig, fingerprint: str, *, checkpoint=True, model=False) -> Path:
    """A run directory as an interrupted launch leaves it: config.json, the job, and last.pt after epoch 1."""
    run_dir = root / name
    (run_dir / "checkpoints").mkdir(parents=True)
    config.write_json(run_dir / "config.json")
    (run_dir / "train_config.json").write_text(
        json.dumps({"dataset_dir": f"/data/shards/{fingerprint}", "run_dir": str(run_dir)})
    )
    if checkpoint:  # what training/train.py saves: the run's config and data fingerprint travel with the weights
        state = {"model": {"w": torch.ones(2)}, "epoch": 1, "config": config.model_dump(mode="json")}
        Checkpointer(run_dir, SingleProcess()).save_last({**state, "fingerprint": fingerprint})
    if model:
        (run_dir / "model.pt").write_bytes(b"x")
    return run_dir


def test_resume_picks_the_latest_unfinished_run_of_the_same_config_and_data(tmp_path):
    config = PipelineConfig.model_validate({"train": {"epochs": 3}})
    older = make_run(tmp_path, "20260101-000000-a", config, "fp1")
    newer = make_run(tmp_path, "20260102-000000-a", config, "fp1")
    make_run(tmp_path, "20260103-000000-finished", config, "fp1", model=True)
    make_run(tmp_path, "20260104-000000-no-checkpoint", config, "fp1", checkpoint=False)
    make_run(tmp_path, "20260105-000000-other-data", config, "fp2")
    make_run(tmp_path, "20260106-000000-other-config", PipelineConfig.model_validate({"train": {"epochs": 4}}), "fp1")
    assert find_resumable_run(tmp_path, "fp1", config) == newer
    # Operational fields (timeout, restarts) do not make it a different training run.
    relaxed = PipelineConfig.model_validate({"train": {"epochs": 3, "timeout_s": 10, "max_restarts": 5}})
    assert find_resumable_run(tmp_path, "fp1", relaxed) == newer
    # A run dir that a live launch holds is not resumable.
    with open(newer / LOCK_FILE, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert find_resumable_run(tmp_path, "fp1", config) == older
    assert find_resumable_run(tmp_path, "fp3", config) is None
    assert find_resumable_run(tmp_path / "missing", "fp1", config) is None


BASE = ["train.epochs=3", "train.lr=0.01"]


@pytest.mark.parametrize(
    ("change", "resumes"),
    [
        ([], True),
        (["train.timeout_s=10", "train.max_restarts=5", "train.collective_timeout_s=30"], True),  # operational
        (["train.progress_interval_s=1", "train.num_threads=1", "train.backend=gloo"], True),
        (["train.init_from=champion", "train.run_root=elsewhere", "data.root=elsewhere"], True),
        (["train.epochs=5"], False),  # more epochs: a new training (the decided rule)
        (["train.epochs=2"], False),
        (["train.lr=0.1"], False),
        (["train.lr_schedule=cosine"], False),
        (["train.nproc_per_node=2"], False),  # another global batch
        (["train.seed=7"], False),
        (["train.model_kwargs={hidden: [8]}"], False),
    ],
)
def test_the_pipeline_and_the_checkpointer_agree_on_what_resumes(tmp_path, change, resumes):
    """The run directory the pipeline picks is exactly one whose last.pt the checkpointer continues."""
    run_dir = make_run(tmp_path, "20260101-000000-a", load_config(None, BASE), "fp1")
    config = load_config(None, BASE + change)

    picked = find_resumable_run(tmp_path, "fp1", config)
    try:
        Checkpointer(run_dir, SingleProcess()).load_resumable(config, "fp1")
        continued = True
    except ResumeMismatchError:
        continued = False
    assert (picked == run_dir, continued) == (resumes, resumes)


def test_other_data_resumes_in_neither_place(tmp_path):
    run_dir = make_run(tmp_path, "20260101-000000-a", load_config(None, BASE), "fp1")
    assert find_resumable_run(tmp_path, "fp2", load_config(None, BASE)) is None
    with pytest.raises(ResumeMismatchError, match=r"dataset fingerprint 'fp1' != 'fp2'"):
        Checkpointer(run_dir, SingleProcess()).load_resumable(load_config(None, BASE), "fp2")


def test_a_run_recorded_with_model_mlp_is_the_same_training_as_the_default_auto_on_a_table(tmp_path):
    """train.model defaults to auto; what auto resolves to for the inputs is what the identity holds, so a run
    directory (and a champion's identity tag) recorded with ``model: mlp``, as every run was before, resumes."""
    from types import SimpleNamespace

    from ddpflow.tracking.runs import training_identity_tag
    from training.kinds.inputs import InputInfo, numeric_input
    from training.models.registry import with_resolved_model

    table = SimpleNamespace(
        inputs=[numeric_input("hours").to_dict(), InputInfo("city", "categorical", "int64", cardinality=9).to_dict()]
    )
    run_dir = make_run(tmp_path, "20260101-000000-a", load_config(None, [*BASE, "train.model=mlp"]), "fp1")
    default = load_config(None, BASE)
    assert default.train.model == "auto"
    resolved = with_resolved_model(default, table)
    assert resolved.train.model == "mlp" and default.train.model == "auto"
    assert find_resumable_run(tmp_path, "fp1", resolved) == run_dir
    Checkpointer(run_dir, SingleProcess()).load_resumable(resolved, "fp1")  # no ResumeMismatchError
    mlp = load_config(None, [*BASE, "train.model=mlp"])
    assert training_identity_tag(resolved, "fp1") == training_identity_tag(mlp, "fp1")
    images = SimpleNamespace(inputs=[InputInfo("photo", "image", "float32", (3, 8, 8)).to_dict()])
    assert with_resolved_model(default, images).train.model == "image_cnn"
    assert find_resumable_run(tmp_path, "fp1", with_resolved_model(default, images)) is None
    custom = load_config(None, [*BASE, "train.model=my_pkg.nets:wide"])
    assert with_resolved_model(custom, table) is custom


def test_the_lock_file_exists_only_while_a_launch_holds_it(tmp_path):
    with run_dir_lock(tmp_path):
        assert (tmp_path / LOCK_FILE).is_file() and is_locked(tmp_path)
        with pytest.raises(LaunchError, match="in use by another launch"), run_dir_lock(tmp_path):
            pass
    assert not (tmp_path / LOCK_FILE).exists() and not is_locked(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists(), "is_locked never creates it"


def test_a_run_directory_names_its_mlflow_runs_and_the_epoch_a_rerun_resumes_from(tmp_path):
    assert record_mlflow_run(tmp_path, "first") is None
    assert record_mlflow_run(tmp_path, "first") is None, "the same run again is no resume"
    assert record_mlflow_run(tmp_path, "second") == "first"
    assert resume_epoch(tmp_path) is None, "no checkpoint: a re-run starts over"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n{"epoch": 1}\n{"torn')
    assert resume_epoch(tmp_path) == 3, "two epochs done (one logged twice), a torn line skipped"
    (tmp_path / "model.pt").write_bytes(b"")
    assert resume_epoch(tmp_path) is None, "finished: nothing to resume"
