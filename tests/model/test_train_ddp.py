"""The training program under REAL torchrun launches: 2 CPU ranks, gloo, tiny data.

One launch feeds several assertions (module-scoped fixtures), so the whole file
runs a handful of launches. The dataset is written straight from the manifest
contract with exact split sizes: train rows divisible by every batch used
(so that 2 ranks x b and 1 rank x 2b see the same rows per step), val rows odd
(so that exact validation cannot hide behind padding).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.config import load_config
from training.data.manifest import Manifest, ShardInfo, SplitInfo, write_manifest
from training.job import TrainJob
from training.models import ModelSpec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN_ROWS, VAL_ROWS, FEATURES, CLASSES = 1024, 201, 8, 3
BATCH = 64  # per rank, with 2 ranks
EPOCHS = 2
HIDDEN = [32]


# --- data and launches -------------------------------------------------------------------------


def write_dataset(root: Path, rows: dict[str, int], seed: int = 0) -> Path:
    """A prepared dataset per training/data/manifest.py, two shards per split."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(FEATURES, CLASSES))
    features = [f"f{i}" for i in range(FEATURES)]
    dataset_dir = root / "fp-test"
    splits, train_x = {}, None
    for split, count in rows.items():
        z = rng.normal(size=(count, FEATURES))
        x = (z * 5.0 + 20.0).astype(np.float32)
        y = (z @ teacher).argmax(axis=1).astype(np.int64)
        (dataset_dir / split).mkdir(parents=True)
        shards, half = [], count // 2
        for number, (lo, hi) in enumerate([(0, half), (half, count)]):
            table = pa.table({**{name: x[lo:hi, i] for i, name in enumerate(features)}, "label": y[lo:hi]})
            relative = f"{split}/part-{number:05d}.parquet"
            pq.write_table(table, dataset_dir / relative, row_group_size=100)
            shards.append(ShardInfo(relative, hi - lo, (dataset_dir / relative).stat().st_size))
        splits[split] = SplitInfo(count, shards)
        train_x = x if split == "train" else train_x
    write_manifest(
        dataset_dir,
        Manifest(
            fingerprint="fp-test",
            source="test",
            task="classification",
            label="label",
            key=None,
            features=features,
            label_mapping=["a", "b", "c"],
            feature_mean=train_x.mean(axis=0).tolist(),
            feature_std=train_x.std(axis=0).tolist(),
            splits=splits,
            schema=[],
            config={},
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
            versions={},
        ),
    )
    return dataset_dir


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def model(self) -> dict:
        return torch.load(self.run_dir / "model.pt", weights_only=True)

    def indices(self, rank: int, epoch: int) -> list[int]:
        return json.loads((self.run_dir / "indices" / f"rank{rank}-epoch{epoch}.json").read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_job(run_dir: Path, dataset_dir: Path, init_weights: Path | None = None, **train) -> Path:
    settings = {
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "num_threads": 1,
        "model_kwargs": {"hidden": HIDDEN},
        "lr": 0.01,
        "progress_interval_s": 0.2,
        "collective_timeout_s": 60,
        **train,
    }
    config = load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in settings.items()])
    job = TrainJob(
        config=config,
        dataset_dir=str(dataset_dir),
        run_dir=str(run_dir),
        init_weights=str(init_weights) if init_weights else None,
    )
    return job.write(run_dir / "train_config.json")


def torchrun(*launcher_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args]


def rank_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}
    for name in ("DDPFLOW_FAULT", "DDPFLOW_RECORD_INDICES", "DDPFLOW_MLFLOW_RUN_ID"):
        if name not in extra:
            env.pop(name, None)
    return env


def launch(
    run_dir: Path,
    dataset_dir: Path,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    init_weights: Path | None = None,
    **train,
) -> Launch:
    config = write_job(run_dir, dataset_dir, init_weights, **train)
    argv = torchrun(
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "-m",
        "training.train",
        "--config",
        str(config),
    )
    done = subprocess.run(argv, cwd=REPO, env=rank_env(**(env or {})), capture_output=True, text=True, timeout=240)
    return Launch(run_dir, done.returncode, done.stdout + done.stderr)


def succeeded(result: Launch) -> Launch:
    assert result.returncode == 0, result.output[-4000:]
    return result


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


# --- fixtures: one launch each, shared by the tests ----------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("shards"), {"train": TRAIN_ROWS, "val": VAL_ROWS, "test": 16})


@pytest.fixture(scope="module")
def two_ranks(dataset, tmp_path_factory) -> Launch:
    return succeeded(launch(tmp_path_factory.mktemp("two_ranks"), dataset, env={"DDPFLOW_RECORD_INDICES": "1"}))


@pytest.fixture(scope="module")
def one_rank(dataset, tmp_path_factory) -> Launch:
    return succeeded(
        launch(
            tmp_path_factory.mktemp("one_rank"),
            dataset,
            nproc=1,
            batch_size=2 * BATCH,
            env={"DDPFLOW_RECORD_INDICES": "1"},
        )
    )


# --- tests ------------------------------------------------------------------------------------------


def test_each_epoch_covers_the_train_split_exactly_once_in_a_new_order(two_ranks):
    for epoch in range(EPOCHS):
        rank0, rank1 = two_ranks.indices(0, epoch), two_ranks.indices(1, epoch)
        assert not set(rank0) & set(rank1)
        assert sorted(rank0 + rank1) == list(range(TRAIN_ROWS))
    assert two_ranks.indices(0, 0) != two_ranks.indices(0, 1)


def test_per_epoch_metrics_are_exact_and_ranks_agree(two_ranks):
    records = two_ranks.metrics()
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    for record in records:
        assert record["train_samples"] == TRAIN_ROWS
        assert record["val_samples"] == VAL_ROWS  # 201 rows over 2 ranks: no padding, no row dropped
        assert record["weights_in_sync"] is True
        assert record["restart_count"] == 0 and record["world_size"] == 2
        assert 0 < record["val_accuracy"] <= 1 and record["train_loss"] > 0 and record["lr"] == 0.01
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert two_ranks.output.count("epoch 1/2 done") == 1  # rank 0 alone prints


def test_checkpoints_are_complete_and_load_with_weights_only(two_ranks):
    assert sorted(p.name for p in (two_ranks.run_dir / "checkpoints").iterdir()) == ["last.pt"]  # no temp files left
    last = torch.load(two_ranks.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == EPOCHS and last["fingerprint"] == "fp-test" and last["world_size"] == 2
    assert len(last["rng"]["per_rank"]) == 2 and last["config"]["train"]["batch_size"] == BATCH
    assert {"model", "optimizer", "scheduler", "metrics"} <= last.keys()
    final = two_ranks.model()
    assert final["model_spec"] == ModelSpec("mlp", FEATURES, CLASSES, {"hidden": HIDDEN}).to_dict()
    assert final["features"] == [f"f{i}" for i in range(FEATURES)] and final["label_mapping"] == ["a", "b", "c"]
    assert final["task"] == "classification" and final["epochs"] == EPOCHS and final["fingerprint"] == "fp-test"
    assert len(final["feature_mean"]) == FEATURES and final["metrics"]["epoch"] == EPOCHS - 1
    assert_same_weights(final["model"], last["model"], atol=0)


def test_one_rank_with_double_batch_trains_the_same_weights(two_ranks, one_rank):
    # The same seed gives the same permutation; DistributedSampler's rank r takes perm[r::2].
    for epoch in range(EPOCHS):
        order = one_rank.indices(0, epoch)
        assert two_ranks.indices(0, epoch) == order[0::2] and two_ranks.indices(1, epoch) == order[1::2]
    assert_same_weights(two_ranks.model()["model"], one_rank.model()["model"], atol=1e-5)


def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(two_ranks, dataset, tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    uri, artifacts = mlflow_store
    client = MlflowClient(uri)
    experiment = client.create_experiment("resume", artifact_location=artifacts)
    run_id = client.create_run(experiment).info.run_id
    tracked = {"DDPFLOW_MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": uri}
    run_dir = tmp_path / "resumed"
    # Stopped after one epoch, then continued with more epochs in the same run directory ...
    succeeded(launch(run_dir, dataset, epochs=1, env=tracked))
    # ... where rank 1 is SIGKILLed mid-epoch and torchrun restarts the group, which resumes from last.pt.
    resumed = succeeded(
        launch(run_dir, dataset, max_restarts=1, env={**tracked, "DDPFLOW_FAULT": "kill:rank=1:epoch=1:step=2"})
    )
    assert (run_dir / ".fault-kill-done").exists()
    assert "resumed from" in resumed.output
    assert_same_weights(two_ranks.model()["model"], resumed.model()["model"], atol=1e-6)
    records = resumed.metrics()
    assert [r["epoch"] for r in records] == [0, 1]  # nothing logged twice
    assert [r["restart_count"] for r in records] == [0, 1]
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [0, 1]
    assert [m.value for m in sorted(client.get_metric_history(run_id, "restart_count"), key=lambda m: m.step)] == [0, 1]


def test_two_nodes_on_one_machine_train_like_one_node(two_ranks, dataset, tmp_path):
    """Two torchrun agents (one rank each) rendezvous over c10d. To save a launch they also accumulate
    gradients over 2 micro-batches of BATCH/2 (no_sync on the first): the same rows per optimizer step."""
    run_dir = tmp_path / "two_nodes"
    config = write_job(run_dir, dataset, batch_size=BATCH // 2, grad_accum=2)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            torchrun(
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "0",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "two-nodes",
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "-m",
                "training.train",
                "--config",
                str(config),
            ),
            cwd=REPO,
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)[-4000:]
    result = Launch(run_dir, 0, "".join(outputs))
    assert all(
        r["weights_in_sync"] and r["world_size"] == 2 and r["train_samples"] == TRAIN_ROWS for r in result.metrics()
    )
    assert_same_weights(two_ranks.model()["model"], result.model()["model"], atol=1e-5)


def test_padded_sampler_rows_count_once_on_a_prepared_dataset(two_ranks, tmp_path):
    """prepare_dataset's own output: its train split (odd size here) is not divisible by the world size."""
    from training.data.prepare import prepare_dataset

    data = load_config(
        None,
        [
            "data.source=synthetic://classification?rows=1201&features=5&classes=3&seed=3",
            f"data.root={tmp_path / 'shards'}",
        ],
    ).data
    prepared = prepare_dataset(data)
    train_rows = prepared.manifest.rows("train")
    assert train_rows % 2 == 1, "this test needs an odd train split (change the synthetic rows)"
    # A warm start from a model of other features is refused with a message, and training starts fresh.
    result = succeeded(
        launch(
            tmp_path / "run",
            prepared.dataset_dir,
            epochs=1,
            batch_size=50,
            env={"DDPFLOW_RECORD_INDICES": "1"},
            init_weights=two_ranks.run_dir / "model.pt",
        )
    )
    assert "training from scratch" in result.output
    rows = result.indices(0, 0) + result.indices(1, 0)
    assert sorted(rows) == list(range(train_rows))
    assert result.metrics()[0]["train_samples"] == train_rows
    assert result.metrics()[0]["val_samples"] == prepared.manifest.rows("val")


def test_a_raising_rank_fails_the_launch_with_its_root_cause(two_ranks, dataset, tmp_path):
    # Also a warm start from a matching model.pt (the launch fails before it could train further).
    result = launch(
        tmp_path / "raised",
        dataset,
        env={"DDPFLOW_FAULT": "raise:rank=1:epoch=0"},
        init_weights=two_ranks.run_dir / "model.pt",
    )
    assert "warm start: weights from" in result.output
    assert result.returncode != 0
    assert "injected fault" in result.output
    assert not (tmp_path / "raised" / "model.pt").exists()


def test_ranks_die_with_a_killed_agent(dataset, tmp_path):
    """PR_SET_PDEATHSIG: SIGKILLing torchrun (which cannot then stop its workers) still ends the ranks."""
    import psutil

    config = write_job(tmp_path / "orphans", dataset, collective_timeout_s=600)
    agent = subprocess.Popen(
        torchrun("--standalone", "--nproc-per-node", "2", "-m", "training.train", "--config", str(config)),
        cwd=REPO,
        env=rank_env(DDPFLOW_FAULT="hang:rank=0:epoch=0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks = []
    try:
        marker = tmp_path / "orphans" / ".fault-hang-done"
        deadline = time.monotonic() + 180
        while not marker.exists() and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "rank 0 never reached the hang"
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 2
        agent.kill()
        agent.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"orphaned ranks: {alive}"
    finally:
        for process in ranks:
            if process.is_running():
                process.kill()
        if agent.poll() is None:
            agent.kill()
