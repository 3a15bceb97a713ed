"""The split hash is stable across processes, and the synthetic generator is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from training.core.layout import SPLITS
from training.kinds import hashing
from training.prepare import split
from training.prepare.dataset import prepare_dataset
from training.prepare.synthetic import SyntheticSpecError, iter_batches, parse_spec, write_synthetic

_HASH_SNIPPET = """
import json, sys
import numpy as np, pyarrow as pa
from training.kinds import hashing
from training.prepare import split
keys = hashing.hash_values(pa.array(list(range(1000)))).tolist()
words = hashing.hash_values(pa.array([f"user-{i}" for i in range(1000)])).tolist()
matrix = np.arange(3000, dtype=np.float32).reshape(1000, 3) / 7
rows = split.hash_rows(matrix, hashing.hash_values(pa.array([i % 3 for i in range(1000)]))).tolist()
print(json.dumps([keys, words, rows]))
"""


def _hashes_in_process():
    keys = hashing.hash_values(pa.array(list(range(1000)))).tolist()
    words = hashing.hash_values(pa.array([f"user-{i}" for i in range(1000)])).tolist()
    rows = split.hash_rows(
        np.arange(3000, dtype=np.float32).reshape(1000, 3) / 7,
        hashing.hash_values(pa.array([i % 3 for i in range(1000)])),
    ).tolist()
    return [keys, words, rows]


def test_hashes_are_the_same_in_another_process(repo_root):
    # A different PYTHONHASHSEED would change Python's hash(); ours must not move.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(repo_root)}
    output = subprocess.run(
        [sys.executable, "-c", _HASH_SNIPPET], env=env, capture_output=True, text=True, check=True, cwd=repo_root
    ).stdout
    assert json.loads(output) == _hashes_in_process()


def test_hash_values_are_pinned():
    # If a pandas upgrade changed hash_array, every row could change split on the next retrain: fail loudly.
    assert hashing.hash_values(pa.array([1, 2, 3])).tolist() == [
        6238072747940578789,
        15839785061582574730,
        2185194620014831856,
    ]


def test_integer_widths_hash_alike():
    assert (
        hashing.hash_values(pa.array([5, -1], type=pa.int32())).tolist()
        == hashing.hash_values(pa.array([5, -1], type=pa.int64())).tolist()
    )


def test_assign_splits_follows_the_fractions():
    hashes = hashing.hash_values(pa.array(np.arange(100_000)))
    codes = split.assign_splits(hashes, val_fraction=0.2, test_fraction=0.1)
    shares = np.bincount(codes, minlength=3) / len(codes)
    np.testing.assert_allclose(shares, [0.7, 0.2, 0.1], atol=0.01)
    # growing val never moves a test row, and test rows stay test when val changes
    wider = split.assign_splits(hashes, val_fraction=0.3, test_fraction=0.1)
    assert np.array_equal(codes == split.TEST, wider == split.TEST)


def test_synthetic_is_deterministic_and_longer_specs_extend_shorter_ones():
    short = pa.Table.from_batches(
        list(iter_batches(parse_spec("synthetic://classification?rows=1000&features=4&classes=3&seed=2&id=1")))
    )
    long = pa.Table.from_batches(
        list(
            iter_batches(
                parse_spec("synthetic://classification?rows=70000&features=4&classes=3&seed=2&id=1"), batch_rows=4096
            )
        )
    )
    assert long.num_rows == 70000 and long.slice(0, 1000).equals(short)
    assert long.column_names == ["id", "f0", "f1", "f2", "f3", "label"]
    assert long["f0"].type == pa.float32() and long["label"].type == pa.int64()
    other_seed = pa.Table.from_batches(
        list(iter_batches(parse_spec("synthetic://classification?rows=1000&features=4&classes=3&seed=3&id=1")))
    )
    assert not other_seed.equals(short)
    batches = list(iter_batches(parse_spec("synthetic://regression?rows=10000&features=2&seed=0"), batch_rows=3000))
    assert [batch.num_rows for batch in batches] == [3000, 3000, 3000, 1000] and batches[0].schema.field(
        "label"
    ).type == pa.float32()


def test_bad_synthetic_specs():
    for url, problem in [
        ("synthetic://classification?rows=10", "'features' is required"),
        ("synthetic://classification?rows=ten&features=2", "not an integer"),
        ("synthetic://classification?rows=10&features=2&classes=1", "classes=1"),
        ("synthetic://regression?rows=10&features=2&classes=3", "unknown parameter 'classes'"),
    ]:
        with pytest.raises(SyntheticSpecError, match=problem):
            parse_spec(url)


def test_written_synthetic_files_prepare_like_the_synthetic_source(tmp_path, make_config, dh):
    url = "synthetic://classification?rows=3000&features=5&classes=3&seed=4&id=1"
    parquet = write_synthetic(url, tmp_path / "syn.parquet")
    csv = write_synthetic(url, tmp_path / "syn.csv")
    assert pq.read_table(parquet).equals(pa.Table.from_batches(list(iter_batches(parse_spec(url)))))
    assert pacsv.read_csv(csv).num_rows == 3000
    prepared = {
        name: prepare_dataset(make_config(source, key="id"))
        for name, source in [("synthetic", url), ("parquet", parquet), ("csv", csv)]
    }
    assert len({p.fingerprint for p in prepared.values()}) == 3  # different sources, different fingerprints
    reference = dh.read_all_splits(prepared["synthetic"])
    for name in ("parquet", "csv"):
        np.testing.assert_allclose(
            prepared[name].manifest.feature_mean, prepared["synthetic"].manifest.feature_mean, rtol=1e-12
        )
        tables = dh.read_all_splits(prepared[name])
        for split_name in SPLITS:
            assert tables[split_name].equals(reference[split_name]), (name, split_name)
