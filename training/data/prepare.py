"""Prepare stage: raw tabular data -> ``<data.root>/<fingerprint>/{train,val,test}/part-NNNNN.parquet`` + manifest.

    prepared = prepare_dataset(config.data)
    prepared.dataset_dir, prepared.manifest, prepared.cache_hit

Two streaming passes over the source, never holding it whole:
1. the label column only: validates the schema and columns early, counts
   invalid labels and collects the classes (indices need all of them first);
2. all used columns, batch by batch: validity, split by row hash, float32
   features, class indices, train statistics (mean, std, per-feature
   histogram), shard writing.

The result is built in a temp dir and published by an atomic rename, with
``manifest.json`` written last inside it (see ``publish.py``). When the
fingerprint's directory already has a manifest, it is reused (``cache_hit``).
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.config import DataConfig
from training.data import split as row_split
from training.data.columns import ColumnPlan, plan_columns, value_type
from training.data.errors import DataError
from training.data.fingerprint import dataset_fingerprint
from training.data.manifest import Manifest, SplitInfo, read_manifest, write_manifest
from training.data.publish import discard, is_complete, make_temp_dir, publish, remove_stale_temp_dirs
from training.data.shards import SplitWriter
from training.data.sources import Source, open_source, source_identity
from training.data.stats import ClassCounts, RunningHistogram, RunningMoments
from training.layout import SPLITS

__all__ = ["DataError", "PreparedDataset", "prepare_dataset", "source_fingerprint"]

# More distinct label values than this is almost surely a regression target or an id.
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class PreparedDataset:
    dataset_dir: Path
    manifest: Manifest
    cache_hit: bool

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def summary(self) -> dict[str, Any]:
        manifest = self.manifest
        return {
            "fingerprint": manifest.fingerprint,
            "dataset_dir": str(self.dataset_dir),
            "cache_hit": self.cache_hit,
            "task": manifest.task,
            "n_features": manifest.n_features,
            "n_classes": len(manifest.label_mapping) if manifest.task == "classification" else None,
            "rows": {split: manifest.rows(split) for split in SPLITS},
            "dropped_rows": manifest.dropped_rows,
        }


def prepare_dataset(data: DataConfig) -> PreparedDataset:
    root = _output_root(data)
    # The output root may sit inside a source directory (data/ and data/shards): never read it back.
    source = open_source(data.source, data.format, exclude=root)
    fingerprint = dataset_fingerprint(source.identity(), data)
    target = root / fingerprint
    if is_complete(target):
        manifest = _intact_manifest(target)
        if manifest is not None:
            return PreparedDataset(target, manifest, cache_hit=True)
        discard(target)  # damaged since it was published: rebuild it
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    temp = make_temp_dir(root, fingerprint)
    try:
        manifest = _build(source, data, fingerprint, temp)
        _check_unchanged(source)
        write_manifest(temp, manifest)
        published = publish(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # a failed build leaves nothing behind
        raise
    # Lost the race: another process published the same fingerprint; use its copy.
    return PreparedDataset(target, manifest if published else read_manifest(target), cache_hit=False)


def source_fingerprint(data: DataConfig) -> tuple[dict[str, Any], str]:
    """(the source's identity, the fingerprint ``prepare_dataset(data)`` would give it now), from a listing alone.

    No file is opened: cheap enough to poll (flows/watch_data.py). Equal to the prepared
    dataset's fingerprint while the source's files keep their names, sizes and versions.
    """
    identity = source_identity(data.source, data.format, exclude=_output_root(data))
    return identity, dataset_fingerprint(identity, data)


def _output_root(data: DataConfig) -> Path:
    return Path(data.root).expanduser().resolve()


def _check_unchanged(source: Source) -> None:
    """The fingerprint names the files as they were when prepare began: refuse to publish a mix."""
    changed = source.changed_files()
    if changed:
        raise DataError(
            f"{changed[0]}: changed while it was being prepared ({len(changed)} file(s) changed); run prepare again"
        )


def _intact_manifest(dataset_dir: Path) -> Manifest | None:
    """The manifest when it parses and every shard it lists is there with its size; else None."""
    try:
        manifest = read_manifest(dataset_dir)
    except (ValueError, KeyError, TypeError):
        return None
    for split in manifest.splits.values():
        for shard in split.shards:
            path = dataset_dir / shard.file
            if not path.is_file() or path.stat().st_size != shard.bytes:
                return None
    return manifest


# ---------------------------------------------------------------- pass 1: labels


@dataclass
class LabelScan:
    rows: int = 0
    nulls: int = 0
    non_finite: int = 0
    first_invalid_file: str | None = None
    classes: pa.Array | None = None  # sorted distinct valid labels (classification)


def _scan_labels(source: Source, plan: ColumnPlan, batch_rows: int) -> LabelScan:
    scan = LabelScan()
    distinct: list[pa.Array] = []
    for file, batch in source.iter_batches([plan.label], batch_rows):
        labels = _plain(batch.column(0))
        nulls, non_finite = labels.null_count, _count_non_finite(labels)
        scan.rows += len(labels)
        scan.nulls += nulls
        scan.non_finite += non_finite
        if (nulls or non_finite) and scan.first_invalid_file is None:
            scan.first_invalid_file = file
        if plan.task == "classification":
            distinct.append(pc.unique(labels.drop_null()))
            if len(distinct) > 64:  # keep the pending set small however many batches
                distinct = [pc.unique(pa.concat_arrays(distinct))]
                _check_class_count(len(distinct[0]), plan, source)
    if plan.task == "classification":
        values = pc.unique(pa.concat_arrays(distinct)) if distinct else pa.array([], type=pa.int64())
        if pa.types.is_floating(values.type):
            values = values.filter(pc.is_finite(values))
        _check_class_count(len(values), plan, source)
        scan.classes = values.take(pc.sort_indices(values))
    return scan


def _check_class_count(count: int, plan: ColumnPlan, source: Source) -> None:
    if count > MAX_CLASSES:
        raise DataError(
            f"{source.description}: label column {plan.label!r} has more than {MAX_CLASSES} distinct values; "
            "set data.task=regression if it is a number to predict"
        )


def _plain(array: pa.Array) -> pa.Array:
    """Dictionary (categorical) columns as their plain values; string views as strings (sortable)."""
    if pa.types.is_dictionary(array.type):
        array = pc.cast(array, value_type(array.type))
    if pa.types.is_string_view(array.type):
        array = pc.cast(array, pa.string())
    return array


def _count_non_finite(array: pa.Array) -> int:
    if not pa.types.is_floating(array.type):
        return 0
    return len(array) - array.null_count - pc.sum(pc.is_finite(array)).as_py()


def _check_labels(scan: LabelScan, plan: ColumnPlan, data: DataConfig, source: Source) -> None:
    where = source.description
    if scan.rows == 0:
        raise DataError(f"{where}: the source has no rows")
    invalid = scan.nulls + scan.non_finite
    if invalid and data.on_invalid == "error":
        raise DataError(
            f"{scan.first_invalid_file}: label column {plan.label!r} has {scan.nulls} null and {scan.non_finite} "
            f"NaN/inf values (first in this file); fix the data or set data.on_invalid=drop"
        )
    if invalid == scan.rows:
        raise DataError(f"{where}: every row's label {plan.label!r} is null, NaN or inf")
    if plan.task == "classification" and len(scan.classes) < 2:
        raise DataError(
            f"{where}: label column {plan.label!r} holds a single class ({scan.classes.to_pylist()[0]!r}); "
            "classification needs at least two"
        )


# ---------------------------------------------------------------- pass 2: rows


@dataclass
class InvalidRows:
    """Rows with a null/NaN/inf value, counted per column, and the first file holding one."""

    per_column: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    first_file: str | None = None

    def add(self, file: str, column_counts: dict[str, int], rows: int) -> None:
        if not rows:
            return
        self.rows += rows
        self.first_file = self.first_file or file
        for column, count in column_counts.items():
            if count:
                self.per_column[column] = self.per_column.get(column, 0) + count

    def error(self, where: str) -> DataError:
        counts = ", ".join(f"column {column!r}: {count}" for column, count in self.per_column.items())
        return DataError(
            f"{self.first_file or where}: {self.rows} rows hold null, NaN or inf values ({counts}); "
            "fix the data or set data.on_invalid=drop to drop them"
        )


def _build(source: Source, data: DataConfig, fingerprint: str, out_dir: Path) -> Manifest:
    plan = plan_columns(source.schema, data, source.description)
    labels = _scan_labels(source, plan, data.read_batch_rows)
    _check_labels(labels, plan, data, source)
    schema = _shard_schema(plan, source.schema)
    writers = {name: SplitWriter(out_dir, name, schema, data.rows_per_shard, data.row_group_size) for name in SPLITS}
    moments = RunningMoments(len(plan.features))
    histograms = RunningHistogram(len(plan.features))  # what drift compares (ddpflow/drift.py)
    targets = RunningMoments(1) if plan.task == "regression" else None  # standardises the target in training
    class_counts = ClassCounts(len(labels.classes)) if plan.task == "classification" else None  # class weights
    invalid = InvalidRows()
    for file, batch in source.iter_batches(plan.columns, data.read_batch_rows):
        rows = _BatchRows(batch, plan, labels.classes)
        invalid.add(file, rows.invalid_counts(), rows.invalid_rows)
        if invalid.rows and data.on_invalid == "error":
            continue  # keep counting so the error reports every bad row, but write nothing more
        rows.keep_valid()
        codes = row_split.assign_splits(rows.hashes(), data.val_fraction, data.test_fraction)
        for code, name in enumerate(SPLITS):
            chosen = np.flatnonzero(codes == code)
            if name == "train":
                train_features = rows.features[:, chosen]  # a copy: taken once for both statistics
                moments.update(train_features)
                histograms.update(train_features)
                if targets is not None:
                    targets.update(rows.label.to_numpy(zero_copy_only=False)[chosen][None, :])
                if class_counts is not None:
                    class_counts.update(rows.label.to_numpy(zero_copy_only=False)[chosen])
            writers[name].add(rows.table(chosen, schema))
    if invalid.rows and data.on_invalid == "error":
        raise invalid.error(source.description)
    splits = {name: writer.close() for name, writer in writers.items()}
    _check_splits(splits, invalid.rows, labels.rows, data, source)
    manifest = _manifest(source, data, plan, labels, splits, moments, histograms, targets, invalid, fingerprint)
    return with_class_counts(manifest, class_counts)


def with_class_counts(manifest: Manifest, counts: ClassCounts | None) -> Manifest:
    """The manifest with the train split's class counts (classification), for ``train.class_weights``."""
    return dataclasses.replace(manifest, train_class_counts=counts.to_list() if counts is not None else None)


class _BatchRows:
    """One record batch as a (features x rows) float32 matrix, label values and key, with validity."""

    def __init__(self, batch: pa.RecordBatch, plan: ColumnPlan, classes: pa.Array | None):
        self.plan = plan
        self.features = _feature_matrix(batch, plan.features)
        self.raw_label = _plain(batch.column(plan.label))
        if plan.task == "classification":
            self.label = pc.index_in(self.raw_label, value_set=classes)  # null where the label is invalid
        else:
            self.label = pc.cast(self.raw_label, pa.float32())
        self.key = batch.column(plan.key) if plan.key else None
        self._feature_ok = np.isfinite(self.features)
        self._label_ok = _valid_mask(self.label)
        self._key_ok = _valid_mask(self.key) if self.key is not None else True
        self.valid = self._feature_ok.all(axis=0) & self._label_ok & self._key_ok

    @property
    def invalid_rows(self) -> int:
        return int(len(self.valid) - self.valid.sum())

    def invalid_counts(self) -> dict[str, int]:
        counts = dict(zip(self.plan.features, (~self._feature_ok).sum(axis=1).tolist()))
        counts[self.plan.label] = int((~self._label_ok).sum())
        if self.key is not None:
            counts[self.plan.key] = int((~self._key_ok).sum())
        return counts

    def keep_valid(self) -> None:
        if self.valid.all():
            return
        mask = pa.array(self.valid)
        self.features = self.features[:, self.valid]
        self.raw_label = self.raw_label.filter(mask)
        self.label = self.label.filter(mask)
        self.key = self.key.filter(mask) if self.key is not None else None

    def hashes(self) -> np.ndarray:
        """The split hash: the key when there is one, else the row's content (stored features + label)."""
        if self.key is not None:
            return row_split.hash_values(self.key)
        label_for_hash = self.raw_label if self.plan.task == "classification" else self.label
        return row_split.hash_rows(self.features.T, row_split.hash_values(label_for_hash))

    def table(self, rows: np.ndarray, schema: pa.Schema) -> pa.Table:
        indices = pa.array(rows, type=pa.int64())
        columns = [pa.array(self.features[i][rows]) for i in range(len(self.plan.features))]
        columns.append(pc.cast(self.label.take(indices), schema.field(self.plan.label).type))
        if self.key is not None:
            columns.append(self.key.take(indices))
        return pa.Table.from_arrays(columns, schema=schema)


def _feature_matrix(batch: pa.RecordBatch, features: list[str]) -> np.ndarray:
    """(features, rows) float32; null becomes NaN, values beyond float32 become inf (both invalid)."""
    matrix = np.empty((len(features), batch.num_rows), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i, name in enumerate(features):
            column = batch.column(name)
            if not pa.types.is_floating(column.type) or column.null_count:
                column = pc.fill_null(pc.cast(column, pa.float64()), np.nan)
            matrix[i] = column.to_numpy(zero_copy_only=False)
    return matrix


def _valid_mask(array: pa.Array) -> np.ndarray:
    valid = pc.is_valid(array)
    if pa.types.is_floating(array.type):
        valid = pc.and_(valid, pc.is_finite(array))
    return valid.to_numpy(zero_copy_only=False).astype(bool, copy=False)


def _shard_schema(plan: ColumnPlan, source_schema: pa.Schema) -> pa.Schema:
    fields = [pa.field(name, pa.float32()) for name in plan.features]
    fields.append(pa.field(plan.label, pa.int64() if plan.task == "classification" else pa.float32()))
    if plan.key:
        fields.append(pa.field(plan.key, value_type(source_schema.field(plan.key).type)))
    return pa.schema(fields)


def _check_splits(splits: dict[str, SplitInfo], dropped: int, total: int, data: DataConfig, source: Source) -> None:
    if sum(split.rows for split in splits.values()) == 0:
        raise DataError(f"{source.description}: all {total} rows were dropped as invalid (data.on_invalid=drop)")
    if splits["train"].rows == 0:
        raise DataError(
            f"{source.description}: the train split is empty ({total - dropped} valid rows, "
            f"val_fraction={data.val_fraction}, test_fraction={data.test_fraction}); add rows or lower the fractions"
        )


def _manifest(source, data, plan, labels, splits, moments, histograms, targets, invalid, fingerprint) -> Manifest:
    return Manifest(
        fingerprint=fingerprint,
        source=data.source,
        task=plan.task,
        label=plan.label,
        key=plan.key,
        features=plan.features,
        label_mapping=labels.classes.to_pylist() if plan.task == "classification" else None,
        feature_mean=moments.mean.tolist(),
        feature_std=moments.std().tolist(),
        splits=splits,
        schema=[{"name": name, "type": str(source.schema.field(name).type)} for name in plan.columns],
        config=data.model_dump(mode="json"),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        versions=_versions(),
        dropped_rows=invalid.rows,
        label_mean=float(targets.mean[0]) if targets is not None else None,
        label_std=float(targets.std()[0]) if targets is not None else None,
        feature_histograms=histograms.to_list(),
        extra={
            "source_identity": source.identity(),
            "source_rows": labels.rows,
            "invalid_per_column": invalid.per_column,
        },
    )


def _versions() -> dict[str, str]:
    import pandas

    return {
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "pandas": pandas.__version__,
        "ddpflow": _ddpflow_version(),
    }


def _ddpflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpflow")
    except PackageNotFoundError:
        return "0+unknown"
