"""training/distributed/process.py and training/distributed/context.py's gradient all-reduce: a rank's start-up
preload, its exit without interpreter teardown, its CPU pinning, a scoring rank's heap, and that its polling wait
for the all-reduce always ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_exit_without_teardown_flushes_output_and_skips_atexit():
    done = run_python(
        """
        import atexit, sys
        from training.distributed.process import exit_without_teardown
        atexit.register(lambda: print("teardown ran"))
        print("buffered line", end="")   # stdout is a pipe: block-buffered, lost unless flushed
        print("buffered error", end="", file=sys.stderr)
        exit_without_teardown(3)
        """
    )
    assert done.returncode == 3
    assert done.stdout == "buffered line" and done.stderr == "buffered error"  # flushed, and no atexit output


HEAP_FAULTS = """
    import ctypes, resource, sys
    from training.distributed.process import keep_freed_heap
    if sys.argv[1] == "keep":
        assert keep_freed_heap()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 8 << 20  # a forward pass's intermediate tensors: a few of 8 MiB each, all freed by the call's end
    def call():
        blocks = [libc.malloc(size) for _ in range(3)]
        for block in blocks:
            ctypes.memset(block, 1, size)  # touched, as a tensor's values are
        for block in blocks:
            libc.free(block)
    call()  # the first call faults its pages in either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        call()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_scoring_ranks_heap_reuses_freed_blocks_instead_of_faulting_in_fresh_pages():
    """Three 8 MiB blocks freed together leave 24 MiB free at the top of the heap: glibc's default returns it to
    the kernel (its trim threshold follows the largest freed block: 16 MiB here) and faults in fresh pages on the
    next call; with ``keep_freed_heap`` the blocks are reused (training/distributed/process.py)."""
    pages_per_call = 3 * (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    faults = {}
    for mode in ("default", "keep"):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(HEAP_FAULTS), mode], cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        faults[mode] = int(done.stdout)
    assert faults["keep"] < pages_per_call // 10, faults  # 20 calls: fewer faults than a tenth of one call's pages
    assert faults["default"] > 10 * pages_per_call, faults  # the test's pattern does fault without it


def test_preload_imports_in_the_background_and_drops_its_errors():
    done = run_python(
        """
        import sys
        from training.distributed.process import preload_in_background
        assert "torch._dynamo" not in sys.modules
        preload_in_background().join(120)
        print("torch._dynamo" in sys.modules)
        preload_in_background(("no_such_module_for_ddpflow",)).join(10)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True" and "no_such_module" not in done.stderr


def test_cpu_affinity_pins_threads_that_started_before_it():
    """gloo's threads start when the group is joined, before the rank configures its cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to see a rank pinned to a part of them")
    done = run_python(
        """
        import os, threading
        from training.core.config import TrainConfig
        from training.distributed.process import configure_cpu
        started, stop = threading.Event(), threading.Event()
        def early():
            started.set(); stop.wait()
        thread = threading.Thread(target=early); thread.start(); started.wait()
        cores = len(os.sched_getaffinity(0))
        print(configure_cpu(TrainConfig(cpu_affinity=True), local_rank=1, local_world_size=cores).describe())
        thread_cores = os.sched_getaffinity(thread.native_id)
        print(sorted(os.sched_getaffinity(0)) == sorted(thread_cores), len(thread_cores))
        stop.set()
        """
    )
    assert done.returncode == 0, done.stderr
    described, same = done.stdout.splitlines()
    assert "pinned to cores" in described and same == "True 1"


# --- training/distributed/context.py: poll, a poll always ends (its arithmetic: test_train_ddp.py) ---


def test_polling_returns_once_every_future_is_done():
    import threading

    import torch

    from training.distributed.context import poll

    futures = [torch.futures.Future() for _ in range(2)]
    timers = [threading.Timer(0.02 * (i + 1), future.set_result, (i,)) for i, future in enumerate(futures)]
    for timer in timers:
        timer.start()
    poll(futures, limit_s=60)
    assert all(future.done() for future in futures)


def test_polling_gives_up_at_its_limit_and_leaves_the_wait_to_ddp():
    """A peer that is more than a step behind (or stalled): the rank stops polling and DDP's own wait,
    with its timeout, takes over."""
    import torch

    from training.distributed.context import poll

    never = torch.futures.Future()
    poll([never], limit_s=0.05)
    assert not never.done()


def test_a_ranks_error_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun's agent parses a failed rank's TORCHELASTIC_ERROR_FILE: a rank stopped in the middle of torch's
    plain write left an empty one, and the agent crashed on it instead of restarting the group."""
    from training.distributed.process import ERROR_FILE_ENV, AtomicErrorHandler

    target = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(target))
    seen_during_write = []
    plain_dump = json.dump

    def dump_and_look(data, handle, *args, **kwargs):  # torch's record_exception writes with json.dump
        seen_during_write.append((handle.name, target.exists()))
        plain_dump(data, handle, *args, **kwargs)

    monkeypatch.setattr(json, "dump", dump_and_look)
    AtomicErrorHandler().record_exception(ValueError("bad row 7"))

    assert seen_during_write and all(path != str(target) and not existed for path, existed in seen_during_write)
    assert json.loads(target.read_text())["message"]["message"] == "ValueError: bad row 7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"], "no temp file is left"
    assert os.environ[ERROR_FILE_ENV] == str(target)
