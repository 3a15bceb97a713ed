"""bench/slurm_launch.py: the Slurm family is recorded as skipped, with the reason, where Slurm cannot run."""

from __future__ import annotations

from bench import slurm_launch
from bench.__main__ import FAMILIES
from bench.workload import Context


def test_the_slurm_family_is_part_of_make_bench():
    assert FAMILIES["slurm"] == ("bench.slurm_launch", "Launch through Slurm")


def test_without_the_slurm_programs_the_family_is_skipped_naming_what_is_missing(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    [result] = slurm_launch.run(Context.create(quick=True, gpu=False, workdir=str(tmp_path / "work")))
    assert result.status == "skipped" and result.name == "slurm"
    assert "sbatch" in result.reason and "slurmd" in result.reason, result.reason
    assert not (tmp_path / "work" / "slurm-cluster").exists(), "no cluster was started"
