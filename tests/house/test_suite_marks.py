"""tests/suite_marks.py, run on a small suite of its own (pytester, in a subprocess): the marks from fixtures,
the guard that fails an unmarked test starting a heavy process, --reverse-modules, and the order in xdist workers."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest

pytest_plugins = ["suite_marks"]


@pytest.fixture
def prefect_harness():  # stands for the session's harness: the name alone gives the mark
    return None
"""

# A process the guard takes for torchrun (an argument named torch.distributed.run), alive long enough to be seen.
STAND_IN = """
import subprocess
import sys

import pytest

STAND_IN_TORCHRUN = [sys.executable, "-c", "import time; time.sleep(1)", "torch.distributed.run"]


def test_unmarked_starts_torchrun():
    subprocess.run(STAND_IN_TORCHRUN, check=True)


@pytest.mark.torchrun
def test_marked_starts_torchrun():
    subprocess.run(STAND_IN_TORCHRUN, check=True)


def test_uses_the_harness(prefect_harness):
    pass


def test_plain():
    pass
"""

INI = """
[pytest]
addopts = -p no:cacheprovider
markers =
    torchrun: t
    server: s
    slurm: s
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))  # the inner session imports suite_marks from tests/
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a_first=STAND_IN, test_b_second="def test_in_b():\n    pass\n")
    return pytester


@pytest.mark.torchrun  # the guard of this session sees the inner session's stand-in torchrun too
def test_an_unmarked_test_that_starts_torchrun_fails_and_a_marked_one_passes(suite: pytest.Pytester):
    result = suite.runpytest_subprocess("test_a_first.py")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*not marked for (torchrun: * torch.distributed.run); add @pytest.mark.torchrun*",
            "FAILED test_a_first.py::test_unmarked_starts_torchrun*",
        ]
    )


def test_the_harness_fixture_gives_the_server_mark_and_fast_runs_leave_it_out(suite: pytest.Pytester):
    result = suite.runpytest_subprocess("-m", "server", "-v")
    result.stdout.fnmatch_lines(["*test_uses_the_harness PASSED*"])
    result.assert_outcomes(passed=1, deselected=4)
    fast = suite.runpytest_subprocess("-m", "not torchrun and not server and not slurm", "--co", "-q")
    assert "test_uses_the_harness" not in fast.stdout.str() and "test_plain" in fast.stdout.str()


def test_reverse_modules_runs_the_modules_backwards_and_each_module_in_file_order(suite: pytest.Pytester):
    listed = suite.runpytest_subprocess("--reverse-modules", "--co", "-q").stdout.lines
    tests = [line.split("::")[1] for line in listed if "::" in line]
    assert tests == [
        "test_in_b",
        "test_unmarked_starts_torchrun",
        "test_marked_starts_torchrun",
        "test_uses_the_harness",
        "test_plain",
    ]


def test_an_xdist_worker_runs_the_modules_with_the_most_heavy_tests_first(suite: pytest.Pytester):
    # Reversed, test_b_second (no heavy test) comes first; a worker puts test_a_first (its harness test) first.
    ran = suite.runpytest_subprocess("-n", "1", "-p", "xdist", "--reverse-modules", "-k", "not starts_torchrun", "-v")
    ran.assert_outcomes(passed=3)
    order = [line.rsplit("::", 1)[1].strip() for line in ran.stdout.lines if " PASSED " in line]
    assert order == ["test_uses_the_harness", "test_plain", "test_in_b"]
