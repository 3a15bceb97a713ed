"""``data.stream`` under REAL torchrun (gloo, CPU ranks): the exact update at any world size, the coverage
certificate, a split four times the cache streamed from an S3 API on loopback (moto's server, the shards written
there by ``ddpflow prepare``), and a run stopped mid-epoch on 2 ranks resumed on 1 and on 3.

Data shaped like a user's (tests/training/loading/test_stream.py: ``user_table``: an int64 input with nulls, a
bool, a skewed amount, a string categorical, row weights), prepared into many small shards. The local split: 330
train rows in 18 shards, windows of 3, a global batch of 12 (2 ranks x 6, 1 x 12, 3 x 4: the last step of an
epoch is 6 rows, and 3 ranks pad), a cache of about half the split's shards, so windows are evicted and read again.

Launches (tests/multi_case.py): 2 ranks (the local reference and the S3 run), the stopped run, 1 rank (the exact
pair and the resume on 1), 3 ranks (the resume on 3).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pyarrow.parquet as pq
import pytest
import torch

from devtools.ports import free_port
from tests.multi_case import launch_cases
from tests.training.loading.test_stream import Poller, user_table
from tests.training.test_step_checkpoints import resumed_step
from tests.training.test_train_ddp import Launch, assert_same_weights, job_config, production_env, report, succeeded
from training.checkpoint.files import Checkpointer, ResumeMismatchError
from training.core.config import load_config
from training.core.layout import LAST_CHECKPOINT
from training.distributed.context import SingleProcess
from training.loading.stream_order import StreamOrder
from training.loop.counting import Certificate

pytestmark = [pytest.mark.torchrun, pytest.mark.server]  # moto's S3 server, started here

REPO = Path(__file__).resolve().parents[2]
ROWS, ROWS_PER_SHARD, WINDOW, GLOBAL_BATCH = 420, 19, 3, 12
S3_ROWS, S3_ROWS_PER_SHARD, S3_WINDOW = 1000, 25, 2
EXACT = 1e-5
RECORD = {"DDPFLOW_RECORD_INDICES": "1"}
INPUTS = {"visits": "numeric", "member": "numeric", "amount": "numeric", "shop": "categorical", "x": "numeric"}
# lr 0.002: AdamW turns the summation order's rounding in a near-zero gradient into a step of up to lr
# (docs/training.md); the categorical's embedding has such rows.
SETTINGS = {
    "batch_size": None, "global_batch_size": GLOBAL_BATCH, "epochs": 2, "lr": 0.002,
    "model_kwargs": {"hidden": [16]},
}  # fmt: skip
STOP_AT, EVERY = 17, 5  # the stopped run fails before step 17 of epoch 1; a step checkpoint every 5 steps


def stream_config(nproc: int, data: list[str], **train):
    """The train settings of tests/training/test_train_ddp.py's launches (``job_config``) and these data settings."""
    config = job_config(nproc, 0, **{**SETTINGS, **train})
    return config.model_copy(update={"data": load_config(None, data).data})


def data_settings(**values) -> list[str]:
    return [f"data.{key}={json.dumps(value)}" for key, value in values.items()]


# --- data ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> tuple[Path, list[str]]:
    """The local dataset, prepared; the data settings its runs use."""
    from training.prepare.dataset import prepare_dataset

    root = tmp_path_factory.mktemp("stream-local")
    pq.write_table(user_table(ROWS, seed=9), root / "users.parquet")
    base = data_settings(
        source=str(root / "users.parquet"), root=str(root / "shards"), inputs=INPUTS, weight="w",
        rows_per_shard=ROWS_PER_SHARD, cache_dir=str(root / "cache"),
    )  # fmt: skip
    prepared = prepare_dataset(load_config(None, base).data)
    shards = prepared.manifest.splits["train"].shards
    largest = max(shard.bytes for split in ("train", "val") for shard in prepared.manifest.splits[split].shards)
    limit = max(2 * WINDOW * largest, sum(shard.bytes for shard in shards) // 2)
    stream = data_settings(stream=True, shuffle_window=WINDOW, stream_cache_limit=limit)
    return Path(prepared.dataset_dir), base + stream


@pytest.fixture(scope="module")
def s3_server():
    """``moto_server`` on a loopback port, its own process (the ranks reach it too); the AWS variables for it."""
    import boto3

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="ddpflow-stream")
                break
            except Exception:  # not listening yet
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def s3(s3_server, tmp_path_factory) -> dict:
    """A dataset written to s3://ddpflow-stream/shards by ``ddpflow prepare``: its URL, its data settings with a
    cache limit of a quarter of its train shards, the limit, the train shards' bytes and the cache's directory."""
    root = tmp_path_factory.mktemp("stream-s3")
    pq.write_table(user_table(S3_ROWS, seed=10), root / "users.parquet")
    base = data_settings(
        source=str(root / "users.parquet"), root="s3://ddpflow-stream/shards", inputs=INPUTS, weight="w",
        rows_per_shard=S3_ROWS_PER_SHARD, cache_dir=str(root / "cache"),
    )  # fmt: skip
    argv = [str(Path(sys.executable).parent / "ddpflow"), "prepare", "--json"]
    argv += [arg for setting in base for arg in ("--set", setting)]
    done = subprocess.run(argv, cwd=root, env={**os.environ, **s3_server}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["dataset_dir"].startswith("s3://ddpflow-stream/shards/")
    from training.core.manifest import read_manifest

    with mock.patch.dict(os.environ, s3_server):
        manifest = read_manifest(summary["dataset_dir"])
    train_bytes = sum(shard.bytes for shard in manifest.splits["train"].shards)
    limit = train_bytes // 4
    largest = max(shard.bytes for split in ("train", "val") for shard in manifest.splits[split].shards)
    assert limit >= 2 * S3_WINDOW * largest, "the split must be 4 x a limit that holds two windows"
    stream = data_settings(stream=True, shuffle_window=S3_WINDOW, stream_cache_limit=limit)
    return {
        "dataset": summary["dataset_dir"],
        "data": base + stream,
        "limit": limit,
        "train_bytes": train_bytes,
        "test_rows": manifest.rows("test"),
        "cache": root / "cache" / manifest.fingerprint / "stream",
    }


# --- launches --------------------------------------------------------------------------------------------------


def run(root: Path, cases: dict, env: dict | None = None) -> dict[str, Launch]:
    first = next(iter(cases.values()))[0]
    results = launch_cases(root, cases, production_env(first, root, **RECORD, **(env or {})))
    return {name: Launch(result.run_dir, result.returncode, result.output) for name, result in results.items()}


@pytest.fixture(scope="module")
def two_ranks(local, s3, s3_server, tmp_path_factory) -> dict:
    """The local reference and the S3 run, one launch; a poller watches the S3 run's cache meanwhile."""
    dataset, data = local
    root = tmp_path_factory.mktemp("stream-w2")
    cases = {
        "local_w2": (stream_config(2, data), dataset),
        "s3_w2": (stream_config(2, s3["data"], global_batch_size=16), s3["dataset"]),
    }
    with Poller(s3["cache"]) as poller:
        launches = run(root, cases, s3_server)
    return {**launches, "s3_cache_most": poller.most}


@pytest.fixture(scope="module")
def stopped(local, tmp_path_factory) -> Launch:
    """2 ranks failing for good before step ``STOP_AT`` of epoch 1 (``checkpointed_step``: its newest checkpoint)."""
    dataset, data = local
    config = stream_config(2, data, checkpoint_every_steps=EVERY)
    root = tmp_path_factory.mktemp("stream-stopped")
    fault = {"DDPFLOW_FAULT": f"raise:rank=0:epoch=1:step={STOP_AT}"}
    result = run(root, {"stopped": (config, dataset)}, fault)["stopped"]
    assert result.returncode != 0 and "injected fault" in result.output, result.output[-3000:]
    return result


def resumed_case(stopped: Launch, root: Path, nproc: int, local) -> tuple:
    dataset, data = local
    run_dir = root / f"resumed_on_{nproc}"
    shutil.copytree(stopped.run_dir, run_dir)
    config = stream_config(nproc, data, checkpoint_every_steps=EVERY)
    return config, dataset


@pytest.fixture(scope="module")
def one_rank(local, stopped, tmp_path_factory) -> dict[str, Launch]:
    """1 rank x 12 (the exact pair of the reference) and the stopped run resumed on 1 rank, one launch."""
    dataset, data = local
    root = tmp_path_factory.mktemp("stream-w1")
    cases = {"local_w1": (stream_config(1, data), dataset)}
    cases["resumed_on_1"] = resumed_case(stopped, root, 1, local)
    return run(root, cases)


@pytest.fixture(scope="module")
def three_ranks(local, stopped, tmp_path_factory) -> dict[str, Launch]:
    root = tmp_path_factory.mktemp("stream-w3")
    return run(root, {"resumed_on_3": resumed_case(stopped, root, 3, local)})


def checkpointed_step(dataset: Path) -> int:
    """The steps of epoch 1 the stopped run's newest step checkpoint holds: one is written once the run's
    optimizer steps (epoch 0's included) are a multiple of EVERY."""
    per_epoch = math.ceil(math.ceil(len(order_of(dataset, 0)) / 2) / (GLOBAL_BATCH // 2))
    return max(step for step in range(STOP_AT + 1) if (per_epoch + step) % EVERY == 0)


def order_of(dataset: Path, epoch: int, window: int = WINDOW) -> list[int]:
    from training.core.manifest import read_manifest

    rows = [shard.rows for shard in read_manifest(dataset).splits["train"].shards]
    return StreamOrder(rows, window, seed=0, epoch=epoch).order().tolist()


# --- tests -----------------------------------------------------------------------------------------------------


def test_two_ranks_and_one_rank_with_twice_the_batch_train_the_same_weights_from_the_stream(two_ranks, one_rank):
    """The stream's one global order, cut into the sampler's slices: rank r trains positions r, r + 2, ... of the
    order the single rank walks; the weighted divisor is the same; the weights end within 1e-5."""
    two, one = succeeded(two_ranks["local_w2"]), succeeded(one_rank["local_w1"])
    dataset = two.dataset_dir()
    for epoch in range(SETTINGS["epochs"]):
        order = order_of(dataset, epoch)
        assert one.indices(0, epoch) == order
        assert [two.indices(rank, epoch) for rank in (0, 1)] == [order[0::2], order[1::2]]
    difference = assert_same_weights(two.model()["model"], one.model()["model"], EXACT)
    report("stream: 2 ranks x 6 vs 1 rank x 12 (weighted rows, a categorical, nulls)", difference)
    for a, b in zip(two.metrics(), one.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    rows = len(order_of(dataset, 0))
    expected = Certificate.expected(rows).metrics()
    for record in two.metrics():  # the certificate: each row once per epoch (checked by the ranks; logged)
        assert {name: record[name] for name in expected} == expected and record["train_samples"] == rows
    assert "data.stream=true: train and val streamed from" in two.output


def test_a_train_split_four_times_the_cache_streams_from_s3_on_two_ranks_within_the_limit(two_ranks, s3, s3_server):
    """From moto's S3 on loopback, 2 ranks, a cache of a quarter of the train shards: the run completes, each row
    once per epoch, and a look at the cache every millisecond never found more than its limit. The model is then
    evaluated on the test split where it lives."""
    result = succeeded(two_ranks["s3_w2"])
    limit, train_bytes = s3["limit"], s3["train_bytes"]
    assert train_bytes >= 4 * limit
    most = two_ranks["s3_cache_most"]
    print(f"\n[stream] s3: cache limit {limit} bytes, the most it held {most}, train shards {train_bytes}")
    assert 0 < most <= limit
    manifest_rows = result.metrics()[0]["coverage_rows"]
    expected = Certificate.expected(manifest_rows).metrics()
    assert [{name: r[name] for name in expected} for r in result.metrics()] == [expected] * SETTINGS["epochs"]
    for epoch in range(SETTINGS["epochs"]):
        assert sorted(result.indices(0, epoch) + result.indices(1, epoch)) == list(range(manifest_rows))
    copied = [float(m) for m in re.findall(r"rank \d: epoch 1: .* copied in ([\d.]+) kB", result.output)]
    assert len(copied) == 2 and sum(copied) * 1e3 >= 2 * train_bytes  # both epochs read every shard again
    assert "streamed from s3://ddpflow-stream/shards/" in result.output
    # Evaluation reads the test split there too, shard by shard, record batch by record batch.
    from training.inference.evaluate import evaluate_split

    with mock.patch.dict(os.environ, s3_server):
        evaluation = evaluate_split(result.run_dir / "model.pt", s3["dataset"], "test")
    assert evaluation.metrics["test_samples"] == s3["test_rows"] > 0


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_stream_stopped_mid_epoch_on_2_ranks_resumes_on_1_and_3_to_the_uninterrupted_weights(
    nproc, two_ranks, one_rank, three_ranks
):
    """The step checkpoint's (epoch, step, global batch) is a position in the stream's order: 1 or 3 ranks go on
    from it, the rows of the rest of the epoch trained once, and end within 1e-5 of the uninterrupted run."""
    reference = succeeded(two_ranks["local_w2"])
    result = succeeded((one_rank if nproc == 1 else three_ranks)[f"resumed_on_{nproc}"])
    step = resumed_step(result)
    assert step == checkpointed_step(reference.dataset_dir()) > 0
    order = order_of(reference.dataset_dir(), 1)
    resumed = [row for rank in range(nproc) for row in result.indices(rank, 1)]
    assert sorted(resumed) == sorted(order[step * GLOBAL_BATCH :])  # nothing repeated, nothing skipped
    last, want = (torch.load(run.run_dir / LAST_CHECKPOINT, weights_only=True) for run in (result, reference))
    difference = assert_same_weights(last["model"], want["model"], EXACT)
    report(f"stream: stopped on 2 ranks at step {step}, resumed on {nproc}", difference)


def test_a_stream_checkpoint_is_not_resumed_on_the_node_cache(stopped, local):
    """The stream's order is another training than the node cache's: its checkpoint is refused, naming why."""
    dataset, data = local
    fingerprint = dataset.name
    node_cache = stream_config(2, [*data, "data.stream=false"])
    with pytest.raises(ResumeMismatchError, match=r"data\.stream True != False"):
        Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(node_cache, fingerprint)
    wider = stream_config(2, [*data, "data.shuffle_window=4"])
    with pytest.raises(ResumeMismatchError, match=r"data\.shuffle_window 3 != 4"):
        Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(wider, fingerprint)
    bigger = stream_config(2, [*data, "data.stream_cache_limit=999999999"])  # the cache's size keeps the weights
    saved = Checkpointer(stopped.run_dir, SingleProcess()).load_resumable(bigger, fingerprint)
    assert saved["step"] == checkpointed_step(dataset)
