"""Shared helpers for the prepare tests (tests/training/prepare, kinds, tests/ddpflow/drift): small real source
files in tmp dirs and a DataConfig writing beside them.

tests/conftest.py imports the fixtures, so every folder has them; the helpers reach tests through the ``dh``
fixture (``dh.numeric_table(...)``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.core.config import DataConfig
from training.core.layout import SPLITS

ROWS = 5000


@pytest.fixture
def make_config(tmp_path):
    """DataConfig writing under tmp_path/shards, with small shards so several are written."""

    def make(source: str, **fields) -> DataConfig:
        defaults = {
            "root": str(tmp_path / "shards"),
            "rows_per_shard": 1500,
            "row_group_size": 500,
            "read_batch_rows": 700,
        }
        return DataConfig(source=str(source), **{**defaults, **fields})

    return make


@pytest.fixture
def table_file(tmp_path):
    """Write a pyarrow table (or dict of columns) as Parquet or CSV; returns the path."""

    def write(columns: dict | pa.Table, name: str = "data.parquet") -> Path:
        table = columns if isinstance(columns, pa.Table) else pa.table(columns)
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".csv":
            import pyarrow.csv as pacsv

            pacsv.write_csv(table, path)
        else:
            pq.write_table(table, path)
        return path

    return write


def numeric_table(rows: int = ROWS, seed: int = 0, start: int = 0, classes=("a", "b", "c")) -> pa.Table:
    """id, three float features, an int feature and a string label."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": np.arange(start, start + rows, dtype=np.int64),
            "x0": rng.normal(size=rows),
            "x1": rng.normal(5.0, 3.0, size=rows).astype(np.float32),
            "x2": rng.uniform(-1, 1, size=rows),
            "count": rng.integers(0, 100, size=rows),
            "label": rng.choice(list(classes), size=rows),
        }
    )


def read_split(prepared, split: str) -> pa.Table:
    files = prepared.manifest.split_files(prepared.dataset_dir, split)
    return pa.concat_tables([pq.read_table(file) for file in files])


def read_all_splits(prepared) -> dict[str, pa.Table]:
    return {split: read_split(prepared, split) for split in SPLITS}


def nothing_complete(root: Path) -> bool:
    """No dataset directory that looks complete, and no temp dir left behind."""
    if not root.exists():
        return True
    return not list(root.glob("*/manifest.json")) and not list(root.glob(".tmp-*"))


@pytest.fixture
def dh() -> SimpleNamespace:
    return SimpleNamespace(
        rows=ROWS,
        numeric_table=numeric_table,
        read_split=read_split,
        read_all_splits=read_all_splits,
        nothing_complete=nothing_complete,
    )
