"""Write one split as ``part-NNNNN.parquet`` shards of ``rows_per_shard`` rows.

Rows arrive in small tables (a split's share of each read batch); they are
buffered until a full row group (``row_group_size``) is ready, so row groups
have the configured size and memory holds at most one row group per split.
Float columns are written without dictionary encoding: on random floats the
dictionary is larger and several times slower to write.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from training.core.manifest import ShardInfo, SplitInfo


class SplitWriter:
    def __init__(self, dataset_dir: Path, split: str, schema: pa.Schema, rows_per_shard: int, row_group_size: int):
        self._dataset_dir = dataset_dir
        self._split = split
        self._schema = schema
        self._rows_per_shard = rows_per_shard
        self._row_group_size = row_group_size
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._shard_rows = 0
        self._shards: list[ShardInfo] = []
        (dataset_dir / split).mkdir(parents=True, exist_ok=True)

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self._next_group_rows():
            self._write_group(self._next_group_rows())

    def close(self) -> SplitInfo:
        """Flush the rest; a split with no rows still gets one empty shard, so readers always find the schema."""
        while self._pending_rows:
            self._write_group(min(self._pending_rows, self._next_group_rows()))
        if self._writer is None and not self._shards:
            self._open_shard()
        self._close_shard()
        return SplitInfo(rows=sum(shard.rows for shard in self._shards), shards=list(self._shards))

    def _next_group_rows(self) -> int:
        return min(self._row_group_size, self._rows_per_shard - self._shard_rows)

    def _write_group(self, rows: int) -> None:
        pending = pa.concat_tables(self._pending)
        if self._writer is None:
            self._open_shard()
        self._writer.write_table(pending.slice(0, rows), row_group_size=rows)
        self._shard_rows += rows
        rest = pending.slice(rows)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows
        if self._shard_rows >= self._rows_per_shard:
            self._close_shard()

    def _relative(self, index: int) -> str:
        return f"{self._split}/part-{index:05d}.parquet"

    def _open_shard(self) -> None:
        path = self._dataset_dir / self._relative(len(self._shards))
        self._writer = pq.ParquetWriter(path, self._schema, use_dictionary=False, compression="snappy")
        self._shard_rows = 0

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        relative = self._relative(len(self._shards))
        size = (self._dataset_dir / relative).stat().st_size
        self._shards.append(ShardInfo(file=relative, rows=self._shard_rows, bytes=size))
        self._shard_rows = 0
