"""The stream (no torchrun): its global order, each rank's slice of it at any world size, the exact update's divisor,
resuming at a step, validation shard by shard, the bounded cache shared by processes, ``data.stream: auto``, and
what the new settings do to a run's identity and a dataset's fingerprint.

Data shaped like a user's: an int64 input with nulls (imputed, a missing indicator), a bool, a skewed amount, a
string categorical and a row weight, prepared by the real prepare stage into many small shards.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.checkpoint.identity import identity_differences, training_identity
from training.core.config import ConfigError, load_config
from training.core.manifest import ShardInfo
from training.loading.batches import TrainBatches, global_rows_in_steps, load_split
from training.loading.shard_cache import CACHE_LOCK, LOCKS, ShardCache, StreamCacheError
from training.loading.stream import StreamBatches, StreamedSplit, StreamSource, stream_wanted
from training.loading.stream_order import StreamOrder

ROWS, ROWS_PER_SHARD, WINDOW = 700, 23, 3
CPU = torch.device("cpu")


def user_table(rows: int, seed: int = 4) -> pa.Table:
    rng = np.random.default_rng(seed)
    visits = rng.integers(0, 40, size=rows)
    x = rng.normal(size=rows)
    return pa.table(
        {
            "visits": pa.array(visits, mask=rng.random(rows) < 0.15),  # int64 with nulls
            "member": rng.random(rows) < 0.3,  # bool
            "amount": np.round(rng.lognormal(3.0, 1.5, size=rows)).astype(np.int64),  # skewed
            "shop": rng.choice(["north", "south", "east", "west", "online"], size=rows),  # strings
            "x": x,
            "w": rng.uniform(0.5, 3.0, size=rows),
            "label": ((x + (visits > 20)) > 0.5).astype(np.int64),
        }
    )


def data_overrides(root: Path, source: Path, **extra) -> list[str]:
    inputs = {"visits": "numeric", "member": "numeric", "amount": "numeric", "shop": "categorical", "x": "numeric"}
    settings = {
        "source": str(source),
        "root": str(root / "shards"),
        "cache_dir": str(root / "cache"),
        "inputs": inputs,
        "weight": "w",
        "rows_per_shard": ROWS_PER_SHARD,
        "stream": True,
        "shuffle_window": WINDOW,
        "stream_cache_limit": 10**6,
        **extra,
    }
    return [f"data.{key}={json.dumps(value)}" for key, value in settings.items()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from training.prepare.dataset import prepare_dataset

    root = tmp_path_factory.mktemp("stream")
    pq.write_table(user_table(ROWS), root / "users.parquet")
    config = load_config(None, data_overrides(root, root / "users.parquet"))
    return config, prepare_dataset(config.data)


def source_of(prepared, split: str = "train", **data) -> StreamSource:
    config, dataset = prepared
    return StreamSource.open(dataset.dataset_dir, dataset.manifest, split, config.data.model_copy(update=data))


def shard_rows(prepared) -> list[int]:
    return [shard.rows for shard in prepared[1].manifest.splits["train"].shards]


def rank_pass(source: StreamSource, rank: int, world: int, batch: int, epoch: int, start: int = 0, weights=None):
    batches = StreamBatches(source, rank, world, batch, seed=7, window=WINDOW, device=CPU, row_weights_of=weights)
    return batches, list(batches.epoch(epoch, start))


# --- the order ------------------------------------------------------------------------------------------------


def test_the_order_is_a_permutation_from_seed_and_epoch_shuffled_within_windows_of_shards(prepared):
    rows = shard_rows(prepared)
    assert len(rows) > 3 * WINDOW  # several windows
    order = StreamOrder(rows, WINDOW, seed=7, epoch=1)
    everything = order.order()
    assert sorted(everything.tolist()) == list(range(sum(rows)))
    assert np.array_equal(everything, StreamOrder(rows, WINDOW, seed=7, epoch=1).order())  # deterministic
    assert not np.array_equal(everything, StreamOrder(rows, WINDOW, seed=7, epoch=2).order())  # a new epoch
    assert not np.array_equal(everything, StreamOrder(rows, WINDOW, seed=8, epoch=1).order())
    first = np.concatenate([[0], np.cumsum(rows)])
    for j, shards in enumerate(order.windows):
        # Window j's positions hold exactly the rows of its shards, shuffled (not in shard order).
        held = everything[order.starts[j] : order.starts[j + 1]]
        mine = np.concatenate([np.arange(first[s], first[s + 1]) for s in shards])
        assert sorted(held.tolist()) == sorted(mine.tolist())
        assert len(held) < 3 or not np.array_equal(held, mine)
    assert sorted(s for shards in order.windows for s in shards) == list(range(len(rows)))
    assert [s for shards in order.windows for s in shards] != list(range(len(rows)))  # the shards are shuffled


@pytest.mark.parametrize(("world", "batch"), [(1, 30), (2, 15), (3, 10)])
def test_each_rank_trains_its_slice_of_the_one_order_and_the_ranks_cover_the_split_once(prepared, world, batch):
    """Rank r trains positions r, r + W, ... of the epoch's order (the node cache's sampler rule), so W ranks x b
    hold in each step the rows of one rank x W*b; the rows and their encoded inputs are what the node cache
    loads for them."""
    source = source_of(prepared)
    n = source.rows
    whole = load_split(prepared[1].dataset_dir, prepared[1].manifest, "train")
    order = StreamOrder(shard_rows(prepared), WINDOW, seed=7, epoch=2).order()
    seen, steps = [], set()
    for rank in range(world):
        batches, epoch = rank_pass(source, rank, world, batch, epoch=2)
        steps.add(len(epoch))
        assert len(batches) == len(TrainBatches(whole, rank, world, batch, 7, CPU, False))
        rows = torch.cat([item.indices for item in epoch])
        assert rows.tolist() == order[rank::world].tolist()
        for item in epoch:
            real = item.weights > 0
            assert item.samples == len(item.indices) == int(real.sum())
            assert torch.equal(item.features[real], whole.features[item.indices])
            assert torch.equal(item.inputs["shop"][real], whole.inputs["shop"][item.indices])
            assert torch.equal(item.labels[real], whole.labels[item.indices])
            torch.testing.assert_close(item.weights[real], whole.weights[item.indices])  # data.weight
        seen += rows.tolist()
    assert sorted(seen) == list(range(n)) and len(steps) == 1


def test_the_divisor_is_the_weight_of_the_steps_global_rows_at_any_world_size(prepared):
    """``global_weight`` (the exact update's Σw) from the windows equals the rows' weights summed over the order's
    positions of those steps, computed alike by every rank of every world size."""
    source = source_of(prepared)
    whole = load_split(prepared[1].dataset_dir, prepared[1].manifest, "train")
    order = torch.from_numpy(StreamOrder(shard_rows(prepared), WINDOW, seed=7, epoch=0).order())
    for world, batch in [(1, 30), (2, 15), (3, 10)]:
        for rank in range(world):
            batches = StreamBatches(source, rank, world, batch, seed=7, window=WINDOW, device=CPU)
            for step, _ in enumerate(batches.epoch(0)):
                first = step * batch * world
                last = min(first + batch * world, source.rows)
                want = float(whole.weights[order[first:last]].double().sum())
                assert batches.global_weight(step, step + 1) == pytest.approx(want, rel=1e-12)
                assert batches.global_rows(step, step + 1) == global_rows_in_steps(
                    source.rows, world, batch, step, step + 1
                )
            # The epoch's Σw (train_loss's divisor), once the pass is over: every row's weight.
            total = float(whole.weights.double().sum())
            assert batches.global_weight(0, len(batches)) == pytest.approx(total, rel=1e-12)
    # A pass resumed mid-epoch reads the shards it skipped for their weights.
    resumed = StreamBatches(source, 0, 2, 15, seed=7, window=WINDOW, device=CPU)
    list(resumed.epoch(0, start=len(resumed) - 2))
    assert resumed.global_weight(0, len(resumed)) == pytest.approx(total, rel=1e-12)


def test_a_stream_that_trains_a_row_twice_and_skips_another_fails_the_certificate(prepared, tmp_path):
    """The fault hook ``skip_row`` reaches the stream's positions; the ranks' tallies then miss the split's."""
    from training.loop.counting import Certificate, CoverageTally
    from training.loop.hooks import Fault, FaultInjector

    source = source_of(prepared)
    faults = FaultInjector(Fault("skip_row", rank=1, epoch=0), rank=1, run_dir=tmp_path)
    lanes = []
    for rank, reorder in [(0, None), (1, faults.epoch_rows)]:
        tally = CoverageTally()
        batches = StreamBatches(source, rank, 2, 15, seed=7, window=WINDOW, device=CPU, reorder=reorder)
        for item in batches.epoch(0):
            tally.add(item.indices)
        lanes.append(tally.totals())
    got = Certificate.from_lanes(*np.sum(lanes, axis=0).tolist())
    assert got.rows == source.rows and got != Certificate.expected(source.rows)


def test_a_pass_resumed_at_a_step_trains_the_rest_of_the_uninterrupted_pass(prepared):
    source = source_of(prepared)
    _, whole = rank_pass(source, 1, 2, 15, epoch=3)
    _, resumed = rank_pass(source, 1, 2, 15, epoch=3, start=9)
    assert [item.indices.tolist() for item in resumed] == [item.indices.tolist() for item in whole[9:]]
    # On another world size with the same global batch (30), global step 9 on holds the same rows.
    _, single = rank_pass(source, 0, 1, 30, epoch=3, start=9)
    two = [item.indices for rank in (0, 1) for item in rank_pass(source, rank, 2, 15, epoch=3, start=9)[1]]
    assert sorted(torch.cat([item.indices for item in single]).tolist()) == sorted(torch.cat(two).tolist())


def test_validation_reads_a_ranks_rows_shard_by_shard(prepared):
    source = source_of(prepared, "val")
    whole = load_split(prepared[1].dataset_dir, prepared[1].manifest, "val")
    streamed = StreamedSplit(source)
    start, stop = 5, len(streamed) - 4
    pieces = list(streamed.pieces(start, stop))
    assert len(pieces) > 1
    features = torch.cat([split.features[first:end] for split, first, end in pieces])
    assert torch.equal(features, whole.features[start:stop])
    (empty, first, end), *_ = list(streamed.pieces(3, 3))
    assert first == end == 0 and len(empty) == 0


# --- the cache ------------------------------------------------------------------------------------------------


def cached_bytes(directory: Path) -> int:
    """What a look at the directory finds: every file but the lock files (the poller's measure)."""
    total = 0
    for folder, names, files in os.walk(directory):
        names[:] = [name for name in names if name != LOCKS]
        total += sum((Path(folder) / name).stat().st_size for name in files if name != CACHE_LOCK)
    return total


class Poller:
    """Looks at a directory every millisecond in a thread and keeps the most it ever held.

    Each look holds the cache's lock (shared), as every eviction and reservation does (exclusive): a walk of the
    directory's split folders takes time, and a walk without the lock can list a shard evicted from one folder
    and the download that took its room in another, the same bytes twice."""

    def __init__(self, directory: Path):
        self.directory, self.most, self._stop = directory, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.most = max(self.most, self._look())
            except FileNotFoundError:
                pass  # no cache yet, or a download renamed mid-walk
            time.sleep(0.001)

    def _look(self) -> int:
        with open(self.directory / CACHE_LOCK, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                return cached_bytes(self.directory)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _read_windows(directory: str, limit: int, dataset: str, shards: list[tuple[str, int, int]], seed: int) -> int:
    """A process reading every window of shards (in its own order) through the shared cache; its peak."""
    cache = ShardCache(directory, limit, dataset)
    infos = [ShardInfo(*shard) for shard in shards]
    order = np.random.default_rng(seed).permutation(len(infos))
    for first in range(0, len(order), 2):
        with cache.pinned([infos[i] for i in order[first : first + 2]]) as held:
            for i in order[first : first + 2]:
                assert pq.read_metadata(held / infos[i].file).num_rows == infos[i].rows
    return cache.peak


def test_processes_sharing_the_cache_never_hold_more_than_its_limit(prepared, tmp_path):
    dataset = prepared[1]
    shards = dataset.manifest.splits["train"].shards
    largest = max(shard.bytes for shard in shards)
    limit = 4 * largest + largest // 2  # two windows of 2 shards, and a little: most shards are evicted
    directory = tmp_path / "cache"
    spec = [(shard.file, shard.rows, shard.bytes) for shard in shards]
    with Poller(directory) as poller, multiprocessing.get_context("fork").Pool(3) as pool:
        peaks = pool.starmap(
            _read_windows, [(str(directory), limit, str(dataset.dataset_dir), spec, s) for s in range(3)]
        )
    assert 0 < poller.most <= limit and max(peaks) <= limit
    assert cached_bytes(directory) <= limit < sum(shard.bytes for shard in shards)  # evictions happened


def test_the_least_recently_used_unpinned_file_goes_first(prepared, tmp_path):
    dataset = prepared[1]
    a, b, c = dataset.manifest.splits["train"].shards[:3]
    cache = ShardCache(tmp_path / "lru", a.bytes + b.bytes + c.bytes - 1, str(dataset.dataset_dir))
    with cache.pinned([a]):
        pass
    time.sleep(0.01)
    with cache.pinned([b]):
        pass
    time.sleep(0.01)
    with cache.pinned([a]):  # a used again: b is now the least recently used
        pass
    time.sleep(0.01)
    with cache.pinned([c]):
        pass
    present = {path.name for path in (tmp_path / "lru" / "train").iterdir()}
    assert present == {Path(a.file).name, Path(c.file).name}
    with cache.pinned([a]), pytest.raises(StreamCacheError, match="more than data.stream_cache_limit"):
        ShardCache(tmp_path / "tiny", a.bytes - 1, str(dataset.dataset_dir))._reserve(a, tmp_path / "x")


def test_a_shard_that_differs_from_the_manifest_or_is_missing_is_named(prepared, tmp_path):
    dataset = prepared[1]
    shard = dataset.manifest.splits["train"].shards[0]
    cache = ShardCache(tmp_path / "c", 10**6, str(dataset.dataset_dir))
    altered = ShardInfo(shard.file, shard.rows, shard.bytes + 1)
    with pytest.raises(StreamCacheError, match=rf"{shard.file}: holds \d+ bytes, the manifest says {altered.bytes}"):
        _read(cache, altered)
    shrunk = ShardInfo(shard.file, shard.rows, shard.bytes - 1)  # a source larger than its reserved room
    with pytest.raises(StreamCacheError, match=rf"holds more than {shrunk.bytes} bytes, the manifest says"):
        _read(cache, shrunk)
    with pytest.raises(StreamCacheError, match="part-99999.parquet: a shard the manifest lists does not exist"):
        _read(cache, ShardInfo("train/part-99999.parquet", 1, 10))
    assert cached_bytes(tmp_path / "c") == 0  # nothing half-written stays


def _read(cache: ShardCache, shard: ShardInfo) -> None:
    with cache.pinned([shard]):
        pass


def test_a_limit_below_two_windows_is_refused_before_anything_runs(prepared):
    from training.core.topology import RankLayout
    from training.preflight import check_data

    config, dataset = prepared
    largest = max(shard.bytes for split in ("train", "val") for shard in dataset.manifest.splits[split].shards)
    small = config.model_copy(update={"data": config.data.model_copy(update={"stream_cache_limit": largest})})
    small = small.model_copy(update={"train": small.train.model_copy(update={"batch_size": 8})})
    with pytest.raises(
        ConfigError, match=rf"data.stream_cache_limit {largest} bytes is below two windows .* {2 * WINDOW * largest}"
    ):
        check_data(small, dataset.manifest, RankLayout(1, 1, "gloo", 0))


# --- auto, the identity and the fingerprint -------------------------------------------------------------------


def test_auto_streams_when_the_node_cache_would_take_more_than_half_the_free_disk(prepared, monkeypatch):
    import shutil as shutil_module

    from training.resolve import resolve_for_data

    config, dataset = prepared
    auto = config.model_copy(update={"data": config.data.model_copy(update={"stream": "auto"})})
    usage = shutil_module.disk_usage(dataset.dataset_dir)
    assert stream_wanted(auto.data, dataset.dataset_dir, dataset.manifest)[0] is False  # a few kB: the node cache
    full = usage._replace(free=1000)
    monkeypatch.setattr("training.loading.stream.shutil.disk_usage", lambda path: full)
    on, why = stream_wanted(auto.data, dataset.dataset_dir, dataset.manifest)
    assert on and "more than half of the 1.0 kB free" in why
    at_root = auto.data.model_copy(update={"root": str(Path(dataset.dataset_dir).parent)})
    resolved = resolve_for_data(auto.model_copy(update={"data": at_root}), dataset.manifest, 2)
    assert resolved.data.stream is True  # recorded: the run's identity holds the decision


def test_the_stream_settings_leave_the_fingerprint_and_a_node_cache_runs_identity_as_they_were(prepared):
    from training.prepare.fingerprint import dataset_fingerprint

    plain = load_config(None, [])
    identity = training_identity(plain, "fp")
    assert "data" not in identity  # an identity recorded before the stream existed is still this one
    assert training_identity(plain.model_dump(mode="json"), "fp") == identity
    tuned = load_config(None, ["data.stream_cache_limit=1000000", "data.shuffle_window=2"])
    assert training_identity(tuned, "fp") == identity  # only with data.stream on does the window count
    streamed = training_identity(load_config(None, ["data.stream=true"]), "fp")
    assert streamed["data"] == {"stream": True, "shuffle_window": 8}
    assert identity_differences(identity, streamed) == ["data.shuffle_window None != 8", "data.stream False != True"]
    wider = training_identity(load_config(None, ["data.stream=true", "data.shuffle_window=16"]), "fp")
    assert identity_differences(streamed, wider) == ["data.shuffle_window 8 != 16"]
    cache_only = load_config(None, ["data.stream=true", "data.stream_cache_limit=123456789"])
    assert training_identity(cache_only, "fp") == streamed  # the cache's size keeps the weights
    source = {"files": [["a", 1, "v"]]}
    streaming = load_config(None, ["data.stream=true", "data.shuffle_window=3", "data.stream_cache_limit=99"])
    assert dataset_fingerprint(source, plain.data) == dataset_fingerprint(source, streaming.data)
