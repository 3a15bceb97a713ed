"""Everything distributed, in one place: process group, device, DDP and its gradient all-reduce, collectives.

Ranks are started by ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Without them (a person running one rank by hand) this is a one-rank group on
a free loopback port, so the same code path runs.

Models (``training.models.registry``) and the loop (``training.loop.step``) never call
``torch.distributed`` themselves; they get a ``DistContext``.

**DDP's gradient all-reduce** as a training rank runs it: one comm hook (``GradientAllReduce``, registered by
``wrap_model``) that averages each bucket exactly as DDP does without a hook, carries the ranks' stop flags on the
first bucket of every optimizer step, and, opt-in (``train.cpu_poll_allreduce``), makes a CPU rank poll for the
all-reduce instead of sleeping in it.

**The arithmetic is DDP's own, bit for bit**: without a hook DDP multiplies each gradient by ``1 / world_size``
while copying it into its bucket, then all-reduces the bucket with SUM; ``GradientAllReduce`` does the same to the
bucket. (torch's ``allreduce_hook`` DIVIDES by the world size instead: for a world size that is not a power of
two, ``x / 3`` and ``x * (1 / 3)`` differ in the last bit, for 40% of a small MLP's gradient values.)

**The stop flags ride on the gradients.** Every rank must learn of a stop (a signal to any one rank:
training/loop/preemption.py) at the same optimizer step, which takes a collective; one of its own on every step
costs a round trip through the backend, as dear as the gradients' own all-reduce for a small model on CPU ranks.
So the hook appends this rank's flag (1 once its ``watch`` received a signal, else 0) to bucket 0 of every backward that
all-reduces (the last micro-batch of an optimizer step: the others run under ``no_sync``) and all-reduces the
two together: the gradients come back as DDP would have them, and the last element is the number of ranks told to
stop, the same on every rank. ``take_flags`` hands that number to the loop once per step (training/loop/step.py:
``StopFlags``). Bucket 0 is the one DDP launches first and keeps small (about 1 MB at most), so the copy that
appends the flag costs little, and the flag is read as early in the step as a collective allows.

**Polling** (opt-in). When it helps: a rank that reaches DDP's gradient all-reduce before its peer blocks, its core
goes idle, and on some virtual machines (and with deep CPU idle states) the idle vCPU is woken late when the peer's
data arrives, often a whole scheduler tick. There nearly every step pays that wake-up (on the 2-core benchmark VM
the synchronisation cost as much as the step's compute: docs/benchmarks.md, "DDP scaling"). MPI libraries poll
for the same reason. Here the rank's main thread yields its core (``sched_yield``) in a loop until the all-reduce
is done: gloo's threads, pinned to the same cores, run the moment they are woken, and the core never goes idle.
What it costs: the polling core stays busy for up to ``POLL_LIMIT_S`` (0.1 s) every step. On a real machine
those cycles come from its hyperthread sibling or from the rank's data-loading workers, which is why it is not
the default. A rank that polls on a core another rank computes on slows that rank down, so ``auto`` polls only
ranks pinned to cores of their own (``train.cpu_affinity``). Polling with W ranks trains the weights that not
polling does (tests/training/test_train_ddp.py, W=2 and W=3). Only the way the rank waits for the LAST bucket
differs; earlier buckets still overlap the backward pass.
"""

# No ``from __future__ import annotations``: DDP checks its comm hook's annotations as objects.

import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.core import topology
from training.core.config import TrainConfig
from training.core.fileio import log_rank

# DDP's default puts the first gradient bucket at 1 MiB and the rest at 25 MiB,
# so even a small model pays two all-reduces per step. Passing the cap
# explicitly makes the first bucket that size too: any model whose gradients
# fit in 25 MiB is reduced in ONE all-reduce; bigger models keep 25 MiB
# buckets, which overlap communication with the rest of the backward pass.
BUCKET_CAP_MB = 25


class DistributedSetupError(RuntimeError):
    """The process cannot join the group as configured (backend, device)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited ``train.collective_timeout_s`` for a peer that never came: a rank stalled or died."""


class CheckpointTimeout(CollectiveTimeout):
    """Rank 0 did not finish writing a checkpoint within ``train.checkpoint_timeout_s``."""


# gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL's watchdog:
# "... ran for 5000 milliseconds before timing out"; the store: "... wait timeout ...".
_TIMEOUT_TEXT = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    checkpoint_timeout_s: float = 1800.0
    # gloo group whose only collective is the barrier after a checkpoint write (its own timeout).
    checkpoint_group: Any = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def checkpoint_barrier(self, path: str | os.PathLike) -> None:
        """Wait until rank 0 has written ``path``, for up to ``train.checkpoint_timeout_s``.

        A large checkpoint on a slow shared filesystem can take longer than any
        collective should: the wait runs on a group of its own whose timeout is
        the checkpoint's, so ``train.collective_timeout_s`` can stay short.
        """
        try:
            dist.barrier(group=self.checkpoint_group)
        except RuntimeError as error:
            if not _TIMEOUT_TEXT.search(str(error)):
                raise
            raise CheckpointTimeout(
                f"rank {self.rank}: rank 0 did not finish writing {path} within "
                f"train.checkpoint_timeout_s={self.checkpoint_timeout_s:g}s (a slow filesystem? raise "
                f"train.checkpoint_timeout_s for large checkpoints): {str(error).strip()}"
            ) from error

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; only for our own small objects)."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce_sum(self, values: Sequence[float | torch.Tensor]) -> list[float]:
        """Element-wise sums over ranks, in float64 so counts stay exact."""
        local = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).to(self.device) for v in values])
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return local.tolist()

    def all_reduce_int_sum(self, values: Sequence[int]) -> list[int]:
        """Element-wise sums over ranks in int64: exact where float64 would round (counts past 2^53)."""
        local = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return [int(value) for value in local.tolist()]

    def rank0_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a collective: every rank calls it, the others' flags are ignored)."""
        return self.all_reduce_sum([flag if self.is_main else False])[0] > 0

    def all_reduce_int_sum_async(self, values: Sequence[int]) -> Callable[[], list[int]]:
        """``all_reduce_int_sum`` started now, without waiting: call the result for the sums. Every rank must start
        it at the same point among its collectives, as for any collective."""
        local = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        work = dist.all_reduce(local, op=dist.ReduceOp.SUM, async_op=True)

        def sums() -> list[int]:
            work.wait()
            return [int(value) for value in local.tolist()]

        return sums

    def weights_agree(self, model: nn.Module) -> bool:
        """All ranks hold bit-identical parameters (compares per-tensor checksums)."""
        local = parameter_checksums(model).to(self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return all(torch.equal(gathered[0], other) for other in gathered[1:])


class SingleProcess:
    """The coordination ``Checkpointer`` needs, for one process outside torchrun (tools, tests)."""

    is_main = True
    rank = 0
    world_size = 1

    def checkpoint_barrier(self, path: str | os.PathLike) -> None:
        return None

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]


def parameter_checksums(model: nn.Module) -> torch.Tensor:
    """Sum and sum of squares of every parameter, float64: equal iff weights match (in practice)."""
    sums = []
    for param in model.parameters():
        data = param.detach().double()
        sums += [data.sum(), (data * data).sum()]
    return torch.stack(sums).cpu()


def resolve_backend(requested: str) -> str:
    """This rank's side of training/core/topology.py's rule, which the launcher applied to start it."""
    return topology.resolve_backend(requested, topology.visible_gpus())


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env() -> tuple[int, int, int, int]:
    if "RANK" not in os.environ:
        # Run by hand, without torchrun: a group of one on loopback.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_loopback_port()))
        return 0, 1, 0, 1
    return (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )


def _pick_device(local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise DistributedSetupError(
            f"LOCAL_RANK {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
            "start at most one rank per GPU (train.nproc_per_node)"
        )
    device = torch.device("cuda", local_rank)
    # Pin before any CUDA work so that NCCL and every allocation use this GPU.
    torch.cuda.set_device(device)
    return device


def _group_store(rank: int, world_size: int, local_world_size: int, timeout: timedelta) -> dist.Store:
    """The store the process group bootstraps from, isolated per torchrun restart where that is safe.

    Since torch 2.4 torchrun's c10d rendezvous shares ONE TCPStore (hosted by
    the agent) with the workers of every restart round, and the process group
    writes the same keys each time: a restarted rank can read a dead peer's
    address and time out connecting (pytorch/pytorch#135712; seen here with
    gloo). On one node all ranks share one agent and so one restart count: the
    count names a fresh key space. Agents on several nodes count restarts
    separately, so there the launcher must set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (a fresh store per round) - we warn when it is not set.
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    if local_world_size == world_size:
        return dist.PrefixStore(f"ddpflow/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        log_rank(
            "warning: torchrun shares its rendezvous store with the workers, so a restart on several nodes "
            "can hang at start-up (pytorch/pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every agent"
        )
    return store


def init_distributed(train: TrainConfig) -> DistContext:
    rank, world_size, local_rank, local_world_size = _rank_env()
    backend = resolve_backend(train.backend)
    device = _pick_device(local_rank)
    # A stalled or dead peer fails the collective after this long instead of hanging forever.
    timeout = timedelta(seconds=train.collective_timeout_s)
    dist.init_process_group(
        backend=backend,
        store=_group_store(rank, world_size, local_world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    # gloo on NCCL runs too: a CPU-side wait that needs no GPU stream and whose timeout raises here
    # (an NCCL watchdog would abort the process instead).
    checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=train.checkpoint_timeout_s))
    return DistContext(
        rank, world_size, local_rank, local_world_size, device, backend, train.checkpoint_timeout_s, checkpoint_group
    )


@contextmanager
def distributed(train: TrainConfig) -> Iterator[DistContext]:
    """Join the process group; always leave it, also on errors."""
    ctx = init_distributed(train)
    try:
        yield ctx
    except RuntimeError as error:
        # The backend's own text ("Timed out waiting 5000ms for recv") does not say that the
        # cause is ANOTHER rank; this rank's error is the one torchrun reports as the root cause.
        if isinstance(error, CollectiveTimeout) or not _TIMEOUT_TEXT.search(str(error)):
            raise
        raise CollectiveTimeout(
            f"rank {ctx.rank}: a collective timed out after train.collective_timeout_s={train.collective_timeout_s:g}s "
            f"waiting for another rank (it stalled or died): {str(error).strip()}"
        ) from error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- DDP's gradient all-reduce

# Past this, the wait is not a peer a step behind but a slow or stalled one: sleep in the backend's
# own wait, which also raises its timeout as usual.
POLL_LIMIT_S = 0.1


def wants_polling(setting: bool | Literal["auto"], device: torch.device, world_size: int, pinned: bool) -> bool:
    """``train.cpu_poll_allreduce``: false (the default) never polls; true polls on any CPU rank with a peer;
    auto only when each rank is also pinned to cores of its own."""
    if device.type != "cpu" or world_size < 2 or setting is False:
        return False
    return setting is True or pinned


class Watch(Protocol):
    """What the hook reads of a rank's stop signal (training/loop/preemption.py: ``PreemptionWatch``)."""

    signum: int | None  # the first signal received, None until then


@dataclass
class GradientAllReduce:
    """The hook's state (module docstring: DDP's gradient all-reduce): whether to poll, this rank's stop flag,
    and what the step's all-reduce carries back."""

    poll: bool = False
    watch: Watch | None = None  # None: a rank no signal stops (its flag stays 0)
    poll_limit_s: float = POLL_LIMIT_S
    group: dist.ProcessGroup | None = None  # set by ``register``: the DDP module's group
    in_flight: list[torch.futures.Future] = field(default_factory=list)  # this step's buckets, while polling
    flags: torch.futures.Future | None = None  # bucket 0's all-reduce: its last element sums the flags

    def register(self, ddp: DistributedDataParallel) -> DistributedDataParallel:
        """Make this ``ddp``'s gradient all-reduce."""
        self.group = ddp.process_group
        ddp.register_comm_hook(self, gradient_allreduce_hook)
        return ddp

    def take_flags(self) -> int | None:
        """The number of ranks told to stop, as the last optimizer step's all-reduce carried it (every rank gets the
        same number); None when no all-reduce ran since the last call."""
        if self.flags is None:
            return None
        carried, self.flags = self.flags.wait()[0], None
        return int(carried[-1].item())


def gradient_allreduce_hook(state: GradientAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own average of the bucket, the stop flags appended to bucket 0; polling once the last is launched."""
    buffer = bucket.buffer().mul_(1.0 / state.group.size())
    if bucket.index() == 0:
        told = state.watch is not None and state.watch.signum is not None
        carried = torch.cat([buffer, buffer.new_full((1,), float(told))])
        state.flags = dist.all_reduce(carried, group=state.group, async_op=True).get_future()
        future = state.flags.then(lambda done: done.value()[0][:-1])
    else:
        future = dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(lambda d: d.value()[0])
    if state.poll:
        state.in_flight.append(future)
        if bucket.is_last():
            poll(state.in_flight, state.poll_limit_s)
            state.in_flight = []
    return future


def poll(futures: list[torch.futures.Future], limit_s: float) -> None:
    """Yield the core until every future is done, or until ``limit_s`` (DDP then waits as usual)."""
    deadline = time.monotonic() + limit_s
    for future in futures:
        while not future.done():
            if time.monotonic() > deadline:
                return
            os.sched_yield()


def wrap_model(
    model: nn.Module, ctx: DistContext, allreduce: GradientAllReduce | None = None, sync_batchnorm: bool = False
) -> DistributedDataParallel:
    """DDP on this rank's device. DDP broadcasts rank 0's weights and buffers at construction. Its gradients are
    all-reduced by ``allreduce`` (``GradientAllReduce``: DDP's average, the stop flags carried along, polling where
    ``train.cpu_poll_allreduce`` says; None: a state that never polls and carries no flag).

    ``sync_batchnorm`` (train.sync_batchnorm): the model's BatchNorm layers become SyncBatchNorm, in place
    (the same parameters and buffers: model.pt keeps its keys). On a GPU the weights go channels_last (a
    no-op for a model without convolutions; faster convolutions under bf16).
    """
    if sync_batchnorm:
        convert_batchnorm(model, ctx.device)
    if ctx.device.type == "cuda":
        model.to(memory_format=torch.channels_last)
        ddp = DistributedDataParallel(
            model, device_ids=[ctx.device.index], output_device=ctx.device.index, bucket_cap_mb=BUCKET_CAP_MB
        )
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    return (allreduce or GradientAllReduce()).register(ddp)


def convert_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer below ``model`` as a SyncBatchNorm, in place. torch runs SyncBatchNorm on GPUs
    only: on a CPU rank it would fail at the first step, so this refuses it here, by name."""
    if device.type != "cuda":
        raise ValueError("train.sync_batchnorm needs GPUs: torch's SyncBatchNorm does not run on CPU ranks")
    for name, child in model.named_children():
        setattr(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
    return model


def shard_range(n_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's contiguous, unpadded share [start, stop) of ``n_rows``; shares cover every row once.

    Used for validation and batch scoring, where DistributedSampler's padding would count rows twice.
    """
    return (n_rows * rank) // world_size, (n_rows * (rank + 1)) // world_size
