"""The node cache (training/loading/node_cache.py) and train.data_on_device (training/loading/placement.py).

Real torchrun launches (gloo, 2 and 3 CPU ranks) on a dataset made by the real
prepare stage: one rank builds the cache while the others wait, every rank maps
the same file, the data equals ``load_split``'s, a truncated or corrupt file is
rebuilt, two runs starting together build it once, and a read-only cache dir
stops the run with the setting named. Which rank built, waited or found the
file ready is read from each rank's data line (``training.core.fileio.DATA``, then
``rank R: ...``). A split placed on a GPU yields the host's batches (GPU only:
on the CPU the device is the host, and placement keeps the shared mapping).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from training.core.config import load_config
from training.core.fileio import DATA
from training.core.job import TrainJob
from training.core.manifest import read_manifest
from training.loading import node_cache
from training.loading.batches import RankSampler, SplitTensors, TrainBatches, load_split
from training.loading.node_cache import FORMAT_VERSION, HEADER_BYTES, cache_path, open_split
from training.loading.placement import decide, place_splits

REPO = Path(__file__).resolve().parents[3]
SEED = 7
DATA_LINE = re.compile(re.escape(DATA) + r" rank (\d+): (\w+): (\d+) rows mapped from (\S+) \(inode (\d+)\); (\w+)")


# --- data, launches and what the ranks said ---------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """The real prepare stage's output: several shards per split, a train split no world size here divides."""
    from training.prepare.dataset import prepare_dataset

    data = load_config(
        None,
        [
            "data.source=synthetic://classification?rows=1397&features=6&classes=3&seed=4",
            f"data.root={tmp_path_factory.mktemp('shards')}",
            "data.rows_per_shard=300",
        ],
    ).data
    prepared = prepare_dataset(data)
    assert prepared.manifest.rows("train") % 2 and prepared.manifest.rows("train") % 3, "pick rows that pad"
    return Path(prepared.dataset_dir)


@dataclass(frozen=True)
class Mapped:
    rank: int
    split: str
    rows: int
    path: str
    inode: int
    how: str


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str

    def mapped(self, split: str) -> list[Mapped]:
        found = [Mapped(int(r), s, int(n), p, int(i), how) for r, s, n, p, i, how in DATA_LINE.findall(self.output)]
        return sorted((m for m in found if m.split == split), key=lambda m: m.rank)

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "model.pt", weights_only=True)["model"]

    def indices(self, rank: int, epoch: int) -> list[int]:
        """The rows a rank trained in an epoch, in order (DDPFLOW_RECORD_INDICES: the first pass's JSON list)."""
        (recorded,) = (self.run_dir / "indices").glob(f"rank{rank}-epoch{epoch}.json*")
        return json.loads(recorded.read_text().splitlines()[0])


def start(run_dir: Path, dataset_dir: Path, nproc: int, cache_dir: Path, preexec_fn=None, **train) -> subprocess.Popen:
    settings = {"epochs": 1, "batch_size": 32, "num_threads": 1, "seed": SEED, "model_kwargs": {"hidden": [16]}}
    settings |= {"lr": 0.01, "collective_timeout_s": 60, **train}
    overrides = [f"train.{key}={json.dumps(value)}" for key, value in settings.items()]
    config = load_config(None, [*overrides, f"data.cache_dir={cache_dir}"])
    job = TrainJob(config=config, dataset_dir=str(dataset_dir), run_dir=str(run_dir)).write(
        run_dir / "train_config.json"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env["DDPFLOW_RECORD_INDICES"] = "1"
    for name in ("DDPFLOW_FAULT",):
        env.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    argv += ["-m", "training.train", "--config", str(job)]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn
    )


def finish(process: subprocess.Popen, run_dir: Path) -> Launch:
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    return Launch(run_dir, process.returncode, output)


def launch(run_dir: Path, dataset_dir: Path, nproc: int, cache_dir: Path, **train) -> Launch:
    result = finish(start(run_dir, dataset_dir, nproc, cache_dir, **train), run_dir)
    assert result.returncode == 0, result.output[-4000:]
    return result


def assert_one_file_for_all(mapped: list[Mapped], ranks: int) -> None:
    assert [m.rank for m in mapped] == list(range(ranks)), mapped
    assert len({(m.path, m.inode) for m in mapped}) == 1, f"ranks mapped different files: {mapped}"


def without_write_override():
    """For a child run as root: drop CAP_DAC_OVERRIDE/READ_SEARCH, so a 0555 directory is read-only to it too."""
    if os.geteuid() != 0:
        return None

    def drop() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone after exec
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


# --- torchrun -----------------------------------------------------------------------------------------


@pytest.mark.torchrun
def test_three_ranks_build_the_cache_once_and_train_from_one_mapped_file(dataset, tmp_path):
    cache = tmp_path / "cache"
    result = launch(tmp_path / "run", dataset, 3, cache)
    manifest = read_manifest(dataset)
    for split in ("train", "val"):
        mapped = result.mapped(split)
        assert_one_file_for_all(mapped, 3)
        assert [m.how for m in mapped].count("built") == 1, result.output[-3000:]
        assert all(m.how in ("built", "waited", "ready") for m in mapped)
        # The file every rank trained from holds exactly what load_split gives (the one loading rule).
        here = open_split(dataset, manifest, split, str(cache))
        assert (here.how, str(here.path), here.inode) == ("ready", mapped[0].path, mapped[0].inode)
        reference = load_split(dataset, manifest, split)
        assert torch.equal(here.tensors.features, reference.features)
        assert torch.equal(here.tensors.labels, reference.labels) and here.tensors.labels.dtype == torch.int64
    # Each rank trained its DistributedSampler share in the sampler's order, as before the cache.
    rows = manifest.rows("train")
    trained = []
    for rank in range(3):
        order = RankSampler(range(rows), num_replicas=3, rank=rank, shuffle=True, seed=SEED).rank_indices().tolist()
        recorded = result.indices(rank, 0)
        assert recorded == order[: len(recorded)]
        trained += recorded
    assert sorted(trained) == list(range(rows))
    assert sorted(path.name.split("-")[0] for path in (cache / manifest.fingerprint).glob("*.bin")) == ["train", "val"]


@pytest.mark.torchrun
def test_a_truncated_or_corrupt_cache_is_rebuilt_once_and_then_found_ready(dataset, tmp_path):
    cache, manifest = tmp_path / "cache", read_manifest(dataset)
    for split in ("train", "val"):
        open_split(dataset, manifest, split, str(cache))
    train_file = cache_path(dataset, manifest, "train", str(cache))
    val_file = cache_path(dataset, manifest, "val", str(cache))
    with open(train_file, "r+b") as handle:
        handle.truncate(train_file.stat().st_size - 8)  # a copy cut short
    with open(val_file, "r+b") as handle:
        handle.write(b"garbage!")  # a header overwritten

    repaired = launch(tmp_path / "repaired", dataset, 2, cache)
    for split, reason in (("train", "truncated"), ("val", "corrupt header")):
        mapped = repaired.mapped(split)
        assert_one_file_for_all(mapped, 2)
        assert [m.how for m in mapped].count("rebuilt") == 1 and "built" not in [m.how for m in mapped]
        assert repaired.output.count(f"rebuilt ({reason}") == 1, repaired.output[-3000:]

    # Once the cache is whole again no rank reads the shards.
    again = launch(tmp_path / "again", dataset, 2, cache)
    assert [m.how for m in again.mapped("train") + again.mapped("val")] == ["ready"] * 4


@pytest.mark.torchrun
def test_two_runs_starting_together_build_the_cache_once(dataset, tmp_path):
    cache = tmp_path / "cache"
    runs = [start(tmp_path / name, dataset, 2, cache) for name in ("a", "b")]
    results = [finish(process, tmp_path / name) for process, name in zip(runs, ("a", "b"))]
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.output[-2000:] for r in results)
    for split in ("train", "val"):
        mapped = results[0].mapped(split) + results[1].mapped(split)
        assert len(mapped) == 4 and len({(m.path, m.inode) for m in mapped}) == 1, mapped
        assert [m.how for m in mapped].count("built") == 1, [m.how for m in mapped]


@pytest.mark.torchrun
def test_a_read_only_cache_dir_stops_the_run_naming_the_setting(dataset, tmp_path):
    cache = tmp_path / "read-only"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        result = finish(start(tmp_path / "run", dataset, 2, cache, preexec_fn=without_write_override()), tmp_path)
    finally:
        cache.chmod(0o755)
    assert result.returncode != 0
    assert "NodeCacheError" in result.output and "data.cache_dir=" in result.output, result.output[-3000:]
    assert str(cache / read_manifest(dataset).fingerprint) in result.output
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "run" / "model.pt").exists()


# --- in one process -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["rank", "child"])
def test_a_full_disk_while_building_names_the_path_and_leaves_no_file(dataset, tmp_path, where):
    """RLIMIT_FSIZE makes the kernel refuse the write mid-file (EFBIG), as a full disk does (ENOSPC); the
    child's error is raised in the rank with its type and message."""
    cache = tmp_path / "cache"
    script = (
        "import resource, signal, sys\n"
        "from training.loading import node_cache\n"
        "from training.core.manifest import read_manifest\n"
        "from training.loading.node_cache import open_split\n"
        f"node_cache.BUILD_IN_RANK_MAX_BYTES = {node_cache.BUILD_IN_RANK_MAX_BYTES if where == 'rank' else 0}\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({HEADER_BYTES * 2}, resource.RLIM_INFINITY))\n"
        f"open_split({str(dataset)!r}, read_manifest({str(dataset)!r}), 'train', {str(cache)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("training.loading.node_cache.NodeCacheError: cannot write the node data cache "), done.stderr
    assert "data.cache_dir=" in last and "File too large" in last
    assert [path.name for path in (cache / read_manifest(dataset).fingerprint).iterdir()] == [
        cache_path(dataset, read_manifest(dataset), "train", str(cache)).name + ".lock"
    ]  # no temp file, no partial .bin


def built_by(path: Path) -> str:
    """Who built a node cache file, from its header ("pid N on HOST")."""
    with open(path, "rb") as handle:
        _, length, _ = node_cache._PREFIX.unpack(handle.read(node_cache._PREFIX.size))
        return json.loads(handle.read(length))["built_by"]


def test_a_small_split_is_built_in_the_rank_and_a_large_one_in_the_child_to_the_same_tensors(
    dataset, tmp_path, monkeypatch
):
    """The builder child keeps a large build's allocator leftovers out of the rank; for a small split its
    interpreter and imports cost more than the build, so the rank builds it itself. Both write the same file."""
    manifest = read_manifest(dataset)
    sizes = {split: node_cache._expected_header(manifest, split)["file_bytes"] for split in ("train", "val")}
    assert node_cache.builds_in_rank(manifest, ["train", "val"])
    here = open_split(dataset, manifest, "train", str(tmp_path / "here"))
    assert here.how == "built" and built_by(here.path).startswith(f"pid {os.getpid()} ")

    # The splits built together count together.
    monkeypatch.setattr(node_cache, "BUILD_IN_RANK_MAX_BYTES", sizes["train"] + sizes["val"] - 1)
    assert node_cache.builds_in_rank(manifest, ["train"]) and not node_cache.builds_in_rank(manifest, ["train", "val"])
    monkeypatch.setattr(node_cache, "BUILD_IN_RANK_MAX_BYTES", 0)
    child = open_split(dataset, manifest, "train", str(tmp_path / "child"))
    assert child.how == "built" and not built_by(child.path).startswith(f"pid {os.getpid()} ")
    for name, tensor in here.tensors.sections().items():
        assert torch.equal(child.tensors.sections()[name], tensor), name


def test_a_numeric_build_reads_its_columns_without_importing_pandas(dataset, tmp_path):
    """pyarrow's ``to_numpy`` imports pandas (about 0.5 s and 30 MB): the building rank would keep it all run."""
    script = (
        "import sys\n"
        "from training.core.manifest import read_manifest\n"
        "from training.loading.node_cache import open_split\n"
        f"print(open_split({str(dataset)!r}, read_manifest({str(dataset)!r}), 'train', {str(tmp_path)!r}).how)\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'pandas')[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-3:] == ["built", "[]", ""], done.stdout


def test_a_stale_file_and_older_versions_are_replaced_by_a_fresh_build(dataset, tmp_path):
    manifest = read_manifest(dataset)
    val = open_split(dataset, manifest, "val", str(tmp_path))
    train_file = cache_path(dataset, manifest, "train", str(tmp_path))
    shutil.copy(val.path, train_file)  # a valid cache, of another split
    older = train_file.with_name(train_file.name.replace(f"-f{FORMAT_VERSION}n", "-f0n"))
    assert older != train_file
    shutil.copy(val.path, older)  # a file of an older format version
    train = open_split(dataset, manifest, "train", str(tmp_path))
    assert train.how == "rebuilt" and "stale: " in train.detail and "split 'val' (expected 'train')" in train.detail
    assert torch.equal(train.tensors.features, load_split(dataset, manifest, "train").features)
    assert not older.exists()


def test_the_default_cache_lives_beside_the_shards(dataset):
    manifest = read_manifest(dataset)
    cached = open_split(dataset, manifest, "val")
    assert cached.path.parent == dataset / "cache" and cached.how in ("built", "ready")
    assert open_split(dataset, manifest, "val").how == "ready"


def test_auto_places_a_split_on_a_gpu_only_when_it_fits_and_never_on_the_cpu():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    placed, why = decide("auto", gpu, needed=250, free=1000)
    assert placed is True and "at most a quarter" in why  # exactly a quarter still fits
    assert decide("auto", gpu, needed=251, free=1000)[0] is False
    assert "more than a quarter" in decide("auto", gpu, needed=251, free=1000)[1]
    assert decide("auto", gpu, needed=1, free=-5)[0] is False  # the model alone fills the device
    assert decide("auto", cpu, needed=1, free=10**12)[0] is False
    assert decide(True, cpu, needed=10**12, free=0)[0] is True
    assert decide(False, gpu, needed=1, free=10**12)[0] is False


def test_data_on_device_on_the_cpu_keeps_the_shared_mapping(dataset, tmp_path):
    manifest = read_manifest(dataset)
    mapped = open_split(dataset, manifest, "train", str(tmp_path)).tensors
    model = torch.nn.Linear(manifest.n_features, 3)
    placed, reasons = place_splits({"train": mapped}, True, torch.device("cpu"), model)
    assert placed["train"].features.data_ptr() == mapped.features.data_ptr()  # no per-rank copy
    assert reasons == ["train on cpu (train.data_on_device=true)"]
    _, reasons = place_splits(
        {"train": SplitTensors(mapped.features, mapped.labels)}, "auto", torch.device("cpu"), model
    )
    assert reasons[0].startswith("train on the host (auto: ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: on the CPU the device is the host")
def test_a_split_placed_on_the_gpu_lives_there_and_yields_the_host_batches(dataset, tmp_path):
    """train.data_on_device=true on a GPU: the split is copied there once, each batch is gathered there, and the
    batches (rows, features, labels, padding weights) are those gathered on the host and copied over."""
    manifest, gpu = read_manifest(dataset), torch.device("cuda", 0)
    host = open_split(dataset, manifest, "train", str(tmp_path)).tensors
    model = torch.nn.Linear(manifest.n_features, 3).to(gpu)
    placed, reasons = place_splits({"train": host}, True, gpu, model)
    assert placed["train"].features.device == gpu and placed["train"].labels.device == gpu
    assert host.features.device.type == "cpu" and reasons == ["train on cuda:0 (train.data_on_device=true)"]
    on_gpu = TrainBatches(placed["train"], 1, 2, 64, SEED, gpu, pin_memory=True)
    from_host = TrainBatches(host, 1, 2, 64, SEED, gpu, pin_memory=True)
    pairs = list(zip(on_gpu.epoch(1), from_host.epoch(1), strict=True))
    assert pairs and pairs[-1][0].weights is not None  # the last batch holds sampler padding
    for a, b in pairs:
        assert a.features.device == gpu and torch.equal(a.indices, b.indices)
        assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
        assert (a.weights is None and b.weights is None) or torch.equal(a.weights, b.weights)


def test_where_the_cache_lives_is_not_part_of_the_dataset_fingerprint():
    from training.core.config import DataConfig
    from training.prepare.fingerprint import dataset_fingerprint

    identity = {"synthetic": "classification?rows=10"}
    assert dataset_fingerprint(identity, DataConfig(cache_dir="/scratch/a")) == dataset_fingerprint(
        identity, DataConfig()
    )
