"""Prepare stage: raw tabular data -> ``<data.root>/<fingerprint>/{train,val,test}/part-NNNNN.parquet`` + manifest.

    prepared = prepare_dataset(config.data)
    prepared.dataset_dir, prepared.manifest, prepared.cache_hit

Two streaming passes over the source, never holding it whole:
1. the label column only: validates the schema and columns early, counts
   invalid labels and collects the classes (indices need all of them first);
2. all used columns, batch by batch: validity, split by row hash (or by time:
   ``time_split.py``, whose fractions read the time column once more before
   this pass), float32 features, class indices, train statistics (mean, std,
   per-feature histogram), shard writing.

The result is built in a temp dir and published by an atomic rename, with
``manifest.json`` written last inside it (see ``publish.py``); to a ``data.root``
that is an fsspec URL (s3://...), it is built in a local temp dir and uploaded,
``manifest.json`` last. When the fingerprint's directory already has a manifest,
it is reused (``cache_hit``).
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.core.config import DataConfig
from training.core.errors import DataError
from training.core.fileio import atomic_write_text
from training.core.layout import MANIFEST, SPLITS
from training.core.location import exists, is_url, join
from training.core.manifest import CLASS_TASKS, Manifest, SplitInfo, read_manifest, write_manifest
from training.kinds.arrow_types import value_type
from training.kinds.base import Codec, plain
from training.kinds.hashing import hash_values
from training.kinds.registry import ENCODERS_FILE, encoder_states, encoders_sha256, encoders_text, make_codec
from training.kinds.stats import ClassCounts, RunningHistogram, RunningMoments
from training.prepare import split as row_split
from training.prepare.columns import (
    INTEGER_CLASSES_MAX,
    ColumnPlan,
    describe_task,
    infer_task,
    integer_label_task,
    is_integer_label,
    left_out_columns,
    plan_columns,
)
from training.prepare.fingerprint import dataset_fingerprint
from training.prepare.image_folder import with_image_folder_defaults
from training.prepare.publish import (
    discard,
    is_complete,
    make_temp_dir,
    object_sizes,
    publish,
    remove_stale_temp_dirs,
    upload,
)
from training.prepare.shards import SplitWriter
from training.prepare.sources import Source, open_source, source_identity
from training.prepare.time_split import TimeSplit, plan_time_split, splits_by_time

__all__ = ["DataError", "PreparedDataset", "prepare_dataset", "fingerprint_from_listing"]

# More distinct label values than this is almost surely a regression target or an id.
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class PreparedDataset:
    dataset_dir: Path | str  # a local directory, or a URL when data.root is one (s3://bucket/shards/<fingerprint>)
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
            "task_inferred": manifest.extra.get("task_inferred"),
            "n_features": manifest.n_features,
            "inputs": {entry["name"]: entry["kind"] for entry in manifest.inputs or []},
            "left_out": manifest.extra.get("left_out", []),
            "warnings": manifest.extra.get("warnings", []),
            "null_rates": manifest.extra.get("null_rates", {}),
            **({"split": manifest.extra["split"]} if "split" in manifest.extra else {}),  # a time split's cut-offs
            "n_classes": len(manifest.label_mapping) if manifest.task in CLASS_TASKS else None,
            "rows": {split: manifest.rows(split) for split in SPLITS},
            "dropped_rows": manifest.dropped_rows,
        }


def prepare_dataset(data: DataConfig) -> PreparedDataset:
    if is_url(data.root):
        return _prepare_to_url(data)
    root = _output_root(data)
    # The output root may sit inside a source directory (data/ and data/shards): never read it back.
    source, data, task_line, fingerprint = _plan(data, exclude=root)
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
        manifest = _build(source, data, fingerprint, temp, task_line)
        _check_unchanged(source)
        write_manifest(temp, manifest)
        published = publish(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # a failed build leaves nothing behind
        raise
    # Lost the race: another process published the same fingerprint; use its copy.
    return PreparedDataset(target, manifest if published else read_manifest(target), cache_hit=False)


def _plan(data: DataConfig, exclude: Path | None) -> tuple[Source, DataConfig, str | None, str]:
    """(the source, the data config with its defaults and task decided, the prepare log's task line, the
    fingerprint)."""
    source = open_source(data.source, data.format, exclude=exclude)
    data = with_image_folder_defaults(data, source.identity())
    data, task_line = _with_inferred_task(source, data)
    return source, data, task_line, dataset_fingerprint(source.identity(), data)


def _prepare_to_url(data: DataConfig) -> PreparedDataset:
    """``data.root`` an fsspec URL (s3://bucket/shards): built in a local temp dir (under ``data.cache_dir`` when
    set: room for the dataset once), then uploaded with manifest.json last (``publish.py: upload``)."""
    source, data, task_line, fingerprint = _plan(data, exclude=None)
    target = join(data.root, fingerprint)
    manifest = _intact_uploaded(target)
    if manifest is not None:
        return PreparedDataset(target, manifest, cache_hit=True)
    if data.cache_dir:
        Path(data.cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"ddpflow-prepare-{fingerprint}-", dir=data.cache_dir))
    try:
        manifest = _build(source, data, fingerprint, staging, task_line)
        _check_unchanged(source)
        write_manifest(staging, manifest)
        try:
            upload(staging, target)
        except OSError as error:  # no such bucket, no permission: the user's root
            raise DataError(f"data.root {data.root!r}: cannot write the prepared dataset there: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PreparedDataset(target, manifest, cache_hit=False)


def _intact_uploaded(target: str) -> Manifest | None:
    """The manifest at ``target`` (a URL) when it is there and every shard it lists has its size; else None."""
    if not exists(join(target, MANIFEST)):
        return None
    try:
        manifest = read_manifest(target)
    except (ValueError, KeyError, TypeError):
        return None
    sizes = object_sizes(target)
    complete = all(sizes.get(shard.file) == shard.bytes for split in manifest.splits.values() for shard in split.shards)
    return manifest if complete else None


def fingerprint_from_listing(data: DataConfig) -> tuple[dict[str, Any], str]:
    """(the source's identity, the fingerprint ``prepare_dataset(data)`` would give it now), from a listing alone.

    No file is opened: cheap enough to poll (flows/watch_data.py). Equal to the prepared
    dataset's fingerprint while the source's files keep their names, sizes and versions.
    """
    identity = source_identity(data.source, data.format, exclude=None if is_url(data.root) else _output_root(data))
    return identity, dataset_fingerprint(identity, with_image_folder_defaults(data, identity))


def _with_inferred_task(source: Source, data: DataConfig) -> tuple[DataConfig, str | None]:
    """(``data`` with ``data.task: regression`` where an integer label holds more than INTEGER_CLASSES_MAX
    distinct values, the prepare log's line on the task). Decided before the fingerprint, so such a dataset is
    the one ``data.task: regression`` prepares; an integer label read as classes keeps its fingerprint (its task
    is what it was). A label column not in the source: (data, None), and the column check names it."""
    if data.label not in source.schema.names:
        return data, None
    kind = source.schema.field(data.label).type
    if data.task is not None or not is_integer_label(kind):
        task = data.task or (infer_task(kind, data.label, source.description) if not pa.types.is_null(kind) else None)
        return data, (describe_task(task, kind, data.label, None, data.task is not None) if task else None)
    distinct = _distinct_labels(source, data.label, data.read_batch_rows, INTEGER_CLASSES_MAX)
    task = integer_label_task(distinct)
    line = describe_task(task, kind, data.label, distinct, given=False)
    return (data.model_copy(update={"task": "regression"}) if task == "regression" else data), line


def _distinct_labels(source: Source, label: str, batch_rows: int, above: int) -> int:
    """The label's distinct non-null values, counted until there are more than ``above`` (then that count)."""
    seen = None
    for _file, batch in source.iter_batches([label], batch_rows):
        values = pc.unique(_plain(batch.column(0)).drop_null())
        seen = values if seen is None else pc.unique(pa.concat_arrays([seen, values.cast(seen.type)]))
        if len(seen) > above:
            break
    return 0 if seen is None else len(seen)


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
        if plan.task == "multilabel":  # the classes are the lists' values; a null list or value is invalid
            labels = _plain(pc.list_flatten(labels))
            nulls += labels.null_count
        scan.rows += len(labels)
        scan.nulls += nulls
        scan.non_finite += non_finite
        if (nulls or non_finite) and scan.first_invalid_file is None:
            scan.first_invalid_file = file
        if plan.task in CLASS_TASKS:
            distinct.append(pc.unique(labels.drop_null()))
            if len(distinct) > 64:  # keep the pending set small however many batches
                distinct = [pc.unique(pa.concat_arrays(distinct))]
                _check_class_count(len(distinct[0]), plan, source)
    if plan.task in CLASS_TASKS:
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
    if plan.task in CLASS_TASKS and len(scan.classes) < 2:
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
            f"{self.first_file or where}: {self.rows} rows hold invalid values ({counts}): inf, or null/NaN in a "
            "label or a {kind: numeric, missing: error} input; fix the data or set data.on_invalid=drop to drop them"
        )


def _build(source: Source, data: DataConfig, fingerprint: str, out_dir: Path, task_line: str | None) -> Manifest:
    plan = plan_columns(source.schema, data, source.description)
    labels = _scan_labels(source, plan, data.read_batch_rows)
    _check_labels(labels, plan, data, source)
    left_out = _left_out(source, plan, data)
    codecs = {name: make_codec(name, kind, options) for name, (kind, options) in plan.inputs.items()}
    schema = _shard_schema(plan, source.schema, codecs)
    writers = {name: SplitWriter(out_dir, name, schema, data.rows_per_shard, data.row_group_size) for name in SPLITS}
    moments = RunningMoments(len(plan.features))
    histograms = RunningHistogram(len(plan.features))  # what drift compares (ddpflow/drift/report.py)
    targets = RunningMoments(1) if plan.task == "regression" else None  # standardises the target in training
    class_counts = ClassCounts(len(labels.classes)) if plan.task == "classification" else None  # class weights
    invalid = InvalidRows()
    checks = _ColumnChecks(plan)
    drift_stats = _DriftStats(plan, codecs, labels.classes)
    by_time = plan_time_split(source, data) if splits_by_time(data) else None  # else the hash split
    columns = [*plan.columns, *([by_time.column] if by_time and by_time.column not in plan.columns else [])]
    for file, batch in source.iter_batches(columns, data.read_batch_rows):
        rows = _BatchRows(batch, plan, labels.classes, codecs, file)
        if rows.wrong_lengths and data.on_invalid == "error":
            raise rows.wrong_lengths[0]
        invalid.add(file, rows.invalid_counts(), rows.invalid_rows)
        if invalid.rows and data.on_invalid == "error":
            continue  # keep counting so the error reports every bad row, but write nothing more
        times = by_time.codes(file, batch.column(by_time.column)) if by_time else None
        rows.keep_valid()
        checks.update(rows)
        if by_time is None:
            codes = row_split.assign_splits(rows.hashes(), data.val_fraction, data.test_fraction)
        else:
            codes = times[rows.valid]
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
                rows.observe(chosen)
                drift_stats.update(rows, chosen)
            writers[name].add(rows.table(chosen, schema))
    if invalid.rows and data.on_invalid == "error":
        raise invalid.error(source.description)
    splits = {name: writer.close() for name, writer in writers.items()}
    _check_splits(splits, invalid.rows, labels.rows, data, source, by_time)
    checks.check_weights(source, sum(split.rows for split in splits.values()))
    _fit_train_columns(out_dir, splits["train"], codecs, by_time.column if by_time else None)
    encoders = _write_encoders(out_dir, codecs)
    manifest = _manifest(source, data, plan, labels, splits, moments, histograms, targets, invalid, fingerprint)
    numeric = [codecs[name] for name in plan.features]
    indicators = sum(codec.indicator for codec in numeric)  # each a 0/1 column: center 0, scale 1, unclipped
    return dataclasses.replace(
        manifest,
        feature_mean=manifest.feature_mean + [0.0] * indicators,
        feature_std=manifest.feature_std + [1.0] * indicators,
        feature_center=[codec.center for codec in numeric] + [0.0] * indicators,
        feature_scale=[codec.scale for codec in numeric] + [1.0] * indicators,
        feature_clip=[codec.clip for codec in numeric] + [False] * indicators,
        inputs=[codec.info().to_dict() for codec in codecs.values()],
        encoders=encoders,
        weight=plan.weight,
        train_class_counts=class_counts.to_list() if class_counts is not None else None,  # class weights
        extra={
            **manifest.extra,
            "left_out": left_out,
            "task_inferred": task_line,  # how the task was decided (the prepare log)
            "warnings": checks.warnings(),
            "drift_stats": drift_stats.to_dict(),
            # The train split's share of null/NaN values per numeric input (those with any): imputed, indicated.
            "null_rates": {name: codecs[name].null_rate() for name in plan.features if codecs[name].nulls},
            # A time split's rule and cut-offs (training/prepare/time_split.py); a hash split records none.
            **({"split": by_time.describe()} if by_time else {}),
        },
    )


def _fit_train_columns(out_dir: Path, train: SplitInfo, codecs: dict[str, Codec], split_column: str | None) -> None:
    """Each input whose kind reads the train split's whole column (``Codec.reads_train_column``: a numeric
    input's quantiles), read back from the train shards one column at a time: memory is one column. The input on
    ``split_column`` (a time split's) is told first (``Codec.orders_the_split``)."""
    import pyarrow.parquet as pq

    if split_column in codecs:
        codecs[split_column].orders_the_split()
    files = [str(out_dir / shard.file) for shard in train.shards]
    for name, codec in codecs.items():
        if codec.reads_train_column:
            codec.fit_train_column(pq.read_table(files, columns=[name]).column(name).combine_chunks())


def _left_out(source: Source, plan: ColumnPlan, data: DataConfig) -> list[dict[str, str]]:
    """Without data.inputs or data.features: the columns left out, with the entry that would include each."""
    if data.inputs is not None or data.features is not None:
        return []
    left = [name for name in source.schema.names if name not in plan.columns]
    if not left:
        return []
    sample = next(iter(source.iter_batches(left, min(data.read_batch_rows, 10_000))), (None, None))[1]
    return left_out_columns(source.schema, plan, sample)


def _write_encoders(out_dir: Path, codecs: dict[str, Codec]) -> dict[str, str]:
    """encoders.json: every codec's state fitted on the train split; its sha256 goes in the manifest."""
    text = encoders_text(encoder_states(codecs))
    atomic_write_text(out_dir / ENCODERS_FILE, text)
    for codec in codecs.values():  # a kind's own files (a text input's tokenizer.json), covered by the sha256
        for relative, content in getattr(codec, "files", dict)().items():
            (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out_dir / relative, content)
    return {"file": ENCODERS_FILE, "sha256": encoders_sha256(text)}


class _ColumnChecks:
    """What prepare warns about or refuses over the whole source, not one batch: integer features beyond
    float32's exact range, and row weights that are all zero."""

    def __init__(self, plan: ColumnPlan):
        self.plan = plan
        self.largest: dict[str, int] = {}  # integer numeric input -> its largest magnitude
        self.weight_sum = 0.0

    def update(self, rows: _BatchRows) -> None:
        for name in self.plan.features:
            column = rows.raw_numeric.get(name)
            if column is not None and len(column):
                largest = pc.max(pc.abs_checked(pc.cast(column, pa.int64()))).as_py() or 0
                self.largest[name] = max(self.largest.get(name, 0), largest)
        if rows.weight is not None:
            self.weight_sum += float(rows.weight.sum())

    def warnings(self) -> list[str]:
        return [
            f"integer feature {name!r} holds values up to {largest}, beyond float32's exact range (2^24 = "
            f"{FLOAT32_EXACT}): neighbouring values collapse; if it is an id or a code, list it in data.inputs "
            f"as categorical or {{kind: hashed, buckets: N}}"
            for name, largest in self.largest.items()
            if largest > FLOAT32_EXACT
        ]

    def check_weights(self, source: Source, rows: int) -> None:
        if self.plan.weight is not None and not self.weight_sum > 0:
            raise DataError(
                f"{source.description}: weight column {self.plan.weight!r} (data.weight) is 0 in all {rows} "
                "rows kept: nothing would be learnt"
            )


FLOAT32_EXACT = 2**24


class _DriftStats:
    """What drift compares beyond the numeric histograms (ddpflow/drift/kinds.py, text.py), over the train
    split: each input's own statistics, as its kind keeps them (``Codec.drift_update``, ``drift_stats``), and the
    label's distribution."""

    def __init__(self, plan: ColumnPlan, codecs: dict[str, Codec], classes: pa.Array | None):
        self.plan, self.codecs = plan, codecs
        self.classes = np.zeros(len(classes), dtype=np.int64) if classes is not None else None
        self.target = RunningHistogram(1) if classes is None else None

    def update(self, rows: _BatchRows, chosen: np.ndarray) -> None:
        indices = pa.array(chosen, type=pa.int64())
        for name, column in rows.others.items():
            codec = self.codecs[name]
            if codec.drift_reads_rows and len(chosen):
                codec.drift_update(column.take(indices))
        if self.plan.task == "multilabel":
            taken = rows.label.take(pa.array(chosen, type=pa.int64()))
            self.classes += np.bincount(pc.list_flatten(taken).to_numpy(), minlength=len(self.classes))
            return
        label = rows.label.to_numpy(zero_copy_only=False)[chosen]
        if self.classes is not None:
            self.classes += np.bincount(label.astype(np.int64), minlength=len(self.classes))
        elif len(label):
            self.target.update(label[None, :].astype(np.float32))

    def to_dict(self) -> dict[str, Any]:
        stats = {name: codec.drift_stats() for name, codec in self.codecs.items()}
        label = (
            {"kind": "classes", "counts": self.classes.tolist()}
            if self.classes is not None
            else {"kind": "histogram", "histogram": self.target.to_list()[0]}
        )
        return {"inputs": {name: value for name, value in stats.items() if value is not None}, "label": label}


class _BatchRows:
    """One record batch: the numeric inputs as a (features x rows) float32 matrix, the other inputs as their
    raw (plain) values, label values, key and weight, with validity."""

    def __init__(
        self, batch: pa.RecordBatch, plan: ColumnPlan, classes: pa.Array | None, codecs: dict[str, Codec], file: str
    ):
        self.plan, self.codecs = plan, codecs
        self.features = _feature_matrix(batch, plan.features)
        self.raw_numeric = {
            name: batch.column(name)
            for name in plan.features
            if pa.types.is_integer(value_type(batch.column(name).type))
        }
        self.others = {name: plain(batch.column(name)) for name in plan.others}
        self.raw_label = _plain(batch.column(plan.label))
        if plan.task == "classification":
            self.label = pc.index_in(self.raw_label, value_set=classes)  # null where the label is invalid
        elif plan.task == "multilabel":
            self.label = _class_lists(self.raw_label, classes)
        else:
            self.label = pc.cast(self.raw_label, pa.float32())
        self.key = batch.column(plan.key) if plan.key else None
        self.weight = _weights(batch.column(plan.weight)) if plan.weight else None
        # A numeric input's null or NaN is a value (imputed) unless it says missing: error; inf never is.
        imputes = np.array([codecs[name].imputes for name in plan.features], dtype=bool)[:, None]
        self._feature_ok = np.isfinite(self.features) | (np.isnan(self.features) & imputes)
        self._others_ok = {name: codecs[name].valid(column, file) for name, column in self.others.items()}
        self.wrong_lengths = [
            error
            for name, c in self.others.items()
            if (error := codecs[name].invalid_error(file, c, self._others_ok[name]))
        ]
        self.others = {name: codecs[name].stored_values(column) for name, column in self.others.items()}
        self._label_ok = _valid_mask(self.label)
        self._key_ok = _valid_mask(self.key) if self.key is not None else True
        self._weight_ok = np.isfinite(self.weight) & (self.weight >= 0) if self.weight is not None else True
        self.valid = self._feature_ok.all(axis=0) & self._label_ok & self._key_ok & self._weight_ok
        for ok in self._others_ok.values():
            self.valid &= ok

    @property
    def invalid_rows(self) -> int:
        return int(len(self.valid) - self.valid.sum())

    def invalid_counts(self) -> dict[str, int]:
        counts = dict(zip(self.plan.features, (~self._feature_ok).sum(axis=1).tolist()))
        counts |= {name: int((~ok).sum()) for name, ok in self._others_ok.items()}
        counts[self.plan.label] = int((~self._label_ok).sum())
        if self.key is not None:
            counts[self.plan.key] = int((~self._key_ok).sum())
        if self.weight is not None:
            counts[self.plan.weight] = int((~self._weight_ok).sum())
        return counts

    def keep_valid(self) -> None:
        if self.valid.all():
            return
        mask = pa.array(self.valid)
        self.features = self.features[:, self.valid]
        self.raw_numeric = {name: column.filter(mask) for name, column in self.raw_numeric.items()}
        self.others = {name: column.filter(mask) for name, column in self.others.items()}
        self.raw_label = self.raw_label.filter(mask)
        self.label = self.label.filter(mask)
        self.key = self.key.filter(mask) if self.key is not None else None
        self.weight = self.weight[self.valid] if self.weight is not None else None

    def observe(self, rows: np.ndarray) -> None:
        """The train rows, for the encoders that learn from them (the categorical vocabulary, a numeric input's
        imputed value and null count)."""
        for i, name in enumerate(self.plan.features):
            self.codecs[name].observe(pa.array(self.features[i][rows]))
        indices = pa.array(rows, type=pa.int64())
        for name, column in self.others.items():
            self.codecs[name].observe(column.take(indices))

    def hashes(self) -> np.ndarray:
        """The split hash: the key when there is one, else the row's content (stored inputs + label)."""
        if self.key is not None:
            return hash_values(self.key)
        label_for_hash = self.raw_label if self.plan.task == "classification" else self.label
        if self.plan.task == "multilabel":  # a row's classes, as one sorted string
            label_for_hash = pa.array(["\x1f".join(map(str, sorted(row))) for row in self.raw_label.to_pylist()])
        extra = hash_values(label_for_hash)
        for name, column in self.others.items():  # none for numeric tables: their split hashes the numeric row alone
            if self.codecs[name].hashes_encoded:
                extra = row_split.hash_rows(self.codecs[name].encode(column).astype(np.float64), extra)
            else:
                extra = row_split.combine_hashes(extra, hash_values(column))
        return row_split.hash_rows(self.features.T, extra)

    def table(self, rows: np.ndarray, schema: pa.Schema) -> pa.Table:
        indices = pa.array(rows, type=pa.int64())
        columns = [_stored_numbers(self.features[i][rows]) for i in range(len(self.plan.features))]
        columns += [pc.cast(self.others[name].take(indices), schema.field(name).type) for name in self.plan.others]
        columns.append(pc.cast(self.label.take(indices), schema.field(self.plan.label).type))
        if self.key is not None:
            columns.append(self.key.take(indices))
        if self.weight is not None:
            columns.append(pa.array(self.weight[rows].astype(np.float32)))
        return pa.Table.from_arrays(columns, schema=schema)


def _stored_numbers(values: np.ndarray) -> pa.Array:
    """A numeric input's float32 shard column: a missing value (NaN here) as a null."""
    missing = np.isnan(values)
    return pa.array(values, mask=missing) if missing.any() else pa.array(values)


def _class_lists(raw: pa.Array, classes: pa.Array) -> pa.Array:
    """list<int64> of class indices per row; null where the list, or any value in it, is null."""
    raw = raw.combine_chunks() if isinstance(raw, pa.ChunkedArray) else raw
    lengths = pc.fill_null(pc.list_value_length(raw), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(raw) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    indices = pc.index_in(_plain(pc.list_flatten(raw)), value_set=classes)
    bad = np.zeros(len(raw), dtype=bool)
    parents = pc.list_parent_indices(raw).to_numpy(zero_copy_only=False)
    bad[parents[pc.is_null(indices).to_numpy(zero_copy_only=False)]] = True
    bad |= pc.is_null(raw).to_numpy(zero_copy_only=False)
    values = pc.cast(pc.fill_null(indices, 0), pa.int64())
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(bad))


def _weights(column: pa.Array) -> np.ndarray:
    """float64 row weights; null -> NaN (invalid)."""
    return pc.fill_null(pc.cast(plain(column), pa.float64()), np.nan).to_numpy(zero_copy_only=False)


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


def _shard_schema(plan: ColumnPlan, source_schema: pa.Schema, codecs: dict[str, Codec]) -> pa.Schema:
    fields = [pa.field(name, pa.float32()) for name in plan.features]
    fields += [pa.field(name, codecs[name].stored_type(source_schema.field(name).type)) for name in plan.others]
    label_type = {"classification": pa.int64(), "multilabel": pa.list_(pa.int64())}.get(plan.task, pa.float32())
    fields.append(pa.field(plan.label, label_type))
    if plan.key:
        fields.append(pa.field(plan.key, value_type(source_schema.field(plan.key).type)))
    if plan.weight:
        fields.append(pa.field(plan.weight, pa.float32()))
    return pa.schema(fields)


def _check_splits(
    splits: dict[str, SplitInfo], dropped: int, total: int, data: DataConfig, source: Source, by_time: TimeSplit | None
) -> None:
    if sum(split.rows for split in splits.values()) == 0:
        raise DataError(f"{source.description}: all {total} rows were dropped as invalid (data.on_invalid=drop)")
    if splits["train"].rows == 0:
        rule = by_time.rule() if by_time else f"val_fraction={data.val_fraction}, test_fraction={data.test_fraction}"
        raise DataError(
            f"{source.description}: the train split is empty ({total - dropped} valid rows, {rule}); add rows or "
            "lower the fractions (or move the cut-offs later)"
        )


def _manifest(source, data, plan, labels, splits, moments, histograms, targets, invalid, fingerprint) -> Manifest:
    return Manifest(
        fingerprint=fingerprint,
        source=data.source,
        task=plan.task,
        label=plan.label,
        key=plan.key,
        features=plan.features,
        label_mapping=labels.classes.to_pylist() if plan.task in CLASS_TASKS else None,
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
