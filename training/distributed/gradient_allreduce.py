"""DDP's gradient all-reduce as a training rank runs it: one comm hook (``GradientAllReduce``) that averages each
bucket exactly as DDP does without a hook, carries the ranks' stop flags on the first bucket of every optimizer
step, and, opt-in (``train.cpu_poll_allreduce``), makes a CPU rank poll for the all-reduce instead of sleeping in it.

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

import os
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

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


class Watch(Protocol):
    """What the hook reads of a rank's stop signal (training/loop/preemption.py: ``PreemptionWatch``)."""

    signum: int | None  # the first signal received, None until then


@dataclass
class GradientAllReduce:
    """The hook's state (module docstring): whether to poll, this rank's stop flag, and what the step's
    all-reduce carries back."""

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


# No ``from __future__ import annotations`` here: DDP checks this hook's annotations as objects.
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
