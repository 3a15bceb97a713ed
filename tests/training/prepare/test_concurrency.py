"""Two real processes preparing the same dataset at once leave one complete copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from devtools.waiting import wait_until
from training.core.layout import SPLITS
from training.core.manifest import read_manifest
from training.prepare.publish import make_temp_dir, publish, remove_stale_temp_dirs

# Each process says it is ready (pyarrow and prepare imported), then starts on the parent's "go".
_PREPARE_WHEN_GO = """
import json, sys, time
from pathlib import Path
from training.core.config import DataConfig
from training.prepare.dataset import prepare_dataset
Path(sys.argv[4]).touch()
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
prepared = prepare_dataset(DataConfig(source=sys.argv[2], root=sys.argv[3], rows_per_shard=10000))
print(json.dumps(prepared.summary()))
"""


def test_two_processes_prepare_one_copy(tmp_path, repo_root):
    root = tmp_path / "shards"
    source = "synthetic://classification?rows=60000&features=8&classes=3&seed=7"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    ready = [tmp_path / f"ready-{number}" for number in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_WHEN_GO, str(go), source, str(root), str(flag)],
            env=env,
            cwd=repo_root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    try:
        wait_until(lambda: all(flag.exists() for flag in ready), 120, "both processes to be ready", interval_s=0.05)
    finally:
        go.touch()  # also on a timeout: the processes end instead of polling forever
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        results.append(json.loads(stdout))
    assert results[0]["dataset_dir"] == results[1]["dataset_dir"]
    assert results[0]["rows"] == results[1]["rows"] and sum(results[0]["rows"].values()) == 60000
    assert [path.name for path in root.iterdir()] == [results[0]["fingerprint"]]  # one copy, no temp dirs left
    manifest = read_manifest(root / results[0]["fingerprint"])
    on_disk = sorted(
        str(path.relative_to(root / manifest.fingerprint)) for path in (root / manifest.fingerprint).rglob("*.parquet")
    )
    assert on_disk == sorted(shard.file for split in SPLITS for shard in manifest.splits[split].shards)


def test_the_loser_of_a_publish_race_discards_its_copy(tmp_path):
    first, second = make_temp_dir(tmp_path, "abc"), make_temp_dir(tmp_path, "abc")
    for temp in (first, second):
        (temp / "manifest.json").write_text(json.dumps({"built_by": temp.name}))
    assert publish(first, tmp_path / "abc") is True
    assert publish(second, tmp_path / "abc") is False
    assert not second.exists() and not first.exists()
    assert json.loads((tmp_path / "abc" / "manifest.json").read_text())["built_by"] == first.name


def test_live_temp_dirs_are_kept_and_dead_ones_removed(tmp_path):
    live = make_temp_dir(tmp_path, "abc")  # owned by this (alive) process
    dead = make_temp_dir(tmp_path, "abc")
    (dead / ".owner").write_text(f"{os.uname().nodename} 999999999\n")
    foreign = make_temp_dir(tmp_path, "abc")
    (foreign / ".owner").write_text("some-other-host 1\n")  # cannot be checked: kept until it is old
    assert remove_stale_temp_dirs(tmp_path) == [dead]
    assert live.exists() and foreign.exists()
    old = time.time() - 2 * 24 * 3600
    os.utime(foreign, (old, old))
    assert remove_stale_temp_dirs(tmp_path) == [foreign]
    assert live.exists()
