"""``ddpflow.should_stop()``: whether a training script should save and return now, the same answer on every rank.

    for step, batch in enumerate(loader):
        ...
        if ddpflow.should_stop():           # every rank, at the same point of the loop
            save(ddpflow.checkpoint_dir()); return

True once any rank was told to stop: a signal (SIGTERM, SIGINT, ``train.preempt_signal``: a spot reclaim, Ctrl-C,
Slurm's time limit, or the launcher passing on a cancelled flow run's stop) or, in a sweep's trial, the pruner's
verdict (``RUN_DIR/verdicts/stop``, written by the process that follows the trial). The first call installs the
signal handlers, which only set a flag; until then a signal ends the script as Python would, and the launcher
stops the whole tree within ``train.preempt_grace_s``. Each call all-reduces one flag (MAX) over the default process
group when it has more than one rank, so every rank must call it at the same point, as for any collective; its
cost is one small all-reduce, so a script with very short steps may call it every N steps.

When a signal is the reason, rank 0 records the stop in ``RUN_DIR/preempted.json`` (the launcher then reports the
run as preempted, resumable: the same command re-runs it in the same run directory, where ``checkpoint_dir()`` holds
what the script saved). Under a bare torchrun it follows the process's own signals, and records nothing.
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from typing import Any

from ddpflow.script.run import checkpoint_dir, current_run, rank
from training.core.fileio import atomic_write_json
from training.core.layout import PREEMPTED
from training.loop.selection import stop_written

PRUNED = "the sweep's pruner"  # the reason when the verdict, not a signal, stops a trial


class _Watch:
    """This process's flag: the first signal received, or the pruner's verdict; the handlers, once installed."""

    def __init__(self) -> None:
        self.installed = False
        self.signal: str | None = None
        self.recorded = False

    def install(self, signals: tuple[signal.Signals, ...]) -> None:
        for signum in signals:
            previous = signal.getsignal(signum)
            signal.signal(signum, lambda number, frame, previous=previous: self._handle(number, frame, previous))
        self.installed = True

    def _handle(self, signum: int, frame: Any, previous: Any) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        # A handler of the script's own runs too; Python's KeyboardInterrupt does not: the stop is asked for.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)


_watch = _Watch()


def should_stop() -> bool:
    """Whether to save and return now (module doc); collective: every rank calls it at the same point."""
    run = current_run()
    if not _watch.installed:
        _watch.install(_signals(run.train if run is not None else {}))
    reason = _watch.signal or (PRUNED if run is not None and stop_written(run.run_dir) else None)
    stop = _any_rank(reason is not None)
    if stop and run is not None and rank() == 0 and not _watch.recorded and reason != PRUNED:
        _watch.recorded = True
        _record(run, reason or "a signal to another rank")
    return stop


def _signals(train: dict[str, Any]) -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT and the run's ``train.preempt_signal`` (Slurm's SIGUSR1 by default, also bare)."""
    extra = train.get("preempt_signal", "SIGUSR1")
    named = (signal.SIGTERM, signal.SIGINT, *((signal.Signals[extra],) if extra else ()))
    return tuple(dict.fromkeys(named))


def _any_rank(local: bool) -> bool:
    """``local`` OR-ed over the default process group (every rank gets the same answer); ``local`` without one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _record(run, reason: str) -> None:
    """RUN_DIR/preempted.json, as ddpflow's own ranks write it (training/loop/preemption.py), for the launcher."""
    record = {
        "signal": reason,
        "script": True,  # the script saved where it chose, in checkpoint_dir(): no step of ddpflow's own
        "checkpoint": str(checkpoint_dir()),
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(run.file(PREEMPTED), record)
