"""Prepared shards -> tensors in memory -> one rank's batches.

A split is read ONCE into sections allocated up front from the manifest's row
counts (``split_layout``: the numeric block, one section per other input, the
labels, the weights), then filled record batch by record batch (``fill_split``,
into tensors here or straight into the node cache's mapped file): peak memory
is the sections plus one record batch, never a concatenation or a DataFrame
copy. Non-numeric inputs go through their codec (training/kinds/registry.py, the
one encoding serving uses too); numeric features (and a regression target) are
normalised in place by ``training/kinds/normalisation.py``.

Training batches come from a ``DistributedSampler`` (rank r takes
``perm[r::W]`` of a permutation seeded by ``train.seed`` and the epoch) and
are fetched with ONE tensor index per batch, not row by row: the rank's
epoch order is one tensor, sliced into batches (no Python list of every row).

``global_rows_in_steps`` counts the real rows all ranks train in a run of
steps: the divisor that makes each optimizer step's gradient the mean over the
whole global batch (``training/loop/step.py``), written next to the sampler rule
it mirrors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from training.core.location import filesystem, is_url
from training.core.manifest import Manifest
from training.kinds.base import Codec
from training.kinds.inputs import block_names, in_numeric_block, inputs_from_manifest
from training.kinds.normalisation import Normaliser
from training.kinds.ragged import BatchContext, RaggedArray, evaluation_context
from training.kinds.registry import codecs_for, read_encoders


class ShardError(ValueError):
    """A shard does not match its manifest (rows, columns)."""


FEATURES, LABELS, WEIGHTS = "features", "labels", "weights"
INPUT_PREFIX = "input."  # a non-numeric input's section: "input.<name>"
# A ragged input's two sections: "input.<name>.values" (every row's values, flat) and "input.<name>.offsets".
VALUES, OFFSETS = ".values", ".offsets"

Collate = Callable[[torch.Tensor, torch.Tensor, BatchContext], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class SplitArrays:
    """A split as sections of equal row count, what the node cache maps and the loader gathers from.

    The numeric inputs are ONE block (``features``, normalised, in manifest order: one gather per batch
    for any number of them); every other input is a section of its own (``inputs``). A ragged input (text,
    images) is a ``RaggedArray`` that stays on the host; its codec's ``collate`` (``collators``, attached by
    ``with_codecs``) makes its batch-dict entries per batch."""

    features: torch.Tensor  # [rows, F] float32, normalised: the numeric inputs (F may be 0)
    # [rows] int64 (classification), float32 (regression, standardised); [rows, C] float32 multi-hot (multilabel)
    labels: torch.Tensor
    inputs: dict[str, torch.Tensor | RaggedArray] = field(default_factory=dict)  # the others: [rows, *shape]
    weights: torch.Tensor | None = None  # [rows] float32: data.weight; None without one
    numeric: tuple[str, ...] = ()  # the names of the columns of ``features``
    collators: dict[str, Collate] = field(default_factory=dict)  # ragged input -> its codec's collate

    def __len__(self) -> int:
        return self.labels.shape[0]

    def ragged_names(self) -> list[str]:
        return [name for name, values in self.inputs.items() if isinstance(values, RaggedArray)]

    def sections(self) -> dict[str, torch.Tensor]:
        """Every tensor by its section name (``FEATURES``, ``input.<name>`` or ``input.<name>.values`` and
        ``.offsets``, ``LABELS``, ``WEIGHTS``)."""
        sections = {FEATURES: self.features}
        for name, values in self.inputs.items():
            if isinstance(values, RaggedArray):
                sections |= {INPUT_PREFIX + name + VALUES: values.values, INPUT_PREFIX + name + OFFSETS: values.offsets}
            else:
                sections[INPUT_PREFIX + name] = values
        sections[LABELS] = self.labels
        if self.weights is not None:
            sections[WEIGHTS] = self.weights
        return sections

    def row_sections(self) -> dict[str, torch.Tensor]:
        """The sections with one entry per row: what a batch gathers and a device can hold (not the ragged ones)."""
        ragged = {INPUT_PREFIX + name + suffix for name in self.ragged_names() for suffix in (VALUES, OFFSETS)}
        return {name: tensor for name, tensor in self.sections().items() if name not in ragged}

    def with_sections(self, sections: dict[str, torch.Tensor]) -> SplitArrays:
        """The same split with each section given replaced (moved to a device...); the others as they are."""
        sections = {**self.sections(), **sections}
        return replace(
            self,
            features=sections[FEATURES],
            labels=sections[LABELS],
            inputs={name: _input_from(sections, name, name in self.ragged_names()) for name in self.inputs},
            weights=sections.get(WEIGHTS),
        )

    def with_codecs(self, codecs: dict[str, Codec]) -> SplitArrays:
        """The split with its ragged inputs' ``collate`` attached (the codecs of the dataset or the checkpoint)."""
        return replace(self, collators={name: codecs[name].collate for name in self.ragged_names()})

    def collate_rows(self, rows: torch.Tensor, context: BatchContext) -> dict[str, torch.Tensor]:
        """The ragged inputs' batch-dict entries for ``rows`` (on the host), made by their codecs."""
        entries = {}
        for name in self.ragged_names():
            if name not in self.collators:
                raise RuntimeError(f"input {name!r} is ragged but its codec was not attached (SplitArrays.with_codecs)")
            entries |= self.collators[name](*self.inputs[name].gather(rows), context)
        return entries

    def batch_inputs(self, features: torch.Tensor, others: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's batch dict: every numeric input as a [B] view of the gathered block, then the others."""
        names = self.numeric or tuple(f"x{j}" for j in range(features.shape[1]))
        return {**{name: features[:, j] for j, name in enumerate(names)}, **others}

    def pieces(self, start: int, stop: int) -> Iterator[tuple[SplitArrays, int, int]]:
        """Rows ``[start, stop)`` as (split, first, end) pieces: this split whole (a streamed split yields one per
        shard: training/loading/stream.py)."""
        yield self, start, stop

    def rows(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` as the model's batch dict (views; ragged inputs collated for evaluation)."""
        others = {name: t[start:stop] for name, t in self.inputs.items() if not isinstance(t, RaggedArray)}
        if self.ragged_names():
            rows = torch.arange(start, stop)
            others |= self.collate_rows(rows, evaluation_context(rows))
        return self.batch_inputs(self.features[start:stop], others)


def _input_from(sections: dict[str, torch.Tensor], name: str, ragged: bool) -> torch.Tensor | RaggedArray:
    if ragged:
        return RaggedArray(sections[INPUT_PREFIX + name + VALUES], sections[INPUT_PREFIX + name + OFFSETS])
    return sections[INPUT_PREFIX + name]


SplitTensors = SplitArrays  # the name its callers in training/loop/ use; SplitTensors(features, labels) builds one


def label_dtype(task: str) -> torch.dtype:
    """int64 class indices (classification); float32 standardised values (regression), multi-hot (multilabel)."""
    return torch.int64 if task == "classification" else torch.float32


@dataclass(frozen=True)
class Section:
    """One section of a split's layout: its name, dtype and per-row shape.

    ``extent``: "rows", ``[rows, *shape]``; "offsets", a ragged input's ``[rows + 1]``; "values", a ragged
    input's values, ``[total]``: their number is known only once the split is encoded (``fill_split``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per row
    extent: str = "rows"

    def full_shape(self, rows: int) -> tuple[int, ...]:
        """The section's shape in a split of ``rows`` rows (not for "values")."""
        return (rows + 1,) if self.extent == "offsets" else (rows, *self.shape)


def split_layout(manifest: Manifest) -> list[Section]:
    """The sections of a split of ``manifest``, in file order (the node cache's layout): the ragged inputs'
    values last, since only they are sized by the encoding."""
    inputs = inputs_from_manifest(manifest)
    sections, values = [Section(FEATURES, torch.float32, (manifest.n_features,))], []
    for name, info in inputs.items():
        if info.ragged_dtype:
            sections.append(Section(INPUT_PREFIX + name + OFFSETS, torch.int64, (), "offsets"))
            values.append(Section(INPUT_PREFIX + name + VALUES, getattr(torch, info.ragged_dtype), (), "values"))
        elif not in_numeric_block(info.kind):
            sections.append(Section(INPUT_PREFIX + name, getattr(torch, info.dtype), info.shape))
    label_shape = (manifest.n_outputs,) if manifest.task == "multilabel" else ()  # multi-hot [rows, C]
    sections.append(Section(LABELS, label_dtype(manifest.task), label_shape))
    if manifest.weight:
        sections.append(Section(WEIGHTS, torch.float32, ()))
    return sections + values


def empty_split(manifest: Manifest, rows: int, make=torch.empty) -> dict[str, torch.Tensor]:
    """The split's sections sized from the manifest alone: all but the ragged values."""
    return {s.name: make(s.full_shape(rows), dtype=s.dtype) for s in split_layout(manifest) if s.extent != "values"}


def split_from_sections(manifest: Manifest, sections: dict[str, torch.Tensor]) -> SplitArrays:
    inputs = inputs_from_manifest(manifest)
    return SplitArrays(
        features=sections[FEATURES],
        labels=sections[LABELS],
        inputs={
            name: _input_from(sections, name, bool(info.ragged_dtype))
            for name, info in inputs.items()
            if not in_numeric_block(info.kind)
        },
        weights=sections.get(WEIGHTS),
        numeric=tuple(block_names(inputs)),
    )


def manifest_codecs(dataset_dir: str | Path, manifest: Manifest) -> dict[str, Codec]:
    """A codec per input, fitted from the dataset's encoders.json (checked against the manifest)."""
    return codecs_for(inputs_from_manifest(manifest), read_encoders(dataset_dir, manifest))


def load_split(
    dataset_dir: str | Path,
    manifest: Manifest,
    split: str,
    read_rows: int = 16_384,
    codecs: dict[str, Codec] | None = None,
) -> SplitArrays:
    """The split in tensors allocated here, filled record batch by record batch (``fill_split``); the codecs
    (``codecs``, or the dataset's) are attached (``SplitArrays.with_codecs``)."""
    codecs = codecs if codecs is not None else manifest_codecs(dataset_dir, manifest)
    sections = empty_split(manifest, manifest.rows(split))
    values: dict[str, list[np.ndarray]] = {s.name: [] for s in split_layout(manifest) if s.extent == "values"}
    sinks = {name: got.append for name, got in values.items()}
    fill_split(dataset_dir, manifest, split, sections, read_rows, sinks, codecs)
    for section in split_layout(manifest):
        if section.extent == "values":
            dtype = np.dtype(str(section.dtype).removeprefix("torch."))
            sections[section.name] = torch.from_numpy(np.concatenate(values[section.name] or [np.empty(0, dtype)]))
    return split_from_sections(manifest, sections).with_codecs(codecs)


def fill_split(
    dataset_dir: str | Path,
    manifest: Manifest,
    split: str,
    sections: dict[str, torch.Tensor],
    read_rows: int = 16_384,
    ragged_values: dict[str, Callable[[np.ndarray], object]] | None = None,
    codecs: dict[str, Codec] | None = None,
) -> None:
    """Fill preallocated ``sections`` (tensors, or views of a mapped file) with the split, encoded and
    normalised, one record batch at a time: memory beyond the sections is one record batch.

    A ragged input's offsets are written into its section; its values, whose number only the encoding tells,
    go to ``ragged_values[<values section>]`` batch by batch, in row order (a list's append, a file's write)."""
    rows = manifest.rows(split)
    normaliser = Normaliser.from_manifest(manifest)
    codecs = codecs if codecs is not None else manifest_codecs(dataset_dir, manifest)
    others = [name for name, codec in codecs.items() if not in_numeric_block(codec.kind) and not codec.ragged_dtype]
    ragged = {
        name: RaggedFill(name, codec.ragged_dtype, sections, ragged_values)
        for name, codec in codecs.items()
        if codec.ragged_dtype
    }
    columns = [*manifest.features, *others, *ragged, manifest.label, *([manifest.weight] if manifest.weight else [])]
    offset = 0
    for shard, path in zip(manifest.splits[split].shards, manifest.shard_locations(dataset_dir, split)):
        start = offset
        for batch in _record_batches(path, columns, read_rows):
            stop = offset + batch.num_rows
            if stop > rows:
                raise ShardError(f"{path}: the {split} split holds more rows than the manifest's {rows}")
            # Written through numpy views of the preallocated tensors: no temporaries, dtype cast on copy.
            block = sections[FEATURES][offset:stop].numpy()
            fill_numeric(block, batch, manifest.features, codecs)
            for name in others:
                sections[INPUT_PREFIX + name][offset:stop].numpy()[:] = _encoded(codecs[name], batch, name, path)
            for name, fill in ragged.items():
                fill.add(offset, _encoded_ragged(codecs[name], batch, name, path))
            fill_labels(sections[LABELS][offset:stop].numpy(), batch.column(manifest.label), manifest.task)
            if manifest.weight:
                sections[WEIGHTS][offset:stop].numpy()[:] = values_of(batch.column(manifest.weight))
            normaliser.features_(sections[FEATURES][offset:stop])
            normaliser.target_(sections[LABELS][offset:stop])
            offset = stop
        # Hand the shard's decode buffers back now: the allocator would keep them resident,
        # and the split's peak memory would grow by a shard's worth on top of the tensors.
        pa.default_memory_pool().release_unused()
        if offset - start != shard.rows:
            raise ShardError(f"{path}: holds {offset - start} rows, the manifest says {shard.rows}")
    if offset != rows:
        raise ShardError(f"{dataset_dir}: the {split} split's shards hold {offset} rows, the manifest says {rows}")


def fill_numeric(block: np.ndarray, batch: pa.RecordBatch, features: Sequence[str], codecs: dict[str, Codec]) -> None:
    """The numeric block's rows: each numeric input's values (a null as its imputed value, through its codec),
    then the 0/1 missing indicator of each input that has one (training/kinds/inputs.py: ``block_names``)."""
    indicators = [name for name in features if getattr(codecs[name], "indicator", False)]
    for j, name in enumerate(features):
        column = batch.column(name)
        block[:, j] = codecs[name].encode(column) if column.null_count else values_of(column)
    for k, name in enumerate(indicators, len(features)):
        block[:, k] = codecs[name].missing(batch.column(name))


def values_of(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A column's values as a numpy array: a zero-copy DLPack view of a null-free array of integers or floats,
    else pyarrow's ``to_numpy``. Why: ``to_numpy`` imports pandas (about 0.5 s and 30 MB in a process that has
    not), and the node cache's build reads every numeric column through here."""
    numbers = pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
    if isinstance(column, pa.Array) and numbers and column.null_count == 0:
        return np.from_dlpack(column)
    return column.to_numpy(zero_copy_only=False)


def fill_labels(block, column: pa.Array, task: str) -> None:
    """Class indices or values as they are; a multilabel row's class-index list as a multi-hot row."""
    if task != "multilabel":
        block[:] = values_of(column)
        return
    block[:] = 0
    parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
    block[parents, pc.list_flatten(column).to_numpy(zero_copy_only=False)] = 1


def _encoded(codec: Codec, batch: pa.RecordBatch, name: str, path: Path):
    try:
        return codec.encode(batch.column(name))
    except ValueError as error:
        raise ShardError(f"{path}: {error}") from None


def _encoded_ragged(codec: Codec, batch: pa.RecordBatch, name: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        return codec.encode_ragged(batch.column(name))
    except ValueError as error:
        raise ShardError(f"{path}: {error}") from None


class RaggedFill:
    """One ragged input's part of ``fill_split``: offsets into the section, values to their sink, in row order."""

    def __init__(self, name: str, dtype: str, sections: dict[str, torch.Tensor], sinks: dict | None):
        values, self.dtype = INPUT_PREFIX + name + VALUES, np.dtype(dtype)
        if sinks is None or values not in sinks:
            raise ValueError(f"input {name!r} is ragged: fill_split needs a sink for {values}")
        self.offsets, self.sink, self.total = sections[INPUT_PREFIX + name + OFFSETS].numpy(), sinks[values], 0
        self.offsets[0] = 0

    def add(self, first_row: int, encoded: tuple[np.ndarray, np.ndarray]) -> None:
        values, lengths = encoded
        if int(lengths.sum()) != len(values):
            raise ValueError(f"encode_ragged returned {len(values)} values for lengths summing to {lengths.sum()}")
        self.offsets[first_row + 1 : first_row + 1 + len(lengths)] = self.total + np.cumsum(lengths)
        self.total += len(values)
        self.sink(np.ascontiguousarray(values, dtype=self.dtype))


def _record_batches(path: str, columns: list[str], read_rows: int):
    try:
        if is_url(path):  # where the dataset lives (training/core/location.py): read through fsspec
            fs, remote = filesystem(path)
            parquet = pq.ParquetFile(fs.open(remote, "rb"))
        else:
            # memory_map: the shard's column chunks are read from its pages, not copied into the heap, so the
            # node-cache builder's anon peak is about one row group, not one shard (docs/benchmarks.md).
            parquet = pq.ParquetFile(path, memory_map=True)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard listed in the manifest does not exist") from None
    present = set(parquet.schema_arrow.names)
    missing = [name for name in columns if name not in present]
    if missing:
        raise ShardError(f"{path}: lacks columns {missing}")
    return parquet.iter_batches(batch_size=read_rows, columns=columns)


class BatchRequest(NamedTuple):
    """What the sampler hands the dataset per batch: the rows and the epoch (so persistent workers know it)."""

    rows: torch.Tensor  # int64 [B]
    epoch: int


class InMemoryDataset(Dataset):
    """Map-style dataset over in-memory sections, indexed by a whole batch of row numbers at once.

    Returns (rows, the gathered row sections, the ragged inputs' collated entries): in the DataLoader's worker
    processes when it has any, which is where an image is decoded."""

    def __init__(self, split: SplitArrays, seed: int = 0):
        self.split, self.seed = split, seed

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, request: BatchRequest | torch.Tensor):
        rows, epoch = (request, 0) if isinstance(request, torch.Tensor) else request
        # One gather per section for the whole batch (index_select: ~3x faster than x[rows] on CPU), where the
        # split lives: on the device (train.data_on_device) only the row numbers cross over; on the CPU .to is a no-op.
        where = rows.to(self.split.labels.device, non_blocking=True)
        # The row weights are not gathered here: TrainBatches weighs each batch from its own row weights.
        sections = {name: tensor for name, tensor in self.split.row_sections().items() if name != WEIGHTS}
        gathered = {name: tensor.index_select(0, where) for name, tensor in sections.items()}
        collated = self.split.collate_rows(rows, BatchContext(rows, epoch, self.seed, train=True))
        return rows, gathered, collated

    def __getitems__(self, rows: Sequence[int]):
        return self[torch.as_tensor(rows, dtype=torch.int64)]


class RankSampler(DistributedSampler):
    """``DistributedSampler`` (shuffle, seed, ``set_epoch``, padding: unchanged) whose epoch
    order is also available as ONE tensor, so no Python list of every row is built."""

    def rank_indices(self) -> torch.Tensor:
        """This rank's rows of the epoch (int64), positions r, r + W, ... of the padded permutation.

        Memory is the point: every rank draws the whole n-row permutation each epoch, so it is drawn as int32
        (the same values as int64: torch's CPU randperm does not depend on the dtype; the test compares), the
        padded permutation is never built, and only this rank's n/W rows outlive the call. Peak: 8 bytes a row
        per rank, then 8/W kept (a padded copy of an int64 permutation would take 24, then 8)."""
        # DistributedSampler pads with the permutation's first entries, again and again if it is shorter than
        # the padding: padded position p >= n holds order[p % n].
        rows = len(self.dataset)
        small = torch.int32 if self.total_size < 2**31 else torch.int64
        positions = torch.arange(self.rank, self.total_size, self.num_replicas, dtype=small).remainder_(rows)
        mine = self._permutation(small).index_select(0, positions)
        del positions  # and the permutation: only this rank's rows are kept, as the loader's int64
        return mine.long()

    def epoch_order(self) -> torch.Tensor:
        """The epoch's padded permutation, the same on every rank: rank r takes positions r, r + W, ..."""
        order = self._permutation()
        padding = self.total_size - len(order)
        if padding > 0 and not self.drop_last:
            order = torch.cat([order, order.repeat(math.ceil(padding / len(order)))[:padding]])
        return order

    def _permutation(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        # The same steps as DistributedSampler.__iter__ (tests/training/loading/test_loading.py checks it).
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        rows = len(self.dataset)
        return (
            torch.randperm(rows, generator=generator, dtype=dtype) if self.shuffle else torch.arange(rows, dtype=dtype)
        )


def global_rows_in_steps(n_rows: int, world_size: int, batch_size: int, start: int, stop: int) -> int:
    """Real (unpadded) rows that ALL ranks together train in steps ``[start, stop)`` of an epoch.

    ``DistributedSampler(drop_last=False)`` pads the permutation to
    ``W * ceil(n / W)`` entries and gives rank r positions ``r, r + W, ...``, so
    step s of every rank together covers the contiguous padded positions
    ``[s*b*W, min((s+1)*b, ceil(n/W)) * W)``; the real ones are those below n.
    Every rank computes the same number, with no collective.
    """
    first, last = global_positions_of_steps(n_rows, world_size, batch_size, start, stop)
    return last - first


def global_positions_of_steps(n_rows: int, world_size: int, batch_size: int, start: int, stop: int) -> tuple[int, int]:
    """The real positions ``[first, last)`` of the epoch's padded permutation that steps ``[start, stop)`` of
    all ranks train (``global_rows_in_steps``' rule; the rows there are ``epoch_order()[first:last]``)."""
    per_rank = math.ceil(n_rows / world_size)  # DistributedSampler.num_samples
    first = min(start * batch_size, per_rank) * world_size
    last = min(stop * batch_size, per_rank) * world_size
    return min(first, n_rows), max(min(first, n_rows), min(last, n_rows))


class BatchSlices(Sampler):
    """Consecutive slices of this rank's epoch order: one index tensor per batch (the last may be short).

    ``start``: the first batch to yield (a resumed pass): the batches before it are never sliced, so their
    rows are not read. ``reorder``: a test hook's view of the rank's epoch order (``TrainHooks.epoch_rows``)."""

    def __init__(self, sampler: RankSampler, batch_size: int, reorder=None):
        self.sampler, self.batch_size, self.start = sampler, batch_size, 0
        self.reorder = reorder or (lambda epoch, rows: rows)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[BatchRequest]:
        epoch = self.sampler.epoch
        rows = self.reorder(epoch, self.sampler.rank_indices())
        return (BatchRequest(batch, epoch) for batch in rows[self.start * self.batch_size :].split(self.batch_size))


def _batch_as_is(batch):
    # The dataset already returns the stacked batch; nothing to collate.
    return batch


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor  # CPU, the dataset rows this rank trains on (padding excluded)
    features: torch.Tensor  # on the device: the numeric block [B, F] (``inputs`` holds views of its columns)
    labels: torch.Tensor  # on the device
    # On the device [B] float32: the row's weight (data.weight times its class weight, 1 without either)
    # times 1 for a real row, 0 for sampler padding; None when every row weighs 1.
    weights: torch.Tensor | None
    samples: int  # real rows in the batch
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's batch dict, on the device


def device_batch(
    split: SplitArrays,
    indices: torch.Tensor,
    sections: dict[str, torch.Tensor],
    collated: dict[str, torch.Tensor],
    real: torch.Tensor | None,
    weights: torch.Tensor | None,
    device: torch.device,
) -> Batch:
    """A micro-batch on the device from its gathered row ``sections`` and collated ragged entries: ``indices``
    its rows' ids, ``real`` the mask of its unpadded rows (None: all real), ``weights`` already on the device."""
    ragged = set(split.ragged_names())
    on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in sections.items()}
    features = on_device[FEATURES]
    others = {name: on_device[INPUT_PREFIX + name] for name in split.inputs if name not in ragged}
    others |= {name: tensor.to(device, non_blocking=True) for name, tensor in collated.items()}
    return Batch(
        indices=indices if real is None else indices[real],
        features=features,
        labels=on_device[LABELS],
        weights=weights,
        samples=len(indices) if real is None else int(real.sum()),
        inputs=split.batch_inputs(features, others),
    )


def combined_row_weights(data_weights: torch.Tensor | None, class_weights: torch.Tensor | None) -> torch.Tensor | None:
    """w_i = data.weight_i x class weight_i, on the CPU ([rows] float32); None when every row weighs 1.

    With only a data.weight column the node cache's mapped section is used as it is (no private copy)."""
    present = [w.to("cpu", torch.float32) for w in (data_weights, class_weights) if w is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else present[0] * present[1]


class TrainBatches:
    """One rank's training batches, epoch by epoch.

    ``DistributedSampler`` with ``drop_last=False`` pads the permutation so that
    every rank gets the same number of rows (and so of steps, which DDP needs).
    The padded entries are rows at padded-permutation positions >= ``n_rows``;
    they get weight 0 so every row counts exactly once per epoch.
    """

    def __init__(
        self,
        split: SplitArrays,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        pin_memory: bool,
        row_weights: torch.Tensor | None = None,
        num_workers: int = 0,
        reorder=None,
    ):
        self.dataset = InMemoryDataset(split, seed)
        # Each train row's loss weight ([rows] float32; None: all 1): its data.weight times its class weight
        # (``row_weights``, from train.class_weights); the one place both come in.
        self.row_weights = combined_row_weights(split.weights, row_weights)
        self._weight_before: torch.Tensor | None = None  # this epoch: weight of padded positions [0, p), float64
        self.rank, self.world_size, self.batch_size, self.device = rank, world_size, batch_size, device
        self.sampler = RankSampler(
            self.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        self.slices = BatchSlices(self.sampler, batch_size, reorder)
        self.loader = DataLoader(
            self.dataset,
            batch_size=None,  # the sampler yields whole batches of row numbers
            sampler=self.slices,
            collate_fn=_batch_as_is,
            # train.num_workers: 0 gathers in the rank itself (in-memory sections need no workers); more decode
            # ragged inputs (images) in that many processes, kept for the run and a batch ahead each.
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=pin_memory and device.type == "cuda" and split.labels.device.type == "cpu",
        )
        self.padded = len(split) % world_size != 0

    def __len__(self) -> int:
        return len(self.loader)

    def global_rows(self, start: int, stop: int) -> int:
        """Real rows of steps ``[start, stop)`` summed over all ranks (``global_rows_in_steps``)."""
        return global_rows_in_steps(len(self.dataset), self.world_size, self.batch_size, start, stop)

    def global_weight(self, start: int, stop: int) -> float:
        """The weight Σ w_i of the real rows of steps ``[start, stop)`` on all ranks: the exact update's divisor
        (training/loop/step.py). Every rank computes it from the epoch's permutation, which all ranks share, with no
        collective; ``global_rows`` when every row weighs 1."""
        if self._weight_before is None:
            return float(self.global_rows(start, stop))
        first, last = global_positions_of_steps(len(self.dataset), self.world_size, self.batch_size, start, stop)
        return float(self._weight_before[last] - self._weight_before[first])

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of steps ``start, start + 1, ...`` of ``epoch``: a resumed pass starts at ``start``
        without reading the batches before it (``BatchSlices.start``)."""
        self.sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
        self.slices.start = start
        rng_state = torch.get_rng_state()
        if self.row_weights is not None:
            order = self.sampler.epoch_order()[: len(self.dataset)]  # the real positions
            in_order = self.row_weights.index_select(0, order).double()
            self._weight_before = torch.cat([torch.zeros(1, dtype=torch.float64), in_order.cumsum(0)])
        split = self.dataset.split
        batches = iter(self.loader)
        if start:
            # The loader's iterator draws its base seed from the global RNG (unused with no workers). The
            # uninterrupted pass drew it before step 0, and a step checkpoint's RNG state is after that draw:
            # a resumed pass must not draw it again, or the model's random draws (dropout) would shift by one.
            torch.set_rng_state(rng_state)
        for step, (indices, sections, collated) in enumerate(batches, start):
            real = self._real_rows(step, len(indices))
            yield device_batch(split, indices, sections, collated, real, self._weights(indices, real), self.device)

    def _weights(self, indices: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor | None:
        """The batch's row weights times its padding mask (None: every row weighs 1)."""
        if self.row_weights is None:
            return None if real is None else real.to(self.device, torch.float32, non_blocking=True)
        weights = self.row_weights.index_select(0, indices)
        if real is not None:
            weights = weights * real
        return weights.to(self.device, non_blocking=True)

    def _real_rows(self, step: int, size: int) -> torch.Tensor | None:
        if not self.padded:
            return None
        # DistributedSampler: rank r's j-th row is padded-permutation position r + j * W.
        first = step * self.batch_size
        positions = self.rank + self.world_size * torch.arange(first, first + size)
        return positions < len(self.dataset)
