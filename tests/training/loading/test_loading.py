"""Shards -> tensors, normalisation, per-rank batches and the exact update's divisor, evaluation slices and
the fault hooks' parsing (no torchrun)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import load_config
from training.core.manifest import read_manifest
from training.distributed.context import shard_range
from training.kinds.normalisation import Normaliser, scale_columns_
from training.loading.batches import (
    RankSampler,
    ShardError,
    SplitTensors,
    TrainBatches,
    global_rows_in_steps,
    load_split,
)
from training.loop.hooks import Fault, FaultInjector

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from training.prepare.dataset import prepare_dataset

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


def read_train_table(prepared) -> pa.Table:
    manifest = prepared.manifest
    return pa.concat_tables(pq.read_table(path) for path in manifest.split_files(prepared.dataset_dir, "train"))


def test_a_split_loads_into_normalised_tensors_matching_the_shards(prepared):
    manifest = prepared.manifest
    split = load_split(prepared.dataset_dir, manifest, "train", read_rows=64)  # many record batches per shard
    assert len(manifest.splits["train"].shards) > 1
    table = read_train_table(prepared)
    raw = np.stack([table[name].to_numpy() for name in manifest.features], axis=1).astype(np.float64)
    # Robust scaling (the default): the train median and interquartile range, then the smooth clip.
    low, median, high = np.quantile(raw, [0.25, 0.5, 0.75], axis=0)
    np.testing.assert_allclose(manifest.feature_center, median, rtol=1e-6)
    np.testing.assert_allclose(manifest.feature_scale, high - low, rtol=1e-6)
    z = (raw - median) / (high - low)
    expected = torch.from_numpy(z / np.sqrt(1 + (z / 3) ** 2)).float()
    assert split.features.shape == (manifest.rows("train"), manifest.n_features) and split.features.is_contiguous()
    torch.testing.assert_close(split.features, expected)
    # The regression target is standardised with the train split's own statistics (prepare's streaming pass).
    target = table[manifest.label].to_numpy().astype(np.float64)
    assert manifest.label_mean == pytest.approx(target.mean(), rel=1e-9)
    assert manifest.label_std == pytest.approx(target.std(), rel=1e-9)
    expected_labels = torch.from_numpy((target - manifest.label_mean) / manifest.label_std).float()
    torch.testing.assert_close(split.labels, expected_labels)
    assert split.labels.dtype == torch.float32  # regression
    assert abs(float(split.features.median())) < 0.05 and abs(float(split.labels.mean())) < 1e-4


def test_a_manifest_without_target_statistics_loads_the_raw_target(prepared):
    """Manifests written before target standardisation: mean 0, std 1."""
    old = dataclasses.replace(prepared.manifest, label_mean=None, label_std=None)
    split = load_split(prepared.dataset_dir, old, "train")
    table = read_train_table(prepared)
    torch.testing.assert_close(split.labels, torch.from_numpy(table[old.label].to_numpy()))


@pytest.mark.parametrize("clipped", ["some", "all", "none"])
def test_the_smooth_clip_gives_the_bits_of_clipping_the_marked_columns_alone(clipped):
    """``scale_columns_`` computes the clip over whole rows and keeps the marked columns' results: bit for bit what
    the clip of those columns alone gives (a node cache's values, a served row's, and the numeric embeddings'
    bin edges must not move), the unmarked columns scaled only, even where they hold inf or NaN."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 9, generator=generator) * 7
    x[:5, 4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -0.0])
    center, scale = torch.linspace(-1, 1, 9), torch.linspace(0.5, 2, 9)
    clip = {"some": torch.arange(9) % 2 == 0, "all": torch.ones(9, dtype=torch.bool),
            "none": torch.zeros(9, dtype=torch.bool)}[clipped]  # fmt: skip
    if clipped == "some":
        x[:5, 1] = x[:5, 4]  # an unclipped column's inf and NaN stay as scaled
    expected = (x - center) / scale
    part = expected[:, clip]
    expected[:, clip] = part / torch.sqrt(1.0 + torch.square(part / 3.0))
    result = scale_columns_(x.clone(), center, scale, clip)
    assert torch.equal(result.view(torch.int32), expected.view(torch.int32))  # every bit, -0.0 and NaN included


def test_the_smooth_clip_makes_one_temporary_of_the_blocks_size():
    """The clip of a served or scored batch allocates one block-sized temporary, not one per arithmetic step: each
    fresh temporary of megabytes is fresh pages under glibc's default malloc (the pyfunc's), every page a fault."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(4096, 9) * 7
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        scale_columns_(x, torch.zeros(9), torch.ones(9), torch.arange(9) % 2 == 0)
    allocating = [e.name for e in profiled.events() if e.name != "[memory]" and e.cpu_memory_usage >= x.nbytes]
    assert allocating == ["aten::div"], allocating


def test_one_normalisation_in_place_or_copied_and_its_inverse(prepared):
    norm = Normaliser.from_manifest(prepared.manifest)
    x = torch.randn(5, prepared.manifest.n_features) * 10 + 3
    copied = norm.features(x)
    assert not torch.equal(copied, x)
    assert torch.equal(norm.features_(x.clone()), copied)  # the same arithmetic both ways
    y = torch.tensor([-20.0, 0.0, 3.5, 150.0])
    standardised = norm.target_(y.clone())
    torch.testing.assert_close(standardised, (y - prepared.manifest.label_mean) / prepared.manifest.label_std)
    torch.testing.assert_close(norm.target_inverse(standardised), y)
    assert norm.target_loss_inverse(2.0) == pytest.approx(2.0 * prepared.manifest.label_std**2)
    meta = {"feature_mean": prepared.manifest.feature_mean, "feature_std": prepared.manifest.feature_std}
    identity = Normaliser.from_checkpoint(meta)  # a model.pt from before target standardisation
    assert identity.target_inverse(y) is y and identity.target_loss_inverse(2.0) == 2.0
    assert torch.equal(identity.target_(y.clone()), y)


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


def sampler_steps(rows: int, world: int, batch: int, seed: int = 3) -> list[list[list[int]]]:
    """``[step][rank]`` -> the rows stock ``DistributedSampler`` (padding included) gives that rank in that step."""
    per_rank = []
    for rank in range(world):
        sampler = torch.utils.data.DistributedSampler(
            list(range(rows)), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        order = list(iter(sampler))
        per_rank.append([order[start : start + batch] for start in range(0, len(order), batch)])
    return [list(step) for step in zip(*per_rank)]


def test_the_global_row_count_of_any_steps_matches_an_enumeration_of_distributed_sampler():
    """Padding repeats rows from the permutation's start, so the real rows that steps [start, stop) add are
    the distinct rows seen through ``stop`` minus those seen through ``start``: counted without the rule."""
    for rows, world, batch in ((211, 2, 8), (211, 3, 5), (211, 2, 4), (11, 3, 2), (7, 1, 3), (2, 5, 1), (64, 4, 4)):
        steps = sampler_steps(rows, world, batch)
        seen_through = [set()]
        for step in steps:
            seen_through.append(seen_through[-1] | {row for share in step for row in share})
        assert len(seen_through[-1]) == rows
        for start in range(len(steps)):
            for stop in range(start + 1, len(steps) + 1):
                expected = len(seen_through[stop]) - len(seen_through[start])
                assert global_rows_in_steps(rows, world, batch, start, stop) == expected, (rows, world, batch)


def test_every_rank_divides_by_the_real_rows_its_peers_fetch():
    """``TrainBatches.global_rows`` equals the real rows of that step summed over the ranks' own batches."""
    rows, world, batch = 211, 3, 5
    split = SplitTensors(torch.zeros(rows, 1), torch.zeros(rows, dtype=torch.int64))
    per_rank = [
        list(TrainBatches(split, r, world, batch, seed=0, device=torch.device("cpu"), pin_memory=False).epoch(1))
        for r in range(world)
    ]
    batches = TrainBatches(split, 0, world, batch, seed=0, device=torch.device("cpu"), pin_memory=False)
    for step in range(len(batches)):
        assert batches.global_rows(step, step + 1) == sum(per_rank[r][step].samples for r in range(world))
    assert [per_rank[r][-1].samples for r in range(world)] == [1, 0, 0]  # 211 = 14 * 15 + 1
    assert batches.global_rows(0, len(batches)) == rows


def test_the_tensor_epoch_order_is_exactly_distributed_samplers():
    for rows, world in ((11, 3), (1024, 2), (2, 5), (7, 1)):
        dataset = list(range(rows))
        for rank in range(world):
            sampler = RankSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=False)
            for epoch in (0, 3):
                sampler.set_epoch(epoch)
                assert sampler.rank_indices().tolist() == list(iter(sampler))  # the stock __iter__
    # Large: the int32 permutation rank_indices draws is the int64 one DistributedSampler draws.
    rows = 3_000_001
    sampler = RankSampler(range(rows), num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=False)
    sampler.set_epoch(2)
    generator = torch.Generator()
    generator.manual_seed(7 + 2)
    stock = torch.randperm(rows, generator=generator)
    assert torch.equal(sampler.rank_indices(), torch.cat([stock, stock[:1]])[1::2])
    assert sampler.rank_indices().dtype == torch.int64


def test_evaluation_slices_are_disjoint_unpadded_and_complete():
    for rows in (0, 1, 7, 201):
        for world in (1, 2, 3, 8):
            ranges = [shard_range(rows, rank, world) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_fault_specs_parse_and_reject_typos():
    assert Fault.parse("kill:rank=1:epoch=1:step=2") == Fault("kill", 1, 1, 2)
    assert Fault.parse("raise:rank=0:epoch=0") == Fault("raise", 0, 0, 0)
    assert Fault.parse("slow_checkpoint:rank=0:epoch=1:seconds=20") == Fault("slow_checkpoint", 0, 1, seconds=20)
    for bad in ("explode:rank=1:epoch=0", "kill:rank=1", "hang:rank=1:epoch=0:stp=2", "slow_checkpoint:rank=0"):
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
    script = (
        "from training.loop.hooks import Fault, FaultInjector; "
        f"FaultInjector(Fault('hang', 0, 0, 0), 0, {str(tmp_path)!r}).at_step(0, 0); print('passed')"
    )
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


def test_the_global_weight_of_any_steps_sums_the_row_weights_every_rank_fetches():
    """``global_weight``: computed locally from the shared permutation, it equals the sum over the ranks of
    their batches' weights (data.weight times 0 for padding); without a weight column, the real rows."""
    rows, world, batch = 23, 3, 4  # 23 rows over 3 ranks: padded
    weights = torch.linspace(0.5, 3.0, rows)
    split = SplitTensors(torch.zeros(rows, 1), torch.zeros(rows, dtype=torch.int64), weights=weights)
    make = lambda r, s=split: TrainBatches(s, r, world, batch, seed=5, device=torch.device("cpu"), pin_memory=False)  # noqa: E731
    per_rank = [list(make(r).epoch(2)) for r in range(world)]
    local = make(1)
    list(local.epoch(2))  # the epoch's permutation, as a training rank has it
    for step in range(len(local)):
        fetched = sum(float(per_rank[r][step].weights.sum()) for r in range(world))
        assert local.global_weight(step, step + 1) == pytest.approx(fetched, rel=1e-6)
        real_rows = per_rank[0][step].indices, per_rank[1][step].indices, per_rank[2][step].indices
        assert fetched == pytest.approx(float(sum(weights[r].sum() for r in real_rows)), rel=1e-6)
    assert local.global_weight(0, len(local)) == pytest.approx(float(weights.sum()), rel=1e-6)
    plain = TrainBatches(
        SplitTensors(torch.zeros(rows, 1), torch.zeros(rows, dtype=torch.int64)),
        0,
        world,
        batch,
        5,
        torch.device("cpu"),
        False,
    )
    list(plain.epoch(2))
    assert plain.global_weight(0, 2) == plain.global_rows(0, 2)


def mixed_dataset(tmp_path) -> tuple[Path, object]:
    rng = np.random.default_rng(3)
    rows = 900
    table = pa.table(
        {
            "x": rng.normal(size=rows),
            "city": pa.array(rng.choice(["a", "b", "c", None], size=rows).tolist(), type=pa.string()),
            "shop": [f"s{i}" for i in range(rows)],
            "vec": [rng.normal(size=2).tolist() for _ in range(rows)],
            "w": rng.uniform(0.1, 1.0, size=rows),
            "y": rng.integers(0, 2, size=rows),
        }
    )
    pq.write_table(table, tmp_path / "mixed.parquet")
    from training.prepare.dataset import prepare_dataset

    inputs = {"x": "numeric", "city": "categorical", "shop": {"kind": "hashed", "buckets": 13}, "vec": "vector"}
    config = load_config(
        None,
        [
            f"data.source={tmp_path / 'mixed.parquet'}",
            "data.label=y",
            f"data.root={tmp_path / 'shards'}",
            "data.rows_per_shard=200",
            "data.weight=w",
            f"data.inputs={inputs}",
        ],
    ).data
    prepared = prepare_dataset(config)
    return Path(prepared.dataset_dir), prepared.manifest


def test_each_input_is_a_section_encoded_by_its_codec_and_the_node_cache_maps_the_same(tmp_path):
    from training.loading.batches import manifest_codecs
    from training.loading.node_cache import open_split

    dataset, manifest = mixed_dataset(tmp_path)
    split = load_split(dataset, manifest, "train", read_rows=64)
    table = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "train")])
    codecs = manifest_codecs(dataset, manifest)
    assert split.numeric == ("x",) and list(split.inputs) == ["city", "shop", "vec"]
    assert split.inputs["city"].dtype == torch.int64 and split.inputs["vec"].shape == (len(table), 2)
    for name in ("city", "shop", "vec"):
        assert np.array_equal(split.inputs[name].numpy(), codecs[name].encode(table[name]))
    assert int(split.inputs["city"].min()) == 0  # the nulls: index 0
    assert torch.equal(split.weights, torch.from_numpy(table["w"].to_numpy()))
    batch = split.rows(3, 7)
    assert list(batch) == ["x", "city", "shop", "vec"] and batch["x"].shape == (4,)
    mapped = open_split(dataset, manifest, "train")  # built streaming (in this process: a small split), then mapped
    assert mapped.how == "built"
    for name, tensor in split.sections().items():
        assert torch.equal(mapped.tensors.sections()[name], tensor), name


def test_a_ragged_section_gathers_rows_of_any_length_with_one_index():
    from training.kinds.ragged import RaggedArray

    ragged = RaggedArray.from_rows([[1, 2, 3], [], [4], [5, 6]])
    assert ragged.lengths().tolist() == [3, 0, 1, 2] and ragged.row(3).tolist() == [5, 6]
    values, offsets = ragged.gather(torch.tensor([3, 1, 0, 3]))
    assert values.tolist() == [5, 6, 1, 2, 3, 5, 6] and offsets.tolist() == [0, 2, 2, 5, 7]
    with pytest.raises(ValueError, match="offsets must run from 0"):
        RaggedArray(torch.tensor([1, 2]), torch.tensor([0, 1]))


# --------------------------------------------------------------------------- the ragged-input seam


class Utf8Codec:
    """A stand-in ragged kind (the seam's contract, not a product kind): a string's UTF-8 bytes, collated as a
    zero-padded uint8 batch plus each row's length and the epoch the loader passed."""

    kind, dtype, ragged_dtype = "utf8_test", "uint8", "uint8"

    def __init__(self, name, options=None):
        self.name, self.options = name, dict(options or {})

    def load(self, state):
        pass

    def encode_ragged(self, array):
        values = [(value or "").encode() for value in array.to_pylist()]  # null: no bytes
        return np.frombuffer(b"".join(values), dtype=np.uint8), np.array([len(v) for v in values], dtype=np.int64)

    def collate(self, values, offsets, context):
        lengths = offsets[1:] - offsets[:-1]
        padded = torch.zeros(len(lengths), int(lengths.max()) if len(lengths) else 0, dtype=torch.uint8)
        for i in range(len(lengths)):
            padded[i, : lengths[i]] = values[offsets[i] : offsets[i + 1]]
        return {
            self.name: padded,
            f"{self.name}_len": lengths,
            f"{self.name}_epoch": torch.full_like(lengths, context.epoch),
        }


@pytest.fixture
def ragged_dataset(tmp_path, monkeypatch):
    """The mixed dataset with its ``city`` column declared a ragged input of the stand-in kind."""
    import json

    from training.core.manifest import write_manifest
    from training.kinds import inputs
    from training.kinds import registry as codecs

    monkeypatch.setattr(inputs, "KINDS", (*inputs.KINDS, Utf8Codec.kind))
    monkeypatch.setitem(codecs.CODECS, Utf8Codec.kind, Utf8Codec)
    dataset, manifest = mixed_dataset(tmp_path)
    states = json.loads((dataset / codecs.ENCODERS_FILE).read_text())
    states["city"] = {"kind": Utf8Codec.kind, "options": {}, "state": {}}
    text = codecs.encoders_text(states)
    (dataset / codecs.ENCODERS_FILE).write_text(text)
    entries = [
        {**entry, "kind": Utf8Codec.kind, "dtype": "uint8", "cardinality": None, "ragged_dtype": "uint8"}
        if entry["name"] == "city"
        else entry
        for entry in manifest.inputs
    ]
    manifest = dataclasses.replace(
        manifest, inputs=entries, encoders={**manifest.encoders, "sha256": codecs.encoders_sha256(text)}
    )
    write_manifest(dataset, manifest)
    table = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "train")])
    return dataset, manifest, table


def test_a_ragged_input_loads_as_values_and_offsets_and_the_node_cache_maps_the_same(ragged_dataset):
    from training.kinds.ragged import RaggedArray
    from training.loading import node_cache

    dataset, manifest, table = ragged_dataset
    split = load_split(dataset, manifest, "train", read_rows=64)  # many record batches: offsets carried across
    city = split.inputs["city"]
    assert isinstance(city, RaggedArray) and city.values.dtype == torch.uint8 and len(city) == len(table)
    expected = [(value or "").encode() for value in table["city"].to_pylist()]
    assert [bytes(city.row(i).numpy()) for i in range(len(city))] == expected
    assert torch.equal(split.inputs["vec"], torch.from_numpy(np.stack(table["vec"].to_numpy(zero_copy_only=False))))
    # The node cache: the values after the fixed sections, sized by the build, then mapped and validated.
    path = node_cache.cache_path(dataset, manifest, "train", None)
    expected_header = node_cache._expected_header(manifest, "train")
    assert expected_header["file_bytes"] is None  # sized only by the encoding
    node_cache._build(dataset, manifest, "train", path, expected_header, None)  # in-process: the stand-in kind
    (mapped, _inode), problem = node_cache._try_map(path, expected_header, manifest)
    assert problem == "" and set(mapped.sections()) == set(split.sections())
    for name, tensor in split.sections().items():
        assert torch.equal(mapped.sections()[name], tensor), name
    # A file cut short in its ragged values is refused, not mapped.
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 64)
    assert node_cache._try_map(path, expected_header, manifest)[0] is None


# With workers, run after an in-process Prefect flow in the same pytest process (one process, --reverse-modules),
# the forked workers inherit Prefect's exit hooks and exit with code 1 at shutdown: pytest then reports an
# "Exception ignored in _MultiProcessingDataLoaderIter.__del__" warning. Ranks never import Prefect (docs/training.md).
@pytest.mark.parametrize("workers", [0, 2])
def test_ragged_rows_are_collated_per_batch_with_their_epoch_in_the_rank_or_its_workers(ragged_dataset, workers):
    dataset, manifest, table = ragged_dataset
    split = load_split(dataset, manifest, "train")
    batches = TrainBatches(split, 0, 1, 16, seed=0, device=torch.device("cpu"), pin_memory=False, num_workers=workers)
    strings = [value or "" for value in table["city"].to_pylist()]
    seen = 0
    for batch in batches.epoch(3):
        got = batch.inputs
        assert list(got)[:1] == ["x"] and {"city", "city_len", "city_epoch", "vec", "shop"} <= set(got)
        assert got["city_epoch"].eq(3).all()  # the epoch reaches the codec, in the workers too
        for row, padded, length in zip(batch.indices.tolist(), got["city"], got["city_len"]):
            assert bytes(padded[:length].numpy()) == strings[row].encode()
            seen += 1
    assert seen == len(table)
    # Validation and evaluation collate the same rows, with the evaluation context (epoch 0).
    rows = split.rows(5, 9)
    assert [bytes(p[:n].numpy()) for p, n in zip(rows["city"], rows["city_len"])] == [s.encode() for s in strings[5:9]]
