"""How a foreground ``ddpflow`` command ends: every signal that ends it goes through its cleanup.

    with ended_by_signals():   # SIGTERM, SIGHUP and the parent's death raise Terminated
        ...                    # every ``finally`` below runs, whatever ends the command
    with shielded():           # cleanup that a second Ctrl-C must not cut short

Python turns SIGINT (Ctrl-C) into KeyboardInterrupt, so ``finally`` blocks run.
SIGTERM (``kill``, a scheduler, a container runtime) and SIGHUP (the terminal
closes) by default end the process on the spot: no ``finally``, no atexit hook,
and whatever the command started, the temporary Prefect server first of all,
is orphaned. Inside ``ended_by_signals()`` both raise ``Terminated`` instead, a
``SystemExit`` whose status is 128 + the signal's number, as a shell reports it.

The parent's death: on Linux the command asks for SIGHUP when the process that
started it dies (PR_SET_PDEATHSIG), so a wrapper script or a supervisor that is
SIGKILLed takes the run down with it, through the same cleanup. Linux ties this
to the parent *thread*: a parent that starts ddpflow from a thread and then ends
that thread ends the command too.

``nohup`` (or any parent that starts the command with SIGHUP ignored) opts out
of both: an ignored SIGHUP stays ignored and no parent-death signal is asked
for, so the run outlives its terminal and its parent, as nohup promises.

With Prefect: while a flow runs, Prefect's own SIGTERM handler replaces this one
(it raises TerminationSignal so the flow run is marked crashed); when the flow
has unwound, Prefect puts this handler back and sends SIGTERM again, which then
raises ``Terminated`` here, so the command's cleanup still runs.

Plain Python, no Prefect: used by flows/cli.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP  # "the session that started me is gone": what nohup opts out of
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# What shielded() holds back: every signal that would otherwise cut a cleanup short.
CLEANUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(SystemExit):
    """A signal ended the command; ``code`` is 128 + its number (SIGTERM: 143, SIGHUP: 129)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (and the parent's death, as SIGHUP) raise ``Terminated`` in the main thread.

    Outside the main thread (where Python cannot set handlers) this does nothing.
    On leaving, the previous handlers and no parent-death signal are restored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in ENDING_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue  # nohup, or a parent that means it: leave it ignored
        previous[signum] = signal.signal(signum, _raise_terminated)
    asked_for_parent_death = PARENT_DEATH_SIGNAL in previous and _set_parent_death_signal(PARENT_DEATH_SIGNAL)
    try:
        yield
    finally:
        if asked_for_parent_death:
            _set_parent_death_signal(0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore SIGINT, SIGTERM and SIGHUP for the duration: a cleanup that is already under way
    (stopping a server: seconds, bounded) finishes instead of leaving half of it behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in CLEANUP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _set_parent_death_signal(signum: int) -> bool:
    """PR_SET_PDEATHSIG for this process (Linux); True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if signum and os.getppid() != parent:  # the parent died before the call took effect
        os.kill(os.getpid(), signum)
    return True
