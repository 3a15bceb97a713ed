"""bench/families/slurm.py: the Slurm family is recorded as skipped, with the reason, where Slurm cannot run."""

from __future__ import annotations

import json

from bench.__main__ import main, parse_args
from bench.families import slurm
from bench.harness.context import Context


def test_make_bench_runs_the_slurm_family_and_records_it_skipped_where_slurm_is_missing(tmp_path, monkeypatch):
    assert "slurm" in parse_args([]).families, "`make bench` (no --only) includes it"
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    out = tmp_path / "results.json"
    argv = ["--quick", "--only", "slurm", "--no-docs", "--out", str(out), "--workdir", str(tmp_path / "work")]
    main(argv)
    [recorded] = json.loads(out.read_text())["benchmarks"]
    assert recorded["name"] == "slurm" and recorded["status"] == "skipped", recorded
    assert "sbatch" in recorded["reason"], recorded


def test_without_the_slurm_programs_the_family_is_skipped_naming_what_is_missing(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    [result] = slurm.run(Context.create(quick=True, gpu=False, workdir=str(tmp_path / "work")))
    assert result.status == "skipped" and result.name == "slurm"
    assert "sbatch" in result.reason and "slurmd" in result.reason, result.reason
    assert not (tmp_path / "work" / "slurm-cluster").exists(), "no cluster was started"
