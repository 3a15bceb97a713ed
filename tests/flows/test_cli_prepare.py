"""``ddpflow prepare`` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def _ddpflow(repo_root, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo_root), "PREFECT_HOME": str(tmp_path / "prefect")}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def test_prepare_prints_json_and_reuses_the_dataset(repo_root, tmp_path):
    args = [
        "prepare",
        "--set",
        "data.source=synthetic://regression?rows=4000&features=3&seed=1",
        "--set",
        f"data.root={tmp_path / 'shards'}",
        "--json",
    ]
    first = _ddpflow(repo_root, tmp_path, *args)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["task"] == "regression" and summary["n_features"] == 3 and summary["n_classes"] is None
    assert sum(summary["rows"].values()) == 4000 and summary["cache_hit"] is False
    assert os.path.isfile(os.path.join(summary["dataset_dir"], "manifest.json"))
    second = _ddpflow(repo_root, tmp_path, *args)
    assert second.returncode == 0 and json.loads(second.stdout)["cache_hit"] is True


def test_prepare_from_a_yaml_config_in_human_form(repo_root, tmp_path):
    source = tmp_path / "data.csv"
    pq_table = pa.table(
        {"a": [float(i) for i in range(200)], "b": [i % 7 for i in range(200)], "label": ["x", "y"] * 100}
    )
    import pyarrow.csv as pacsv

    pacsv.write_csv(pq_table, source)
    (tmp_path / "config.yaml").write_text(
        f"data:\n  source: {source}\n  root: {tmp_path / 'shards'}\n  val_fraction: 0.2\n"
    )
    result = _ddpflow(repo_root, tmp_path, "prepare", "--config", "config.yaml")
    assert result.returncode == 0, result.stderr
    assert "classification" in result.stdout and "fingerprint" in result.stdout


def test_bad_input_exits_nonzero_with_the_error_last(repo_root, tmp_path):
    source = tmp_path / "data.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0, 3.0], "y": [0, 1, 0]}), source)
    result = _ddpflow(
        repo_root,
        tmp_path,
        "prepare",
        "--set",
        f"data.source={source}",
        "--set",
        f"data.root={tmp_path / 'shards'}",
        "--json",
    )
    assert result.returncode != 0 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(source) in last and "label column 'label'" in last and "not found" in last
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "shards").glob("*/manifest.json"))


def test_bad_fractions_exit_nonzero(repo_root, tmp_path):
    result = _ddpflow(
        repo_root, tmp_path, "prepare", "--set", "data.val_fraction=0.6", "--set", "data.test_fraction=0.5"
    )
    assert result.returncode != 0
    assert "must sum to less than 1" in result.stderr.strip().splitlines()[-1]
