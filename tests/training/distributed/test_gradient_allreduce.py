"""training/distributed/context.py: GradientAllReduce on 2 real torchrun ranks
(tests/ranks/gradient_allreduce_rank.py): the stop flags ride on the gradient all-reduce, so an optimizer step makes
one collective, the gradients are those plain DDP computes, bit for bit, and every rank reads the same number of
ranks told to stop after each step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
RANK = REPO_ROOT / "tests" / "ranks" / "gradient_allreduce_rank.py"
STEPS, STOP_AT = 6, 3  # as the rank program has them

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("gradient-allreduce")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RANK), str(out)]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


def test_an_optimizer_step_makes_one_collective_with_the_gradients_plain_ddp_computes(ranks):
    for record in ranks:
        assert [step["ours"] for step in record] == [1] * STEPS  # the gradients' all-reduce, the flags on it
        assert [step["plain"] for step in record] == [1] * STEPS  # plain DDP's own, for the same step
        assert all(step["identical"] for step in record), record  # W=2: DDP's arithmetic bit for bit


def test_every_rank_reads_the_flags_after_the_step_that_carried_them(ranks):
    expected = [int(step >= STOP_AT) for step in range(STEPS)]  # rank 1 told to stop from step 3 on
    for record in ranks:
        assert [step["flags"] for step in record] == expected
        assert all(step["flags_between"] == [None] for step in record)  # a no_sync micro-batch carries nothing
