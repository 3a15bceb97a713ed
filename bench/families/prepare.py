"""Prepare throughput and shard size.

Prepare: ``prepare_dataset`` rows/s ÷ a plain pyarrow read + write of the same
source file with the same Parquet settings (compression, dictionary, row
groups) as ddpflow's shards. ddpflow does more (label scan, validation, hash
split, statistics, atomic publish); the target allows it half the speed of
the bare copy. Its floor: the copy plus a sort of each numeric train column
(the exact quantile edges and robust scaling the default model trains on,
``NumericCodec.fit_train_column``), timed in the same repeat; where the copy
plus the sorts cannot reach the target, the target is restated as half the
floor's rate (the same allowance over the work that must be done).

Shard size: bytes on disk of all splits ÷ raw bytes (float32 features +
int64 label), next to pyarrow's default settings on the same rows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log
from bench.workloads.tabular import data_config, prepared_dir, raw_bytes, source_file


def run(ctx: Context) -> list[Result]:
    rows = ctx.sizes.rows
    source = source_file(ctx, rows)
    settings = shard_settings(prepared_dir(ctx, rows))
    ours, bare, sorts = [], [], []
    train_columns = train_feature_columns(prepared_dir(ctx, rows))
    for repeat in range(ctx.sizes.repeats):
        root = ctx.workdir / "prepare-bench" / str(repeat)
        with Timer() as prepare_time:
            prepare_into(ctx, source, root)
        with Timer() as copy_time:
            pyarrow_copy(source, root / "copy.parquet", **settings)
        shutil.rmtree(root, ignore_errors=True)
        ours.append(rows / prepare_time.seconds)
        bare.append(rows / copy_time.seconds)
        sorts.append(sort_seconds(train_columns))
        log(f"prepare repeat {repeat + 1}: ddpflow {ours[-1]:,.0f} rows/s, pyarrow copy {bare[-1]:,.0f} rows/s")
    ratio = Stats.of(a / b for a, b in zip(ours, bare))
    floor_rates = [rows / (rows / copy + sort) for copy, sort in zip(bare, sorts, strict=True)]
    ceiling = Stats.of(floor / copy for floor, copy in zip(floor_rates, bare, strict=True))
    mb = raw_bytes(1) / 1e6
    prepare = Result(
        name="prepare",
        title="Prepare throughput",
        ratio=ratio,
        target=0.5,
        ratio_label="prepare rows/s ÷ pyarrow read+write rows/s",
        rows=[
            Row("ddpflow prepare_dataset", Stats.of(ours), "rows/s", ratio),
            Row("  same, as raw MB/s", Stats.of(r * mb for r in ours), "MB/s"),
            Row("pyarrow read_table + write_table, same settings", Stats.of(bare), "rows/s"),
            Row("  same, as raw MB/s", Stats.of(r * mb for r in bare), "MB/s"),
            Row(
                f"a sort of each of the {len(train_columns)} numeric train columns (the exact edges)",
                Stats.of(sorts),
                "s",
            ),
            Row("the floor: the copy, then the sorts", Stats.of(floor_rates), "rows/s", ceiling),
        ],
        notes=[
            f"{rows:,} rows x 32 float32 features + int64 label from one Parquet file; shard settings: {settings}.",
            "prepare also scans labels, checks for NaN/inf, hashes rows into splits, computes train statistics "
            "and publishes atomically.",
            "the floor's ratio is the most prepare can read while it fits exact quantile edges; the restated target "
            "is half of it (the target's allowance over the work that must be done)",
        ],
    ).bounded_by(ceiling, share=0.5)
    return [prepare, shard_size(ctx, rows, source)]


def train_feature_columns(dataset_dir: Path) -> list:
    """Each numeric input's train values as prepare reads them back: a float32 array per column."""
    features = ddpflow_api.load_train_split(dataset_dir).features.numpy()
    return [features[:, column].copy() for column in range(features.shape[1])]


def sort_seconds(columns: list) -> float:
    """Seconds to sort every column, the present values of each as ``NumericCodec.fit_train_column`` does."""
    import numpy as np

    with Timer() as timed:
        for values in columns:
            np.sort(values[~np.isnan(values)])
    return timed.seconds


def prepare_into(ctx: Context, source: Path, root: Path) -> Path:
    return ddpflow_api.prepare(data_config(ctx, source, root=root))


def shard_settings(dataset_dir: Path) -> dict:
    """Compression, dictionary use and row-group size, read back from a written shard."""
    import pyarrow.parquet as pq

    manifest = ddpflow_api.manifest(dataset_dir)
    first = manifest.split_files(dataset_dir, "train")[0]
    metadata = pq.ParquetFile(first).metadata
    column = metadata.row_group(0).column(0)
    return {
        "compression": column.compression.lower(),
        "use_dictionary": any("DICTIONARY" in encoding for encoding in column.encodings),
        "row_group_size": metadata.row_group(0).num_rows,
    }


def pyarrow_copy(source: Path, target: Path, **settings) -> None:
    import pyarrow.parquet as pq

    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pq.read_table(source), target, **settings)


def dataset_bytes(dataset_dir: Path) -> int:
    return sum(path.stat().st_size for path in Path(dataset_dir).glob("*/part-*.parquet"))


def shard_size(ctx: Context, rows: int, source: Path) -> Result:
    import pyarrow.parquet as pq

    dataset_dir = prepared_dir(ctx, rows)
    raw = raw_bytes(rows)
    ours = dataset_bytes(dataset_dir) / raw
    default_file = ctx.workdir / "pyarrow-default.parquet"
    pq.write_table(pq.read_table(source), default_file)  # every pyarrow default: dictionary on, snappy
    default = default_file.stat().st_size / raw
    default_file.unlink()
    return Result(
        name="shards",
        title="Shard size",
        ratio=Stats.of([ours]),
        target=1.0,
        direction="le",
        ratio_label="bytes on disk ÷ raw bytes",
        rows=[
            Row("raw bytes (float32 features + int64 label)", Stats.of([raw / 1e6]), "MB"),
            Row("ddpflow shards, all splits", Stats.of([dataset_bytes(dataset_dir) / 1e6]), "MB", Stats.of([ours])),
            Row(
                "pyarrow defaults (dictionary, snappy), same rows",
                Stats.of([default * raw / 1e6]),
                "MB",
                Stats.of([default]),
            ),
            Row(
                "the source file (synthetic generator: no dictionary, snappy)",
                Stats.of([source.stat().st_size / 1e6]),
                "MB",
                Stats.of([source.stat().st_size / raw]),
            ),
        ],
        notes=[
            "Sizes are deterministic for the data: measured once. Random float32 features do not compress; the "
            "label column does."
        ],
    )
