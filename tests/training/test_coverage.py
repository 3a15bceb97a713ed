"""The coverage certificate (training/loop/counting.py: Certificate) and the global batch size's config rules;
one torchrun launch: a sampler that skips a row (``DDPFLOW_FAULT=skip_row``) fails the run, naming the epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.checkpoint.identity import identity_differences, training_identity
from training.core.config import ConfigError, load_config
from training.loop.counting import Certificate, CoverageError, CoverageTally, splitmix64


def certificate_of(*parts: list[int]) -> Certificate:
    """The all-reduce of one tally per rank, as the Trainer sums them."""
    tallies = []
    for rows in parts:
        tally = CoverageTally()
        tally.add(torch.tensor(rows, dtype=torch.int64))
        tallies.append(tally.totals())
    return Certificate.from_lanes(*np.sum(tallies, axis=0).tolist())


def test_the_certificate_is_that_of_the_rows_in_any_order_and_split():
    rows = np.random.default_rng(0).permutation(1000).tolist()
    expected = Certificate.expected(1000)
    assert certificate_of(rows) == expected
    assert certificate_of(rows[::2], rows[1::2]) == expected  # two ranks
    assert certificate_of(rows[:7], rows[7:500], rows[500:]) == expected  # three
    # The sum mod 2^64 of the 64-bit mixes, exactly: the lanes lose nothing.
    assert expected.hash == sum(int(value) for value in splitmix64(np.arange(1000))) % (1 << 64)


def test_a_skipped_row_changes_the_hash_though_the_count_is_the_same():
    rows = list(range(1000))
    duplicated = [0, 0, *rows[2:]]  # row 1 skipped, row 0 twice
    got = certificate_of(duplicated)
    assert got.rows == 1000 and got != Certificate.expected(1000)
    with pytest.raises(CoverageError, match=r"^epoch 3: the coverage certificate is 1000 rows"):
        got.check(Certificate.expected(1000), 3)


def test_a_global_batch_size_replaces_the_per_rank_one():
    config = load_config(None, ["train.global_batch_size=12"])
    assert config.train.batch_size is None
    assert [config.train.rank_batch_size(w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    with pytest.raises(ConfigError, match=r"global_batch_size 12 does not divide over 5 ranks"):
        config.train.rank_batch_size(5)
    with pytest.raises(ConfigError, match=r"train\.batch_size \(64, per rank\) or train\.global_batch_size \(12"):
        load_config(None, ["train.global_batch_size=12", "train.batch_size=64"])
    # The config a rank reads back (train_config.json) is the same config.
    assert load_config(None, []).train.model_validate(config.train.model_dump(mode="json")) == config.train


def test_with_a_global_batch_size_the_world_is_not_part_of_the_identity_but_the_global_batch_is():
    def identity(*overrides: str) -> dict:
        return training_identity(load_config(None, list(overrides)), "fp")

    on_two = identity("train.global_batch_size=12", "train.nproc_per_node=2")
    elsewhere = ("train.nproc_per_node=3", "train.nnodes=2", "train.rdzv_endpoint=h:1")
    assert identity("train.global_batch_size=12", *elsewhere) == on_two
    assert identity_differences(on_two, identity("train.global_batch_size=24")) == ["train.global_batch_size 12 != 24"]
    # Without it, the per-rank batch and the world stay in (and an old identity stays what it was).
    assert identity("train.nproc_per_node=2") != identity("train.nproc_per_node=3")
    assert "global_batch_size" not in identity()["train"]
    assert identity("train.batch_size=512")["train"]["batch_size"] == 512
    assert identity()["train"]["batch_size"] == "auto"  # unresolved; a run resolves it for its data first


@pytest.mark.torchrun
def test_a_sampler_that_skips_a_row_fails_the_run_naming_the_epoch(tmp_path):
    from tests.training.test_train_ddp import launch, write_dataset

    dataset = write_dataset(tmp_path / "shards", {"train": 64, "val": 16, "test": 8}, name="fp-coverage")
    result = launch(tmp_path / "run", dataset, env={"DDPFLOW_FAULT": "skip_row:rank=1:epoch=1"}, batch_size=8)
    assert result.returncode != 0
    assert "epoch 1: the coverage certificate is 64 rows" in result.output, result.output[-3000:]
    # Epoch 0 trained every row once: its certificate was logged, as every normal epoch's is.
    (epoch0,) = result.metrics()
    assert {key: epoch0[key] for key in Certificate.expected(64).metrics()} == Certificate.expected(64).metrics()
