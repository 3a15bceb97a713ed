"""Opt-in (``train.cpu_poll_allreduce``, default false): CPU ranks poll for the gradient all-reduce
instead of sleeping in it.

When it helps: a rank that reaches DDP's gradient all-reduce before its peer
blocks, its core goes idle, and on some virtual machines (and with deep CPU
idle states) the idle vCPU is woken late when the peer's data arrives, often a
whole scheduler tick. There nearly every step pays that wake-up (on the 2-core
benchmark VM the synchronisation cost as much as the step's compute:
docs/benchmarks.md, "DDP scaling"). MPI libraries poll for the same reason.
Here the rank's main thread yields its core (``sched_yield``) in a loop until
the all-reduce is done: gloo's threads, pinned to the same cores, run the
moment they are woken, and the core never goes idle.

What it costs: the polling core stays busy for up to ``POLL_LIMIT_S`` (0.1 s)
every step. On a real machine those cycles come from its hyperthread sibling
or from the rank's data-loading workers, which is why it is not the default.
A rank that polls on a core another rank computes on slows that rank down, so
``auto`` polls only ranks pinned to cores of their own (``train.cpu_affinity``).

The arithmetic is DDP's own, bit for bit: without a hook DDP multiplies each
gradient by ``1 / world_size`` while copying it into its bucket, then
all-reduces the bucket with SUM; ``ddp_average`` does the same to the bucket.
(torch's ``allreduce_hook`` DIVIDES by the world size instead: for a world
size that is not a power of two, ``x / 3`` and ``x * (1 / 3)`` differ in the
last bit, for 40% of a small MLP's gradient values.) Polling with W ranks trains the
weights that not polling does (tests/training/test_train_ddp.py, W=2 and W=3).
Only the way the rank waits for the LAST bucket differs; earlier buckets still
overlap the backward pass.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# Past this, the wait is not a peer a step behind but a slow or stalled one: sleep in the backend's
# own wait, which also raises its timeout as usual.
POLL_LIMIT_S = 0.1


def wants_polling(setting: bool | Literal["auto"], device: torch.device, world_size: int, pinned: bool) -> bool:
    """``train.cpu_poll_allreduce``: false (the default) never polls; true polls on any CPU rank with a peer;
    auto only when each rank is also pinned to cores of its own."""
    if device.type != "cpu" or world_size < 2 or setting is False:
        return False
    return setting is True or pinned


@dataclass
class PollState:
    """The hook's state: the group, and the buckets of this step still in flight."""

    process_group: dist.ProcessGroup
    poll_limit_s: float = POLL_LIMIT_S
    in_flight: list[torch.futures.Future] = field(default_factory=list)


def ddp_average(group: dist.ProcessGroup, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The mean over ranks exactly as DDP computes it without a hook: times ``1 / world_size``, then SUM."""
    bucket.mul_(1.0 / group.size())
    return dist.all_reduce(bucket, group=group, async_op=True).get_future().then(lambda done: done.value()[0])


# No ``from __future__ import annotations`` here: DDP checks this hook's annotations as objects.
def polling_allreduce_hook(state: PollState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own average of the bucket; once the step's last bucket is launched, poll until all are done."""
    future = ddp_average(state.process_group, bucket.buffer())
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


def register_polling_allreduce(ddp: DistributedDataParallel) -> None:
    """Make ``ddp`` poll for its gradient all-reduce (the module docstring says why)."""
    ddp.register_comm_hook(PollState(ddp.process_group), polling_allreduce_hook)
