"""tests/multi_case.py without a launch: which cases may share one, and what a case that never ran shows."""

from __future__ import annotations

import pytest

from tests.multi_case import CASE_OUTPUT, case_output, check_one_launch
from training.core.config import load_config


def config(*overrides: str):
    return load_config(None, list(overrides))


def test_cases_that_differ_only_in_what_they_train_share_a_launch():
    check_one_launch({"a": config("train.lr=0.1"), "b": config("train.batch_size=8", "train.cpu_poll_allreduce=true")})


@pytest.mark.parametrize("field", ["train.nproc_per_node=3", "train.collective_timeout_s=5", "train.num_threads=2"])
def test_cases_that_differ_in_the_launch_are_refused_naming_the_field(field):
    name = field.split("=")[0]
    with pytest.raises(ValueError, match=rf"case 'b' has {name}=.*launch it separately"):
        check_one_launch({"a": config(), "b": config(field)})


def test_a_case_output_joins_the_ranks_and_names_a_rank_that_never_started(tmp_path):
    (tmp_path / CASE_OUTPUT.format(rank=0)).write_text("rank 0 line\n")
    assert case_output(tmp_path, 2) == "rank 0 line\n(rank 1 never started this case)\n"
