"""Per-process settings of a rank: orphan protection, CPU threads and cores, CUDA math modes, the
all-reduce's wait (``configure_process``: all of them, as every rank and bench/ranks/ddp.py's
``--ranks ddpflow`` take them), the two start-up/exit costs a rank can avoid (DDP's lazy imports, interpreter
teardown), and a scoring rank's heap (``keep_freed_heap``)."""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from training.core.config import TrainConfig
from training.core.fileio import atomic_path
from training.distributed.context import DistContext, wants_polling

_PR_SET_PDEATHSIG = 1
# glibc's mallopt parameters, and what a scoring rank sets them to (``keep_freed_heap``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold, fixed from the start
HEAP_TRIM_THRESHOLD = 64 << 20  # the most freed heap a rank keeps: its cost in memory


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent (the torchrun agent) dies.

    If the agent is SIGKILLed (a cancelled task, an OOM kill) it cannot stop its
    workers, and orphaned ranks would hold cores, GPUs and ports. SIGKILL, not
    SIGTERM: a rank answers SIGTERM as a preemption (training/loop/preemption.py:
    save at the next step, then a barrier through the agent's store, which is gone
    with the agent). A stop meant to save reaches the ranks through torchrun, which
    forwards it. No-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the parent died before the call took effect
            os.kill(os.getpid(), signal.SIGKILL)
    except (OSError, AttributeError):
        return


@dataclass(frozen=True)
class CpuSetup:
    """What ``configure_cpu`` gave this rank: its intra-op threads, and its cores when pinned."""

    threads: int
    cores: tuple[int, ...] = ()

    @property
    def pinned(self) -> bool:
        return bool(self.cores)

    def describe(self) -> str:
        pinned = f", pinned to cores {self.cores[0]}-{self.cores[-1]}" if self.cores else ""
        return f"{self.threads} threads{pinned}"


def configure_cpu(train: TrainConfig, local_rank: int, local_world_size: int, pin: bool = True) -> CpuSetup:
    """Threads and cores of a CPU rank.

    Ranks on one node share its cores. Each rank gets cores // local ranks
    intra-op threads (torchrun would otherwise force OMP_NUM_THREADS=1), and
    with ``train.cpu_affinity`` it is pinned to its own slice of the allowed
    cores: the OS then does not migrate threads between ranks, caches stay
    warm, and ranks do not steal each other's cores mid-step (which stalls the
    whole group at the next all-reduce). GPU ranks (``pin=False``) only get
    their thread share: their CPU work is batch gathering, and core placement
    there is the node's NUMA business.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = len(allowed) // max(1, local_world_size)
    cores: list[int] = []
    if pin and train.cpu_affinity and share >= 1 and hasattr(os, "sched_setaffinity"):
        cores = allowed[local_rank * share : (local_rank + 1) * share]
        _pin_every_thread(cores)
    threads = train.num_threads or max(1, share)
    torch.set_num_threads(threads)
    return CpuSetup(threads, tuple(cores))


def _pin_every_thread(cores: list[int]) -> None:
    """Pin all of this process's threads, not only the caller: the process group's
    communication threads already exist, and a gloo thread woken on the other rank's
    core waits there for the scheduler instead of running on its own idle one."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: threads created from now on inherit the caller's mask
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass


MAX_AUTO_WORKERS = 8  # a GPU rank's decode workers under train.num_workers: auto
# A CPU rank's: one per this many of its cores, none below (docs/training.md: the worker core rule).
CPU_CORES_PER_WORKER = 4


def decode_workers(requested: int | str, cpu: CpuSetup, on_gpu: bool, decodes: bool) -> int:
    """``train.num_workers`` resolved: an int as given; ``auto`` is 0 unless an input is decoded per batch
    (``decodes``: an image), else from the rank's cores (``cpu.threads``, its share of the node): a GPU rank,
    min(8, its cores - 1) (its own CPU work is light: the GPU steps); a CPU rank, one per 4 of its cores and
    none below 4. Why none: a worker takes a core from the step (``make_room_for_workers``), which on a rank
    of 2 cores halves it; measured there, decoding in the rank beat a worker on cheap images by 1.5x and lost
    to it (0.76x) only where one image cost as much to decode as to train on (bench/families/images.py:
    ``worker_rule``)."""
    if requested != "auto":
        return int(requested)
    if not decodes:
        return 0
    if on_gpu:
        return max(1, min(MAX_AUTO_WORKERS, cpu.threads - 1))
    return cpu.threads // CPU_CORES_PER_WORKER


def make_room_for_workers(cpu: CpuSetup, workers: int, train: TrainConfig) -> CpuSetup:
    """The worker core rule: a pinned CPU rank's decode workers run on the rank's own cores (they inherit its
    pinning, with one torch thread each, DataLoader's default), and the rank's intra-op threads shrink by as
    many (at least 1): threads + workers = its cores, so a worker decodes on a core of its own instead of
    preempting the step's threads, and no rank's workers take another rank's cores. An explicit
    ``train.num_threads`` and unpinned (GPU) ranks keep their threads."""
    if not workers or not cpu.pinned or train.num_threads:
        return cpu
    threads = max(1, len(cpu.cores) - workers)
    torch.set_num_threads(threads)
    return CpuSetup(threads, cpu.cores)


def configure_cuda(train: TrainConfig) -> str:
    # TF32 matmuls keep fp32 range with a 10-bit mantissa: several times faster on
    # Ampere+ for the fp32 parts of the step, and harmless for training.
    torch.set_float32_matmul_precision("high" if train.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = train.tf32
    return f"bf16 autocast {'on' if train.bf16 else 'off'}, tf32 {'on' if train.tf32 else 'off'}"


@dataclass(frozen=True)
class ProcessSetup:
    """What ``configure_process`` settled for this rank."""

    cpu: CpuSetup
    poll_allreduce: bool  # train.cpu_poll_allreduce, resolved (training/distributed/context.py: wants_polling)
    cuda: str = ""  # the CUDA math modes, on a GPU rank

    def with_workers(self, workers: int, train: TrainConfig) -> ProcessSetup:
        """This setup once ``workers`` decode workers per rank share its cores (``make_room_for_workers``)."""
        return replace(self, cpu=make_room_for_workers(self.cpu, workers, train))

    def describe(self) -> str:
        parts = [self.cpu.describe(), *([self.cuda] if self.cuda else [])]
        parts += ["polling for the gradient all-reduce"] if self.poll_allreduce else []
        return ", ".join(parts)


def configure_process(train: TrainConfig, ctx: DistContext) -> ProcessSetup:
    """Threads and cores (pinned on CPU ranks only), CUDA math modes on GPU ranks, and whether to poll."""
    on_gpu = ctx.device.type == "cuda"
    cpu = configure_cpu(train, ctx.local_rank, ctx.local_world_size, pin=not on_gpu)
    poll = wants_polling(train.cpu_poll_allreduce, ctx.device, ctx.world_size, cpu.pinned)
    return ProcessSetup(cpu, poll, configure_cuda(train) if on_gpu else "")


def keep_freed_heap() -> bool:
    """Keep freed memory in this process's heap for the next allocation (glibc's malloc; False elsewhere).

    glibc hands memory back to the kernel eagerly: a block above its mmap threshold (128 KiB at first) is
    mapped for the allocation and unmapped when freed, and a free top of the heap above the trim threshold
    is returned. A forward pass's intermediate tensors (megabytes each, freed within the call) then come back
    as fresh pages on every call, each page a fault in the kernel: 27-44% of a scoring rank's CPU time, and its
    first 100k rows cost 1.5 x the next (docs/benchmarks.md, "Batch scoring"). With the threshold fixed at
    ``HEAP_MMAP_THRESHOLD`` and up to ``HEAP_TRIM_THRESHOLD`` of free heap kept, the blocks
    are reused. Cost: up to that much freed memory stays in the process (its peak is unchanged).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    )


def exit_without_teardown(code: int = 0) -> None:
    """End a rank whose work is done, skipping the interpreter's teardown.

    Why: with torch (and torch._dynamo, which DDP imports) loaded, tearing the
    interpreter down takes 0.4-0.9 s per process on a small CPU, and torchrun
    reports the group finished only when its slowest rank has gone. Only call
    this after the process group is destroyed and every file is closed (the
    checkpoints are fsynced): what is skipped is freeing memory that the
    kernel frees anyway. Streams are flushed here because their buffers would
    be lost.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# DDP's constructor imports torch._dynamo: about 1 s of a small CPU's time, before the first step.
DDP_LAZY_IMPORTS = ("torch._dynamo",)


def preload_in_background(modules: tuple[str, ...] = DDP_LAZY_IMPORTS) -> threading.Thread:
    """Import ``modules`` on a daemon thread, so the import overlaps the rank's waiting.

    Why: a rank spends its first seconds waiting (rendezvous, the process
    group, reading its split, CUDA's context) and then, in DDP's constructor,
    importing torch._dynamo. Started first, the import runs during the waits;
    the main thread's own import later just finds the module (or waits for this
    thread to finish it). An error here is dropped: the main thread's import
    raises it again where it matters.
    """

    def preload() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:
                return

    thread = threading.Thread(target=preload, name="preload-imports", daemon=True)
    thread.start()
    return thread


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun tells each rank to write its error


class AtomicErrorHandler(ErrorHandler):
    """torch's ``@record`` error file, written to a temp name and renamed into place.

    Why: torch writes ``TORCHELASTIC_ERROR_FILE`` with a plain ``open(path, "w")``. When a peer dies, the agent
    stops this rank, and a rank stopped between that open and its write leaves an empty file; the agent then
    fails parsing it (``JSONDecodeError`` in ``ProcessFailure``) instead of restarting the group. Seen once in
    CI in test_train_ddp's killed-rank resume. A rename is atomic: the agent finds the whole file or none.
    """

    def record_exception(self, e: BaseException) -> None:
        target = os.environ.get(ERROR_FILE_ENV)
        if not target:
            super().record_exception(e)
            return
        try:
            with atomic_path(target, durable=False) as partial:  # torch writes the file by the name it is given
                os.environ[ERROR_FILE_ENV] = str(partial)
                super().record_exception(e)
        finally:
            os.environ[ERROR_FILE_ENV] = target


def record_root_cause(main: Callable[..., None]) -> Callable[..., None]:
    """torch's ``@record`` with ``AtomicErrorHandler``: a failing rank's traceback reaches torchrun as the root
    cause. Every rank entry point (training.train, tests/multi_case.py) is wrapped by this one."""
    return record(main, error_handler=AtomicErrorHandler())
