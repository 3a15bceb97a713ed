"""Shards -> tensors, per-rank batches, evaluation slices and the fault hooks' parsing (no torchrun)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.config import load_config
from training.data.manifest import read_manifest
from training.distributed import shard_range
from training.faults import Fault, FaultInjector
from training.loading import RankSampler, ShardError, SplitTensors, TrainBatches, load_split

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from training.data.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("shards")
    data = load_config(
        None,
        [
            "data.source=synthetic://regression?rows=900&features=4&seed=1",
            f"data.root={root}",
            "data.rows_per_shard=200",
        ],
    ).data
    return prepare_dataset(data)


def test_a_split_loads_into_normalised_tensors_matching_the_shards(prepared):
    manifest = prepared.manifest
    split = load_split(prepared.dataset_dir, manifest, "train", read_rows=64)  # many record batches per shard
    assert len(manifest.splits["train"].shards) > 1
    table = pa.concat_tables(pq.read_table(path) for path in manifest.split_files(prepared.dataset_dir, "train"))
    raw = torch.stack([torch.from_numpy(table[name].to_numpy()) for name in manifest.features], dim=1)
    expected = (raw - torch.tensor(manifest.feature_mean)) / torch.tensor(manifest.feature_std)
    assert split.features.shape == (manifest.rows("train"), manifest.n_features) and split.features.is_contiguous()
    torch.testing.assert_close(split.features, expected)
    torch.testing.assert_close(split.labels, torch.from_numpy(table[manifest.label].to_numpy()))
    assert split.labels.dtype == torch.float32  # regression
    assert abs(float(split.features.mean())) < 0.05


def test_a_shard_that_disagrees_with_the_manifest_is_named(prepared, tmp_path):
    manifest = read_manifest(prepared.dataset_dir)
    first = manifest.split_files(prepared.dataset_dir, "val")[0]
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(prepared.dataset_dir), str(copy)], check=True)
    table = pq.read_table(copy / first.relative_to(prepared.dataset_dir))
    pq.write_table(table.slice(1), copy / first.relative_to(prepared.dataset_dir))
    with pytest.raises(ShardError, match=first.name):
        load_split(copy, manifest, "val")


def test_rank_batches_cover_every_row_once_and_weight_sampler_padding_zero():
    rows, world, batch = 11, 3, 2  # 11 rows over 3 ranks: DistributedSampler pads one rank's share
    split = SplitTensors(torch.arange(rows, dtype=torch.float32).unsqueeze(1), torch.arange(rows))
    seen, steps = [], set()
    for rank in range(world):
        batches = TrainBatches(split, rank, world, batch, seed=0, device=torch.device("cpu"), pin_memory=False)
        epoch = list(batches.epoch(0))
        steps.add(len(epoch))
        for item in epoch:
            assert item.samples == len(item.indices) == int(item.weights.sum())
            # Every fetched row is either a real one of this rank or weighted 0.
            assert set(item.labels[item.weights == 1].tolist()) == set(item.indices.tolist())
            seen += item.indices.tolist()
    assert sorted(seen) == list(range(rows)) and len(steps) == 1  # same step count on every rank


def test_the_tensor_epoch_order_is_exactly_distributed_samplers():
    for rows, world in ((11, 3), (1024, 2), (2, 5), (7, 1)):
        dataset = list(range(rows))
        for rank in range(world):
            sampler = RankSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=False)
            for epoch in (0, 3):
                sampler.set_epoch(epoch)
                assert sampler.rank_indices().tolist() == list(iter(sampler))  # the stock __iter__


def test_evaluation_slices_are_disjoint_unpadded_and_complete():
    for rows in (0, 1, 7, 201):
        for world in (1, 2, 3, 8):
            ranges = [shard_range(rows, rank, world) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_fault_specs_parse_and_reject_typos():
    assert Fault.parse("kill:rank=1:epoch=1:step=2") == Fault("kill", 1, 1, 2)
    assert Fault.parse("raise:rank=0:epoch=0") == Fault("raise", 0, 0, 0)
    for bad in ("explode:rank=1:epoch=0", "kill:rank=1", "hang:rank=1:epoch=0:stp=2"):
        with pytest.raises(ValueError, match="DDPFLOW_FAULT"):
            Fault.parse(bad)


def test_faults_fire_only_on_their_rank_epoch_and_step(tmp_path):
    FaultInjector(Fault("raise", 1, 0, 2), rank=0, run_dir=tmp_path).at_step(0, 2)  # another rank: inert
    injector = FaultInjector(Fault("raise", 1, 0, 2), rank=1, run_dir=tmp_path)
    injector.at_step(0, 1)
    injector.at_step(1, 2)
    with pytest.raises(RuntimeError, match="injected fault"):
        injector.at_step(0, 2)


def test_a_hang_fault_blocks_once_per_run_directory(tmp_path):
    script = f"from training.faults import Fault, FaultInjector; FaultInjector(Fault('hang', 0, 0, 0), 0, {str(tmp_path)!r}).at_step(0, 0); print('passed')"
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".fault-hang-done").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert child.poll() is None  # still hanging
    finally:
        child.kill()
        child.wait()
    again = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == "passed"  # the marker stops a restarted worker from hanging again
