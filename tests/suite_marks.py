"""The suite's marks, the guard that keeps them true, and the opt-in reversed module order.

Marks (declared in pyproject.toml), so `make test-fast` can leave out everything heavy:
  torchrun  the test starts ranks: torchrun, directly, through the pipeline, a CLI run or a Slurm job
  server    it starts or uses a server: the session's Prefect harness, the stack, a temporary
            Prefect server, an MLflow server, moto's S3
  slurm     it uses the session's two-node Slurm cluster

``server`` and ``slurm`` come from the fixtures a test uses (MARKS_FROM_FIXTURES), so no test
repeats them; ``torchrun`` and a server a test starts itself are written on the test or module.

The guard: while a test sets up and runs, a thread looks at the processes below this one every
WATCH_INTERVAL_S, and a test that starts a process of a kind it is not marked for fails, naming
the process. A server or rank lives for seconds, far longer than the interval. What the guard
cannot see: a server on a thread of this process (moto), and processes that left this tree
before the next look (the stack's servers are seen while `ddpflow stack up` waits for them).

``--reverse-modules`` runs the modules in reverse order (each module's tests in their own order):
a test that needs another module's leftovers fails there.

In pytest-xdist's workers (``make test``: ``-n auto --dist loadfile``, a module's tests on one worker, so
its module-scoped fixtures are built once), ``heaviest_modules_first`` orders the modules by how many
heavy tests they hold: xdist hands out modules in collection order, and a long module handed out last
would keep one worker busy while the others idle.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import psutil
import pytest

HEAVY_MARKS = ("torchrun", "server", "slurm")
MARKS_FROM_FIXTURES = {"prefect_harness": "server", "slurm_cluster": "slurm"}
WATCH_INTERVAL_S = 0.25

SERVER_ARGV_PARTS = (
    "prefect.server.api.server:create_app",  # Prefect's temporary server and the test harness
    " prefect server start",
    " prefect worker start",
    " mlflow server",
    "mlflow.server",  # its gunicorn or uvicorn workers
)
SLURM_PROGRAMS = {"slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "salloc"}


TORCHRUN_MODULES = ("torch.distributed.run", "ddpflow.launch.agent")  # torchrun, and torchrun as ddpflow starts it


def starts_ranks(argv: Sequence[str]) -> bool:
    return any(arg in TORCHRUN_MODULES or os.path.basename(arg) == "torchrun" for arg in argv)


def is_server(argv: Sequence[str]) -> bool:
    command = " " + " ".join(argv)
    return any(part in command for part in SERVER_ARGV_PARTS)


def is_slurm(argv: Sequence[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]) in SLURM_PROGRAMS


KIND_OF_PROCESS: dict[str, Callable[[Sequence[str]], bool]] = {
    "torchrun": starts_ranks,
    "server": is_server,
    "slurm": is_slurm,
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse-modules",
        action="store_true",
        help="run the test modules in reverse order (each module's tests in file order)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_WATCHES] = {}


@pytest.hookimpl(tryfirst=True)  # before -m selects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, mark in MARKS_FROM_FIXTURES.items():
            if fixture in item.fixturenames:
                item.add_marker(mark)
    if config.getoption("reverse_modules"):
        items[:] = modules_reversed(items)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (not the env var: pytester's runs inherit it)
        items[:] = heaviest_modules_first(items)


def modules_reversed(items: list[pytest.Item]) -> list[pytest.Item]:
    return [item for module in reversed(items_by_module(items)) for item in module]


def heaviest_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items module by module, the modules with the most heavy tests (ranks, servers, Slurm) first; each
    module's tests, and modules of as many heavy tests, keep their order (every worker must collect the same)."""
    ordered = sorted(items_by_module(items), key=lambda module: -sum(map(is_heavy, module)))  # a stable sort
    return [item for module in ordered for item in module]


def items_by_module(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """Each module's items, in their order, the modules in the order of their first item."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(str(item.path), []).append(item)
    return list(by_module.values())


def is_heavy(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(kind) for kind in HEAVY_MARKS)


class ProcessWatch:
    """Collects the processes below this one that appear while it runs and are of a kind in ``kinds``."""

    def __init__(self, kinds: Sequence[str]):
        self.kinds = kinds
        self.found: dict[str, list[str]] = {}
        self._known = set(self._descendants())  # what ran before the test: the session's servers, say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="suite-marks-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _descendants() -> set[tuple[int, float, tuple[str, ...]]]:
        """(pid, start time, argv) of every process below this one. The argv is part of the key: a child
        just forked still shows this process's argv, and shows its own once it has exec'd."""
        found = set()
        for process in psutil.Process().children(recursive=True):
            try:
                found.add((process.pid, process.create_time(), tuple(process.cmdline())))
            except psutil.Error:
                continue  # gone already, or not readable yet: the next look sees it if it lives
        return found

    def _watch(self) -> None:
        while True:
            self._look()
            if self._stop.wait(WATCH_INTERVAL_S):
                return

    def _look(self) -> None:
        for key in self._descendants() - self._known:
            self._known.add(key)
            argv = key[2]
            for kind in self.kinds:
                if KIND_OF_PROCESS[kind](argv):
                    self.found.setdefault(kind, []).append(" ".join(argv)[:200])

    def stop(self) -> dict[str, list[str]]:
        self._stop.set()
        self._thread.join()
        self._look()
        return self.found


_WATCHES = pytest.StashKey[dict[str, ProcessWatch]]()


def unmarked_kinds(item: pytest.Item) -> list[str]:
    return [kind for kind in HEAVY_MARKS if item.get_closest_marker(kind) is None]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    kinds = unmarked_kinds(item)
    if kinds:
        item.config.stash[_WATCHES][item.nodeid] = ProcessWatch(kinds)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # a failing test keeps its own failure; its watch ends at teardown
    found = end_watch(item)
    if found:
        started = "; ".join(f"{kind}: {argvs[0]}" for kind, argvs in found.items())
        marks = ", ".join(f"@pytest.mark.{kind}" for kind in found)
        pytest.fail(
            f"this test started processes it is not marked for ({started}); add {marks} (tests/suite_marks.py)",
            pytrace=False,
        )
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    end_watch(item)


def end_watch(item: pytest.Item) -> dict[str, list[str]]:
    watch = item.config.stash[_WATCHES].pop(item.nodeid, None)
    return watch.stop() if watch else {}
