"""The stream (``data.stream``): ranks read the train and val shards from where the dataset lives (a local path or an
fsspec URL, ``data.root``), through the node's bounded cache (``shard_cache.py``), never the whole split on a node.

- **The order** is the stream's global order of the epoch (``stream_order.py``: shards shuffled, rows shuffled in
  windows of ``data.shuffle_window`` shards), cut into the node cache's per-rank slices: rank r trains global
  positions r, r + W, ...; step s of all ranks together covers positions ``[s*b*W, (s+1)*b*W)``
  (``global_positions_of_steps``). So W ranks x b and one rank x W*b train the same rows in every step, the step's
  divisor is the same rule (``global_rows_in_steps``; with row weights, the prefix sums of the weights in the
  order, one window at a time), the padding is the same (positions past the split weigh 0; a rank's padded
  position p takes the row of its own position p - W, which it holds), and a step checkpoint's (epoch, step,
  global batch) is a position in the order that any world size continues from.
- **Windows**: a rank reads a window's shards together (pinned in the cache while read), encodes them with the
  one loading rule (``batches.py: load_split``, the node cache's), and trains its positions of it from memory; a
  background thread reads the next windows meanwhile (``Prefetcher``: one read and waiting, one being read). A rank
  holds at most four windows (the one it trains, or two for a step across a window's end, and those two): its
  memory does not grow with the split.
- **Validation** reads each rank's contiguous share of the val split shard by shard (``StreamedSplit.pieces``), the
  next shard read while the current one is scored.

``stream_wanted`` decides ``data.stream: auto`` (on when the node cache would take more than half of its disk's
free space); training/resolve.py records the decision before the run's identity is computed.
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.core.config import DataConfig
from training.core.fileio import DATA, byte_size, log_main, log_rank
from training.core.manifest import Manifest, SplitInfo
from training.kinds.base import Codec
from training.kinds.ragged import BatchContext, RaggedArray
from training.loading.batches import (
    WEIGHTS,
    Batch,
    SplitArrays,
    combined_row_weights,
    device_batch,
    empty_split,
    global_positions_of_steps,
    global_rows_in_steps,
    load_split,
    manifest_codecs,
    split_from_sections,
)
from training.loading.node_cache import bytes_to_build, cache_directory
from training.loading.shard_cache import ShardCache, check_limit
from training.loading.stream_order import StreamOrder

STREAM_DIR = "stream"  # <node cache dir>/stream: the shard cache
PREFETCH_NICE = 10  # how much lower the reading thread's priority is than the training thread's
AUTO_SHARE = 0.5  # data.stream auto: on when the node cache would take more than this share of its disk's free space


# --------------------------------------------------------------------------- whether to stream (data.stream auto)


def stream_wanted(data: DataConfig, dataset_dir: str | Path, manifest: Manifest) -> tuple[bool, str]:
    """(stream?, why): ``data.stream`` as set, or for ``auto`` whether the node cache of train and val (what is
    not built yet) would take more than ``AUTO_SHARE`` of the free space on the disk it would go to."""
    if data.stream is not True and data.stream is not False:
        directory = cache_directory(dataset_dir, manifest, data.cache_dir)
        needed = bytes_to_build(dataset_dir, manifest, ("train", "val"), data.cache_dir)
        free = shutil.disk_usage(_existing(directory)).free
        on = needed > AUTO_SHARE * free
        verdict = "more" if on else "no more"
        return on, (
            f"data.stream auto: the node cache would take {byte_size(needed)}, {verdict} than half of the "
            f"{byte_size(free)} free under {directory}: {'streaming' if on else 'the node cache'}"
        )
    return bool(data.stream), f"data.stream={str(data.stream).lower()}"


def _existing(directory: Path) -> Path:
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory


def stream_directory(dataset_dir: str | Path, manifest: Manifest, cache_dir: str | None) -> Path:
    """The node's shard cache: ``<data.cache_dir>/<fingerprint>/stream``; without ``data.cache_dir``, on the node's
    own disk, ``<the temp dir>/ddpflow-cache/<fingerprint>/stream`` (never beside shards on a shared filesystem)."""
    if cache_dir:
        return cache_directory(dataset_dir, manifest, cache_dir) / STREAM_DIR
    return Path(tempfile.gettempdir()) / "ddpflow-cache" / manifest.fingerprint / STREAM_DIR


def check_stream_cache(data: DataConfig, manifest: Manifest) -> None:
    """The cache holds two windows of the split's largest shards (``shard_cache.py: check_limit``); a window is at
    most the train split's shards."""
    largest = max((shard.bytes for split in ("train", "val") for shard in manifest.splits[split].shards), default=0)
    check_limit(data.stream_cache_limit, largest, min(data.shuffle_window, len(manifest.splits["train"].shards)))


# --------------------------------------------------------------------------- reading shards


@dataclass(frozen=True)
class StreamSource:
    """A split, read shard by shard from where the dataset lives through the node's cache."""

    dataset_dir: str  # a local path or a URL
    manifest: Manifest
    split: str
    cache: ShardCache
    codecs: dict[str, Codec]
    read_rows: int = 16_384

    @classmethod
    def open(cls, dataset_dir: str | Path, manifest: Manifest, split: str, data: DataConfig) -> StreamSource:
        check_stream_cache(data, manifest)
        directory = stream_directory(dataset_dir, manifest, data.cache_dir)
        cache = ShardCache(directory, data.stream_cache_limit, str(dataset_dir))
        return cls(str(dataset_dir), manifest, split, cache, manifest_codecs(dataset_dir, manifest))

    @property
    def rows(self) -> int:
        return self.manifest.rows(self.split)

    def load(self, shard_indices: Iterable[int]) -> SplitArrays:
        """The rows of these shards, shard after shard, encoded and normalised as the node cache's (``load_split``,
        the one loading rule); the files are held in the cache while they are read."""
        shards = [self.manifest.splits[self.split].shards[i] for i in shard_indices]
        view = replace(
            self.manifest,
            splits={**self.manifest.splits, self.split: SplitInfo(sum(shard.rows for shard in shards), shards)},
        )
        if not shards:
            return split_from_sections(view, empty_split(view, 0)).with_codecs(self.codecs)
        with self.cache.pinned(shards) as directory:
            return load_split(directory, view, self.split, self.read_rows, self.codecs)

    def describe(self) -> str:
        cache = self.cache
        return (
            f"{self.split}: {self.rows} rows streamed from {self.dataset_dir} through {cache.directory} "
            f"(limit {byte_size(cache.limit)}; this rank copied in {byte_size(cache.downloaded)}, the cache held at "
            f"most {byte_size(cache.peak)} when it added a shard)"
        )


_END = object()


class Prefetcher:
    """``loads`` called in order in a background thread, each result handed over in order: one result waits while
    the next is loaded."""

    def __init__(self, loads: Iterable[Callable[[], Any]], ahead: int = 1):
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(loads),), daemon=True, name="ddpflow-prefetch")
        self._thread.start()

    def _run(self, loads: Iterator[Callable[[], Any]]) -> None:
        _yield_to_training()
        try:
            for load in loads:
                if not self._put(("item", load())):
                    return
        except BaseException as error:  # handed to the reader, which raises it
            self._put(("error", error))
            return
        self._put(("end", _END))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            kind, value = self._queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _yield_to_training() -> None:
    """Lower this thread's priority (and that of the threads it starts, such as the copies): on a rank's
    own cores the reading then takes the time the training thread leaves, waiting in its all-reduce, rather than
    delaying a step that every rank waits for. It is one window ahead, so it still keeps up when there is none."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + PREFETCH_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed: the same priority as the rank
        pass


# --------------------------------------------------------------------------- training batches


@dataclass(frozen=True)
class LoadedWindow:
    """One window in memory: its rows (shard after shard), where each of its positions reads (``shuffle``), each
    row's id, and the prefix sums of its rows' weights in the order (float64; None when every row weighs 1)."""

    arrays: SplitArrays
    start: int  # the global position of its first row
    shuffle: torch.Tensor  # int64 [rows]: position start + k reads row shuffle[k] of ``arrays``
    row_ids: torch.Tensor  # int64 [rows]: the id of each row of ``arrays``
    row_weights: torch.Tensor | None  # float32 [rows] of ``arrays``
    weight_before: torch.Tensor | None  # float64 [rows + 1]: Σ w of positions start .. start + k - 1


class EpochWindows:
    """One epoch's windows from ``first`` on, read in order by a ``Prefetcher``; kept until released."""

    def __init__(
        self, source: StreamSource, order: StreamOrder, first: int, row_weights_of, shard_weights: dict[int, float]
    ):
        self.order, self.loaded, self.row_weights_of = order, {}, row_weights_of
        self.shard_weights = shard_weights  # Σ w of each shard read, kept across epochs (the epoch's total)
        loads = (lambda j=j: self._load(source, j) for j in range(first, len(order)))
        self._next, self._windows = first, Prefetcher(loads)
        self._iterator = iter(self._windows)

    def _load(self, source: StreamSource, j: int) -> LoadedWindow:
        arrays = source.load(self.order.windows[j])
        shuffle = torch.from_numpy(self.order.shuffle(j))
        weights = combined_row_weights(arrays.weights, self.row_weights_of(arrays))
        before = None
        if weights is not None:
            in_order = weights.index_select(0, shuffle).double()
            before = torch.cat([torch.zeros(1, dtype=torch.float64), in_order.cumsum(0)])
            ends = np.cumsum([self.order.shard_rows[shard] for shard in self.order.windows[j]])
            for shard, lo, hi in zip(self.order.windows[j], [0, *ends[:-1]], ends):
                self.shard_weights[shard] = float(weights[lo:hi].double().sum())
        row_ids = torch.from_numpy(self.order.row_ids(j))
        return LoadedWindow(arrays, int(self.order.starts[j]), shuffle, row_ids, weights, before)

    def get(self, j: int) -> LoadedWindow:
        while j >= self._next:
            self.loaded[self._next] = next(self._iterator)
            self._next += 1
        if j not in self.loaded:
            raise RuntimeError(f"window {j} of epoch {self.order.epoch} was released already (a stream order bug)")
        return self.loaded[j]

    def release_before(self, j: int) -> None:
        for old in [k for k in self.loaded if k < j]:
            del self.loaded[old]

    def weight_between(self, first: int, last: int) -> float:
        """Σ w over global positions [first, last)."""
        if last <= first:
            return 0.0
        total = 0.0
        for j in range(int(self.order.window_of(first)), int(self.order.window_of(last - 1)) + 1):
            window = self.get(j)
            lo = max(first, window.start) - window.start
            hi = min(last, int(self.order.starts[j + 1])) - window.start
            total += float(window.weight_before[hi] - window.weight_before[lo])
        return total

    def close(self) -> None:
        self._windows.close()
        self.loaded.clear()


class StreamBatches:
    """One rank's training batches of the stream, epoch by epoch: ``TrainBatches``' interface (``len``, ``epoch``,
    ``global_rows``, ``global_weight``, ``world_size``) over the stream's global order (module docstring)."""

    def __init__(
        self,
        source: StreamSource,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int,
        window: int,
        device: torch.device,
        row_weights_of: Callable[[SplitArrays], torch.Tensor | None] | None = None,
        reorder=None,
    ):
        self.source, self.rank, self.world_size, self.batch_size = source, rank, world_size, batch_size
        self.seed, self.window, self.device = seed, window, device
        # Each row's class weight (train.class_weights: the objective's split_row_weights), times data.weight.
        self.row_weights_of = row_weights_of or (lambda split: None)
        self.reorder = reorder or (lambda epoch, positions: positions)
        self.rows = source.rows
        self.per_rank = math.ceil(self.rows / world_size)  # DistributedSampler's num_samples: the same padding
        self.weighted = source.manifest.weight is not None or self.row_weights_of(source.load([])) is not None
        self._windows: EpochWindows | None = None
        self._weights: dict[tuple[int, int], float] = {}
        self._shard_weights: dict[int, float] = {}
        self.shard_rows = [shard.rows for shard in source.manifest.splits[source.split].shards]

    def __len__(self) -> int:
        return math.ceil(self.per_rank / self.batch_size)

    def global_rows(self, start: int, stop: int) -> int:
        return global_rows_in_steps(self.rows, self.world_size, self.batch_size, start, stop)

    def global_weight(self, start: int, stop: int) -> float:
        """Σ w of the real rows of steps ``[start, stop)`` on all ranks, from the windows' prefix sums (every rank
        holds every row of a window it reads); ``global_rows`` when every row weighs 1."""
        if not self.weighted:
            return float(self.global_rows(start, stop))
        if (start, stop) not in self._weights:  # asked by each micro-batch of an optimizer step: computed once
            first, last = global_positions_of_steps(self.rows, self.world_size, self.batch_size, start, stop)
            whole = (first, last) == (0, self.rows)  # the epoch's (train_loss): every row, in any order
            weight = self._split_weight() if whole else self._windows.weight_between(first, last)
            self._weights = {(start, stop): weight}
        return self._weights[(start, stop)]

    def _split_weight(self) -> float:
        """Σ w of the whole split: each shard's sum, kept as its window was read (a pass resumed mid-epoch reads the
        shards it skipped once more, for their weights)."""
        missing = [i for i in range(len(self.shard_rows)) if i not in self._shard_weights]
        for i in missing:
            arrays = self.source.load([i])
            weights = combined_row_weights(arrays.weights, self.row_weights_of(arrays))
            self._shard_weights[i] = float(weights.double().sum())
        return sum(self._shard_weights[i] for i in range(len(self.shard_rows)))

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of steps ``start, start + 1, ...`` of ``epoch``: a resumed pass reads from the window of
        its first step on."""
        if self.rows == 0 or start >= len(self):
            return
        order = StreamOrder(self.shard_rows, self.window, self.seed, epoch)
        b, w = self.batch_size, self.world_size
        first = int(order.window_of(min(start * b * w, self.rows - 1)))
        windows = EpochWindows(self.source, order, first, self.row_weights_of, self._shard_weights)
        self._windows, self._weights = windows, {}
        try:
            for step in range(start, len(self)):
                self._windows.release_before(int(order.window_of(min(step * b * w, self.rows - 1))))
                mine = torch.arange(step * b, min((step + 1) * b, self.per_rank), dtype=torch.int64)
                positions = self.reorder(epoch, self.rank + w * mine)
                yield self._batch(order, epoch, positions)
        finally:
            self._windows.close()
        log_rank(f"rank {self.rank}: epoch {epoch}: {self.source.describe()}", DATA)

    def _batch(self, order: StreamOrder, epoch: int, positions: torch.Tensor) -> Batch:
        """The rows at ``positions`` (padded ones: the rank's own position one step of W earlier), gathered from
        the windows they fall in, in order."""
        real = positions < self.rows
        reads = torch.where(real, positions, _padded_source(positions, self.world_size, self.rows))
        windows = order.window_of(reads.numpy())
        parts = []
        for j in np.unique(windows):  # non-decreasing along the batch: each window's rows are one run
            window = self._windows.get(int(j))
            here = torch.from_numpy(windows == j)
            parts.append((window, window.shuffle.index_select(0, reads[here] - window.start)))
        arrays = parts[0][0].arrays
        per_window = [(window.arrays.row_sections(), local) for window, local in parts]  # built once a window
        sections = {
            name: torch.cat([held[name].index_select(0, local) for held, local in per_window])
            for name in per_window[0][0]
            if name != WEIGHTS
        }
        rows = torch.cat([window.row_ids.index_select(0, local) for window, local in parts])
        collated = _collated(parts, BatchContext(rows, epoch, self.seed, train=True))
        weights = None
        if self.weighted:
            weights = torch.cat([window.row_weights.index_select(0, local) for window, local in parts])
            weights = weights * real
        elif not bool(real.all()):
            weights = real.to(torch.float32)
        all_real = None if bool(real.all()) else real
        weights = None if weights is None else weights.to(self.device, non_blocking=True)
        return device_batch(arrays, rows, sections, collated, all_real, weights, self.device)


def _padded_source(positions: torch.Tensor, world_size: int, rows: int) -> torch.Tensor:
    """Where a padded position (p >= rows) reads: p - W, this rank's previous position, which is real and in the
    last window (p % rows when the split has fewer rows than ranks). Its row weighs 0."""
    back = positions - world_size
    return torch.where(back >= 0, back, positions.remainder(max(rows, 1)))


def _collated(parts: list[tuple[LoadedWindow, torch.Tensor]], context: BatchContext) -> dict[str, torch.Tensor]:
    """The ragged inputs' batch entries (text, images): each window's rows gathered, then collated together."""
    names = parts[0][0].arrays.ragged_names()
    if not names:
        return {}
    entries = {}
    for name in names:
        values, offsets = [], [torch.zeros(1, dtype=torch.int64)]
        for window, local in parts:
            got_values, got_offsets = window.arrays.inputs[name].gather(local)
            values.append(got_values)
            offsets.append(got_offsets[1:] + offsets[-1][-1])
        merged = RaggedArray(torch.cat(values), torch.cat(offsets))
        entries |= parts[0][0].arrays.collators[name](merged.values, merged.offsets, context)
    return entries


# --------------------------------------------------------------------------- a rank's stream


@dataclass(frozen=True)
class RankStream:
    """What a rank reads with ``data.stream``: the train split's source and the val split, shard by shard."""

    train: StreamSource
    val: StreamedSplit
    window: int  # data.shuffle_window

    def batches(self, ctx, batch_size: int, seed: int, row_weights_of, reorder=None) -> StreamBatches:
        return StreamBatches(
            self.train, ctx.rank, ctx.world_size, batch_size, seed, self.window, ctx.device, row_weights_of, reorder
        )


def open_stream(dataset_dir: str | Path, manifest: Manifest, data: DataConfig, ctx) -> RankStream | None:
    """The rank's stream when ``data.stream`` is on (None: the node cache). ``auto`` is decided by the launch and
    recorded; a rank given it undecided decides here, and every rank streams if one node must."""
    on, why = stream_wanted(data, dataset_dir, manifest)
    if data.stream is not True and data.stream is not False:
        on = ctx.all_reduce_sum([float(on)])[0] > 0
    if not on:
        return None
    train = StreamSource.open(dataset_dir, manifest, "train", data)
    log_main(
        ctx.is_main,
        f"{why}: train and val streamed from {dataset_dir} through {train.cache.directory} (limit "
        f"{byte_size(data.stream_cache_limit)}, windows of {data.shuffle_window} shards); batches gathered on the host "
        "and decoded in the rank (train.data_on_device and train.num_workers do not apply)",
        DATA,
    )
    return RankStream(train, StreamedSplit(replace(train, split="val")), data.shuffle_window)


# --------------------------------------------------------------------------- validation


class StreamedSplit:
    """The val split, read shard by shard: ``pieces(start, stop)`` as ``SplitArrays.pieces`` gives it whole."""

    def __init__(self, source: StreamSource):
        self.source = source
        shards = source.manifest.splits[source.split].shards
        self.first = np.concatenate([[0], np.cumsum([shard.rows for shard in shards])]).astype(np.int64)

    def __len__(self) -> int:
        return self.source.rows

    def pieces(self, start: int, stop: int) -> Iterator[tuple[SplitArrays, int, int]]:
        """(a shard's rows, first, end) for each shard overlapping rows ``[start, stop)``; one empty piece for none."""
        overlaps = range(len(self.first) - 1) if start < stop else ()
        wanted = [i for i in overlaps if self.first[i] < stop and self.first[i + 1] > start]
        if not wanted:
            yield self.source.load([]), 0, 0
            return
        shards = Prefetcher(lambda i=i: self.source.load([i]) for i in wanted)
        try:
            for i, arrays in zip(wanted, shards):
                first = int(self.first[i])
                yield arrays, max(start, first) - first, min(stop, int(self.first[i + 1])) - first
        finally:
            shards.close()
