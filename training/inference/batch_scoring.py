"""Batch scoring: the program every scoring rank runs, ``python -m training.inference.batch_scoring --config JOB``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m training.inference.batch_scoring --config OUTPUT/.score/job.json

A model.pt (resolved by the launcher: ``ddpflow/launch/scoring.py``; no rank talks to MLflow) scores a source
table through ``Predictor.score_columns``: the arrays of ``Predictor.scores``, the call the MLflow pyfunc answers
with (``training/inference/serving.py``): the same raw-row encoding, the same outputs.

- **The plan** (``make_plan``, written once by the launcher to ``OUTPUT/.score/plan.json`` and read back on every
  resume): the source's files, each cut into row ranges of whole Parquet row groups (a CSV file is one range),
  about ``batch_size`` rows or more each. Of the ranges not scored yet when the launch began (``ScoreJob.pending``),
  rank r scores ``shard_range(len(pending), r, world)``: every range belongs to one rank, no padding, no
  duplicates, whatever the world size, and a resumed scoring stays balanced.
- **The job** (``ScoreJob``, ``OUTPUT/.score/job.json``) is written last by the launcher; a rank imports what it
  needs, then waits for it (``wait_for``): torchrun may start before the command has read the model.
- **Memory flat**: a range is read in record batches (pyarrow.dataset, no readahead:
  ``training/prepare/sources.py: FileSource.scan``) and each batch is scored and appended to the range's part
  file as it comes; a rank holds one batch.
- **Part files** ``part-<file>-<first row>-<end row>.parquet``, written to a temp name and renamed when whole: a
  range whose part file exists is done, and a re-run (after SIGTERM, a lost rank, on another world size) scores
  only the others. Each part's metadata holds its coverage tally and the model's name and version.
- **Coverage**: each row's id is ``file << 40 | row in file``; every rank sums the tallies of its ranges (rows and
  ``Σ splitmix64(id)``, ``training/loop/counting.py: Certificate``), the ranks all-reduce them, and the total must
  equal the plan's, or nothing is published.
- **The manifest** (``manifest.json``: rows, files, model, source fingerprint) is written last, atomically, by
  rank 0, after the check: a reader that finds it finds a whole output.
- **Drift**: each part's footer holds the drift statistics of the rows it scored, per input
  (``training/inference/scored_drift.py``): what the command compares with the model's training data.
- **Bad rows**: a batch the model refuses is cut in halves until the refused rows are found; ``on_invalid:
  error`` stops with the file, the row and the model's reason (naming the column); ``skip`` writes them to
  ``rejects/`` with the reason, and they count as covered.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training.core.digest import json_digest
from training.core.errors import DataError
from training.core.fileio import atomic_path, atomic_write_json
from training.core.layout import MANIFEST, REJECTS, SCORE_DIR, SCORE_PLAN
from training.inference.scored_drift import DriftTally
from training.kinds.registry import kind_record
from training.loop.counting import Certificate, lanes

PREDICTION = "prediction"
FILE_SHIFT = 40  # a row id is file << 40 | row: files of up to 2^40 rows, 2^23 files
META_PREFIX = b"ddpflow."  # the coverage tally in each part's footer
PAUSE_ENV = "DDPFLOW_SCORE_PAUSE_S"  # test hook: seconds each rank sleeps after a part file (stop-and-resume test)
MEMORY_ENV = "DDPFLOW_SCORE_MEMORY_LOG"  # test hook: a directory; each rank logs its RSS after each batch (heap test)


@dataclass(frozen=True)
class ScoreJob:
    """What the launcher writes to OUTPUT/.score/job.json and every rank reads."""

    model_path: str  # a local model.pt
    model: dict[str, str]  # {"name", "version", "uri"}: what the manifest and the part files record
    source: str
    file_format: str
    output: str
    keep: list[str]
    output_kind: str  # label | probabilities | value
    batch_size: int
    on_invalid: str  # error | skip
    backend: str = "gloo"
    collective_timeout_s: float = 86_400.0  # the one collective waits for the slowest rank's share
    # The ranges not yet scored when the launch began (indexes into the plan), shared out among the ranks, so that
    # a resumed scoring is balanced; None (a rank run by hand): the ranges whose part file is missing.
    pending: list[int] | None = None

    def write(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(path, asdict(self))

    @classmethod
    def read(cls, path: str | os.PathLike) -> ScoreJob:
        return cls(**json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Unit:
    """One rank's piece of work: rows [start, stop) of file ``file``; ``row_groups`` of a Parquet file (None: all),
    which begin at file row ``first`` (None: at ``start``; a piece of one large row group begins inside it)."""

    file: int
    start: int
    stop: int
    row_groups: list[int] | None = None
    first: int | None = None

    def batches(self, scanned: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(file row of its first row, batch) for the range's rows, from the batches of its row groups."""
        position = self.start if self.first is None else self.first
        for batch in scanned:
            begin, position = position, position + batch.num_rows
            if position <= self.start:
                continue  # before a piece of a large row group: read, not scored (the price of splitting it)
            if begin >= self.stop:
                return
            low, high = max(self.start, begin), min(self.stop, position)
            yield low, batch.slice(low - begin, high - low)

    @property
    def name(self) -> str:
        return f"part-{self.file:05d}-{self.start:012d}-{self.stop:012d}.parquet"

    def row_ids(self, first: int, count: int) -> np.ndarray:
        return (np.uint64(self.file) << np.uint64(FILE_SHIFT)) + np.arange(first, first + count, dtype=np.uint64)


@dataclass
class Plan:
    source: str
    fingerprint: str  # of the source's identity: its files, sizes and versions
    files: list[list[Any]]  # [display name, rows]
    units: list[Unit] = field(default_factory=list)
    model: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.files)

    def expected(self) -> Certificate:
        """The certificate of every row of every file."""
        rows = high = low = 0
        for unit in self.units:
            n, h, lo = lanes(unit.row_ids(unit.start, unit.stop - unit.start))
            rows, high, low = rows + n, high + h, low + lo
        return Certificate.from_lanes(rows, high, low)

    def pending(self, output: str | os.PathLike) -> list[int]:
        """The ranges whose part file is not written yet."""
        return [i for i, unit in enumerate(self.units) if not (Path(output) / unit.name).is_file()]

    def mine(self, rank: int, world_size: int, pending: list[int]) -> tuple[list[Unit], list[Unit]]:
        """(the pending ranges this rank scores, the finished ranges whose tallies it reads): each a contiguous
        share (``shard_range``) of its list, so every range is one rank's, whatever the world size."""
        from training.distributed.context import shard_range

        todo = set(pending)
        shares = []
        for units in (
            [u for i, u in enumerate(self.units) if i in todo],
            [u for i, u in enumerate(self.units) if i not in todo],
        ):
            first, stop = shard_range(len(units), rank, world_size)
            shares.append(units[first:stop])
        return shares[0], shares[1]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "units": [asdict(unit) for unit in self.units]}

    @classmethod
    def read(cls, path: str | os.PathLike) -> Plan:
        raw = json.loads(Path(path).read_text())
        raw["units"] = [Unit(**unit) for unit in raw["units"]]
        return cls(**raw)


# ----------------------------------------------------------------------------- the plan (the launcher makes it)


def open_scoring_source(source: str, file_format: str = "auto"):
    """The source as data.source reads it (file, directory, glob, fsspec URL, image folder), no synthetic data."""
    from training.prepare.image_folder import ImageFolderSource
    from training.prepare.sources import FileSource, open_source

    opened = open_source(source, file_format)
    if not isinstance(opened, FileSource | ImageFolderSource):
        raise DataError(
            f"score.source {source!r}: scoring reads Parquet or CSV files or an image folder, not "
            f"{type(opened).__name__}"
        )
    return opened


def make_plan(job: ScoreJob, inputs: dict[str, Any], ranks: int = 1) -> Plan:
    """The source's files cut into row ranges; a DataError naming the file and column when the source lacks an
    input or keep column, or holds one of a type the model cannot read (``inputs``: the model's InputInfos).
    ``ranks``: a row group of at least 2 x batch_size rows is cut into up to that many pieces (a 1M-row file
    written with pyarrow's defaults is ONE row group: otherwise one rank would score it all)."""
    source = open_scoring_source(job.source, job.file_format)
    check_columns(source, inputs, job.keep)
    files, units = [], []
    for index, (file, fragment) in enumerate(source.fragments()):
        rows, pieces = _cut(fragment, job.batch_size, ranks)
        files.append([file.display, rows])
        units += [Unit(index, *piece) for piece in pieces]
    return Plan(job.source, json_digest(source.identity(), compact=False), files, units, job.model)


def _cut(fragment, batch_size: int, ranks: int = 1) -> tuple[int, list[tuple]]:
    """(the file's rows, its ranges as (start, stop, row groups, first)): whole row groups of a Parquet file
    gathered to at least ``batch_size`` rows, a row group of ``2 * batch_size`` rows or more cut into up to
    ``ranks`` pieces (an image folder's class folder likewise: its row groups are runs of images); a CSV file is one
    range (its rows counted by a scan)."""
    import pyarrow.dataset as ds

    from training.prepare.image_folder import ImageFragment

    if not isinstance(fragment, ds.ParquetFileFragment | ImageFragment):
        rows = fragment.count_rows()
        return rows, [(0, rows, None, None)] if rows else []
    fragment.ensure_complete_metadata()
    pieces, start, stop, taken = [], 0, 0, []
    for group in fragment.row_groups:
        count = min(ranks, group.num_rows // batch_size)
        if count >= 2:  # a large row group: its own pieces, each read from the group's first row
            if stop > start:
                pieces.append((start, stop, taken, None))
            bounds = [stop + group.num_rows * i // count for i in range(count + 1)]
            pieces += [(low, high, [group.id], stop) for low, high in zip(bounds, bounds[1:])]
            start = stop = stop + group.num_rows
            taken = []
            continue
        taken.append(group.id)
        stop += group.num_rows
        if stop - start >= batch_size:
            pieces.append((start, stop, taken, None))
            start, taken = stop, []
    if stop > start:
        pieces.append((start, stop, taken, None))
    return stop, pieces


def check_columns(source, inputs: dict[str, Any], keep: list[str]) -> None:
    """Every input and keep column is in the source, and numeric inputs hold numbers; a DataError names them."""
    first = next((file.display for file, _ in source.fragments()), source.description)
    schema = source.schema
    missing = [name for name in inputs if name not in schema.names]
    if missing:
        raise DataError(f"{first}: lacks the model's input columns {missing} (the source has {schema.names})")
    absent = [name for name in keep if name not in schema.names]
    if absent:
        raise DataError(
            f"{first}: lacks the score.keep columns {absent} (the source has {schema.names}; score.keep unset keeps "
            "data.key, else the model's own: set score.keep, [] for none)"
        )
    for name, info in inputs.items():  # each input's column as its kind's record takes it (prepare's check)
        column_type, record = schema.field(name).type, kind_record(info.kind)
        if not (pa.types.is_null(column_type) or record.takes(column_type)):  # all null: each row's own check
            raise DataError(
                f"{first}: column {name!r} is {column_type}; the model's {info.kind} input takes {record.takes_what}"
            )
    clash = [name for name in keep if name == PREDICTION or name.startswith("probability_")]
    if clash:
        raise DataError(f"score.keep: {clash} would clash with the score columns; keep other columns")


# ----------------------------------------------------------------------------- scoring (every rank)


class MemoryLog:
    """With ``DDPFLOW_SCORE_MEMORY_LOG=DIR`` (the heap test), a rank's memory as it scores: a first line once the
    model is loaded (the kernel's peak-RSS mark reset there, ``/proc/self/clear_refs``), then one after each batch,
    ``{"rows", "anon", "rss", "peak"}`` in ``DIR/rank-<r>.jsonl``: rows scored by this rank so far; its anonymous
    resident memory (RssAnon: the heap, Arrow's pool, tensors; not the pages of its files and libraries), its RSS
    and its peak RSS since the reset, in bytes. Unset (every real scoring): nothing. Linux only."""

    def __init__(self, rank: int):
        directory = os.environ.get(MEMORY_ENV)
        self.path = Path(directory) / f"rank-{rank}.jsonl" if directory else None
        self.rows = 0
        if self.path is not None:
            Path("/proc/self/clear_refs").write_text("5")  # 5: the peak (VmHWM) starts again from now
            self._write()

    def mark(self, rows: int) -> None:
        self.rows += rows
        if self.path is not None:
            self._write()

    def _write(self) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        anon, rss, peak = (int(status[key].split()[0]) * 1024 for key in ("RssAnon", "VmRSS", "VmHWM"))
        with self.path.open("a") as log:
            log.write(json.dumps({"rows": self.rows, "anon": anon, "rss": rss, "peak": peak}) + "\n")


class UnitScorer:
    """Scores this rank's ranges into part files: one record batch at a time."""

    def __init__(self, job: ScoreJob, plan: Plan, predictor, memory: MemoryLog | None = None):
        from training.inference.model_file import checkpoint_codecs

        self.job, self.plan, self.predictor = job, plan, predictor
        self.memory = memory
        self.output = Path(job.output)
        self.source = open_scoring_source(job.source, job.file_format)
        self.fragments = self.source.fragments()
        self.output_name = "probabilities" if job.output_kind == "probabilities" else "label"  # Predictor.scores
        self.columns = list(dict.fromkeys([*job.keep, *predictor.features]))
        self.codecs = checkpoint_codecs(predictor.meta)  # the model's fitted codecs, for the drift statistics
        self.drift = DriftTally(self.codecs)
        # The model's name and version in every part's schema metadata: pandas and pyarrow readers see them.
        self.schema = output_schema(self.source.schema, job.keep, predictor, job.output_kind).with_metadata(
            {"ddpflow.model": job.model["name"], "ddpflow.model_version": str(job.model["version"]),
             "ddpflow.source_fingerprint": plan.fingerprint}
        )  # fmt: skip
        self.dictionary = dictionary_columns(self.schema, job.keep)  # not the probabilities: almost all distinct

    def tally(self, unit: Unit) -> list[int]:
        """(rows, high, low, rejected) of a finished range: scored now, or found whole from an earlier run."""
        path = self.output / unit.name
        if not path.is_file():
            self.score(unit)
        footer = pq.read_metadata(path)
        meta = footer.metadata or {}
        tally = [int(meta[META_PREFIX + key]) for key in (b"rows", b"hash_high", b"hash_low", b"rejected")]
        if footer.num_rows + tally[3] != tally[0]:
            raise RuntimeError(f"{path}: holds {footer.num_rows} rows + {tally[3]} rejected, not its {tally[0]}")
        return tally

    def score(self, unit: Unit) -> None:
        """One range into its part file, whole or not there: a part that exists is a range done (its rejects
        written beside it first)."""
        self.drift = DriftTally(self.codecs)
        with atomic_path(self.output / unit.name, durable=False) as temp:
            with pq.ParquetWriter(temp, self.schema, use_dictionary=self.dictionary) as writer:
                tally, rejects = self._score_range(unit, writer)
                # The range's coverage tally, in the footer: what a resumed run counts for this range.
                writer.add_key_value_metadata({f"ddpflow.{key}": str(value) for key, value in tally.items()})
                writer.add_key_value_metadata(self.drift.metadata())  # the drift statistics of its scored rows
            if rejects:
                _write_rejects(self.output / REJECTS / unit.name, pa.concat_tables(rejects))
        pause = float(os.environ.get(PAUSE_ENV) or 0)
        if pause:
            time.sleep(pause)

    def _score_range(self, unit: Unit, writer: pq.ParquetWriter) -> tuple[dict[str, int], list[pa.Table]]:
        """The range's rows scored into ``writer``: its tally (rows, id hash lanes, rejected) and rejected rows."""
        file, fragment = self.fragments[unit.file]
        if unit.row_groups is not None:
            fragment = fragment.subset(row_group_ids=unit.row_groups)
        rows = high = low = rejected = 0
        rejects: list[pa.Table] = []
        for first, batch in unit.batches(self.source.scan(file, fragment, self.columns, self.job.batch_size)):
            ids = unit.row_ids(first, batch.num_rows)
            scored, refused = self.score_batch(batch, file.display, first)
            writer.write_table(scored)
            if self.memory is not None:
                self.memory.mark(batch.num_rows)
            if refused is not None:
                rejects.append(refused)
                rejected += refused.num_rows
            n, h, lo = lanes(ids)
            rows, high, low = rows + n, high + h, low + lo
        if rows != unit.stop - unit.start:
            raise DataError(f"{file.display}: rows {unit.start}..{unit.stop} read as {rows} rows: the file changed")
        return {"rows": rows, "hash_high": high, "hash_low": low, "rejected": rejected}, rejects

    def score_batch(self, batch: pa.RecordBatch, display: str, first_row: int) -> tuple[pa.Table, pa.Table | None]:
        """The batch's output rows, and its refused rows (``on_invalid: skip``) with the reason."""
        stop_at_first = self.job.on_invalid == "error"  # the batch as Arrow: score_columns reads it as it is
        good, bad = _bisect(self.predictor, batch, np.arange(batch.num_rows), self.output_name, stop_at_first)
        if bad and stop_at_first:
            position, reason = bad[0]
            raise DataError(
                f"{display}: row {first_row + position} (counting from 0): {reason} "
                "(score.on_invalid: skip writes such rows to rejects/ with the reason instead)"
            )
        keep = pa.Table.from_batches([batch]).select(self.job.keep)
        positions = np.concatenate([p for p, _ in good]) if good else np.empty(0, dtype=np.int64)
        scores = [s for _, s in good]
        table = _output_table(keep.take(pa.array(positions, pa.int64())), scores, self.schema)
        self.drift.update(batch.take(pa.array(positions, pa.int64())) if bad else batch)
        if not bad:
            return table, None
        where = np.array([p for p, _ in bad], dtype=np.int64)
        refused = keep.take(pa.array(where)).append_column("source_file", pa.array([display] * len(where)))
        refused = refused.append_column("source_row", pa.array(first_row + where, pa.int64()))
        return table, refused.append_column("reason", pa.array([r for _, r in bad], pa.string()))


def _bisect(predictor, batch: pa.RecordBatch, positions: np.ndarray, output: str, stop_at_first: bool):
    """([(positions, scores)], [(position, reason)]): the rows the model scores, in order, and those it refuses,
    found by halving a refused batch (a clean batch is one call); ``stop_at_first``: only the first refused row."""
    try:
        return [(positions, predictor.score_columns(batch, output))], []
    except (ValueError, TypeError, OSError) as error:
        if batch.num_rows == 1:
            return [], [(int(positions[0]), str(error))]
    half = batch.num_rows // 2
    good, bad = _bisect(predictor, batch.slice(0, half), positions[:half], output, stop_at_first)
    if bad and stop_at_first:
        return good, bad
    good_b, bad_b = _bisect(predictor, batch.slice(half), positions[half:], output, stop_at_first)
    return good + good_b, bad + bad_b


def output_schema(source: pa.Schema, keep: list[str], predictor, output_kind: str) -> pa.Schema:
    """The kept columns as the source has them, ``prediction`` and, for probabilities, one float32 column per class."""
    fields = [source.field(name) for name in keep]
    labels = predictor.meta.get("label_mapping")
    if predictor.task == "regression" or labels is None:
        return pa.schema([*fields, pa.field(PREDICTION, pa.float32())])
    label_type = pa.array(list(labels)).type
    fields.append(pa.field(PREDICTION, pa.list_(label_type) if predictor.task == "multilabel" else label_type))
    if output_kind == "probabilities":
        fields += [pa.field(f"probability_{label}", pa.float32()) for label in labels]
    return pa.schema(fields)


def dictionary_columns(schema: pa.Schema, keep: list[str]) -> list[str]:
    """The part's Parquet columns (leaf paths: a list column's values are ``name.list.element``) that are
    dictionary-encoded: all but the model's float outputs (class probabilities, a regression's values). Those are
    almost all distinct: Parquet builds a dictionary for every page before it gives up on one, and the dictionary
    and its indices take more room than the values (65,536 rows of 10 class probabilities: 6x the write and 1.4x
    the file)."""
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)  # Parquet's own leaf paths for the schema
    leaves = pq.read_metadata(pa.BufferReader(sink.getvalue())).schema
    outputs = {field.name for field in schema if field.name not in keep and pa.types.is_floating(field.type)}
    return [leaves.column(i).path for i in range(len(leaves)) if leaves.column(i).path not in outputs]


def _output_table(keep: pa.Table, scores: list, schema: pa.Schema) -> pa.Table:
    """The kept columns beside the scores (``Predictor.score_columns``: label, and probabilities)."""
    columns = {name: keep[name] for name in keep.column_names}
    for column in schema:
        if column.name in columns:
            continue
        name = "label" if column.name == PREDICTION else column.name
        parts = [np.asarray(score[name]) for score in scores]
        values = np.concatenate(parts) if parts else np.empty(0, dtype=object)
        columns[column.name] = pa.array(values.tolist() if values.dtype == object else values, column.type)
    return pa.table(columns, schema=schema)


def _write_rejects(path: Path, table: pa.Table) -> None:
    with atomic_path(path, durable=False) as temp:
        pq.write_table(table, temp)


# ----------------------------------------------------------------------------- the rank's program


def score_rank(job: ScoreJob, ctx) -> dict[str, Any] | None:
    """This rank's ranges, the all-reduced coverage check, and (rank 0) the manifest; returns it on rank 0."""
    from training.inference.predict import Predictor

    plan = Plan.read(Path(job.output) / SCORE_DIR / SCORE_PLAN)
    predictor = Predictor.from_checkpoint(job.model_path, batch_size=job.batch_size).to(ctx.device)  # NCCL: its GPU
    scorer = UnitScorer(job, plan, predictor, MemoryLog(ctx.rank))  # the heap test's baseline: the model loaded
    started, cpu_started = time.monotonic(), time.process_time()
    totals = [0, 0, 0, 0]
    to_score, finished = plan.mine(
        ctx.rank, ctx.world_size, plan.pending(job.output) if job.pending is None else job.pending
    )
    for unit in [*to_score, *finished]:
        totals = [a + b for a, b in zip(totals, scorer.tally(unit), strict=True)]
    cpu_us = round((time.process_time() - cpu_started) * 1e6)  # every thread of this rank: user + system
    rows, high, low, rejected, cpu_us = ctx.all_reduce_int_sum([*totals, cpu_us])
    certificate = Certificate.from_lanes(rows, high, low)
    expected = plan.expected()
    if certificate != expected:
        raise RuntimeError(
            f"coverage check failed: the parts hold {certificate.rows} rows, hash {certificate.hash:016x}; the source "
            f"has {expected.rows} rows, hash {expected.hash:016x}: not every row was scored exactly once"
        )
    if not ctx.is_main:
        return None
    seconds = time.monotonic() - started
    manifest = scoring_manifest(job, plan, certificate, rejected, seconds, cpu_us / 1e6, ctx.world_size)
    atomic_write_json(Path(job.output) / MANIFEST, manifest)
    return manifest


def scoring_manifest(
    job: ScoreJob, plan: Plan, certificate: Certificate, rejected: int, seconds: float, cpu_seconds: float, world: int
):
    """``seconds``: rank 0's wall time from the plan to the coverage check; ``cpu_seconds``: the CPU time the ranks
    spent in it, summed over ranks (every thread, user and system), so ``cpu_seconds / seconds`` is the cores the
    ranks kept busy."""
    return {
        "rows": certificate.rows,
        "scored": certificate.rows - rejected,
        "rejected": rejected,
        "coverage": {"rows": certificate.rows, "hash": f"{certificate.hash:016x}"},
        "files": [unit.name for unit in plan.units],
        "rejects": sorted(p.name for p in (Path(job.output) / REJECTS).glob("part-*.parquet")),
        "model": job.model,
        "source": {"url": job.source, "fingerprint": plan.fingerprint, "files": plan.files},
        "output_kind": job.output_kind,
        "keep": job.keep,
        "world_size": world,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }


def iter_parts(output: str | os.PathLike) -> Iterator[Path]:
    """The finished part files of an output directory, in source order."""
    yield from sorted(Path(output).glob("part-*.parquet"))


def wait_for(job_path: Path, poll_s: float = 0.01) -> Path:
    """The job, once written: torchrun may start before the command has read the model and made the plan
    (ddpflow/launch/scoring.py); the job is written last, atomically. A command that fails first stops the ranks."""
    while not job_path.is_file():
        time.sleep(poll_s)
    return job_path


def main(argv: list[str] | None = None) -> None:
    from training.core.config import TrainConfig
    from training.distributed.context import distributed
    from training.distributed.process import (
        die_with_parent,
        exit_without_teardown,
        keep_freed_heap,
        record_root_cause,
    )
    from training.inference.predict import Predictor  # noqa: F401  imported while the command writes the job

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="OUTPUT/.score/job.json")
    die_with_parent()
    job = ScoreJob.read(wait_for(Path(parser.parse_args(argv).config)))
    keep_freed_heap()  # the forward's intermediate tensors reuse freed heap instead of faulting in fresh pages

    @record_root_cause
    def run() -> None:
        train = TrainConfig(backend=job.backend, collective_timeout_s=job.collective_timeout_s)
        with distributed(train) as ctx:
            manifest = score_rank(job, ctx)
            if manifest is not None:
                print(f"scored {manifest['rows']} rows into {len(manifest['files'])} files", flush=True)

    run()
    exit_without_teardown()  # done: the group is destroyed and every file closed; torchrun waits for the slowest


if __name__ == "__main__":
    main()
