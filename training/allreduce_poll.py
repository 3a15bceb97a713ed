"""CPU ranks poll for the gradient all-reduce instead of sleeping in it.

Why: a rank that reaches DDP's gradient all-reduce before its peer blocks, its
core goes idle, and on virtual machines (and with deep CPU idle states) the
idle core is woken late when the peer's data arrives, often a whole scheduler
tick. CPU ranks never arrive together, so nearly every step paid that wake-up:
on the 2-core benchmark machine the synchronisation cost as much as the step's
compute (docs/benchmarks.md, "DDP scaling"). MPI libraries poll for the same
reason. Here the rank's main thread yields its core (``sched_yield``) in a loop
until the all-reduce is done: gloo's threads, pinned to the same cores, run
the moment they are woken, and the core never goes idle.

This changes nothing in the arithmetic: the hook is torch's own
``allreduce_hook`` (what DDP does without a hook); only the way the rank waits
for the LAST bucket differs. Earlier buckets still overlap the backward pass.

Only for ranks with cores of their own (``train.cpu_affinity``): a rank that
polls on a core another rank computes on would slow that rank down.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

# Past this, the wait is not a peer a step behind but a slow or stalled one: sleep in the backend's
# own wait, which also raises its timeout as usual.
POLL_LIMIT_S = 0.1


def wants_polling(setting: bool | Literal["auto"], device: torch.device, world_size: int, pinned: bool) -> bool:
    """``train.cpu_poll_allreduce``: true polls on any CPU rank; auto only when each rank is pinned to its own cores."""
    if device.type != "cpu" or world_size < 2 or setting is False:
        return False
    return setting is True or pinned


@dataclass
class PollState:
    """The hook's state: the group, and the buckets of this step still in flight."""

    process_group: dist.ProcessGroup | None
    poll_limit_s: float = POLL_LIMIT_S
    in_flight: list[torch.futures.Future] = field(default_factory=list)


# No ``from __future__ import annotations`` here: DDP checks this hook's annotations as objects.
def polling_allreduce_hook(state: PollState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook``; once the step's last bucket is launched, poll until all are done."""
    future = allreduce_hook(state.process_group, bucket)
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
