"""Processes and how to stop them: the ONE "stop these processes" helper, and torchrun's tree.

    stop_processes(processes, grace_s)   SIGTERM groups and processes, wait, SIGKILL what is left, reap
    session_members(sid)                 every process of a session (what a start_new_session child left)
    ProcessTree(popen)                   torchrun and every descendant it ever had (ranks live in their
                                         own sessions, so torchrun's group alone does not reach them)
    with_parent_death_signal(argv)       the child gets SIGTERM when the launching thread dies
    with forward_signals(stop):          SIGTERM/SIGINT call ``stop`` first, then the handler they replaced
                                         (unless ``stop`` holds the signal back: a preemption under way)
    catches_signal(proc, signum)         whether a process has a handler for a signal (the ranks' preemption)

Used by the launchers (ddpflow/launch/supervisor.py, ddpflow/launch/slurm/), the local stack and bench/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import psutil

REAP_WAIT_S = 5.0  # after SIGKILL: how long to wait for the kernel to take the processes away


def stop_processes(processes: Iterable[psutil.Process], grace_s: float) -> None:
    """SIGTERM each process's group and the process itself, wait ``grace_s``, SIGKILL survivors, reap.

    Never signals the caller's own process group or the caller itself (that would stop the
    launcher). A process that left its group (setsid/setpgid) is still reached directly.
    Processes already gone are skipped; the call never raises for them.
    """
    procs = [p for p in processes if p.pid != os.getpid() and is_running(p)]
    if not procs:
        return
    _signal_groups_and_members(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, grace_s))
    if alive:
        _signal_groups_and_members(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=REAP_WAIT_S)  # also reaps those that are our children


def session_members(sid: int) -> list[psutil.Process]:
    """Processes in session ``sid``: a process started with start_new_session and everything it left."""
    members = []
    for candidate in psutil.process_iter():
        try:
            if os.getsid(candidate.pid) == sid:
                members.append(candidate)
        except (OSError, psutil.Error):
            continue
    return members


def is_running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie has exited; only its exit status is left to read)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_groups_and_members(procs: list[psutil.Process], sig: signal.Signals) -> None:
    own_group = os.getpgrp()
    groups = set()
    for proc in procs:
        try:
            groups.add(os.getpgid(proc.pid))
        except ProcessLookupError:
            pass
    for group in groups - {own_group}:  # never our own group: that would kill the caller
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:  # members that left their group
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


class ProcessTree:
    """torchrun and every process it ever had below it, tracked by psutil (safe against PID reuse)."""

    def __init__(self, root: subprocess.Popen):
        self.root = root
        self._known: dict[int, psutil.Process] = {}
        try:
            self._known[root.pid] = psutil.Process(root.pid)
        except psutil.NoSuchProcess:
            pass
        self._lock = threading.Lock()
        self.killed = False

    def scan(self) -> bool:
        """Record current descendants; True when new ones appeared."""
        try:
            children = self._known[self.root.pid].children(recursive=True) if self.root.pid in self._known else []
        except psutil.NoSuchProcess:
            children = []
        new = False
        with self._lock:
            for child in children:
                if child.pid not in self._known:
                    self._known[child.pid] = child
                    new = True
        return new

    def pids(self) -> list[int]:
        with self._lock:
            return sorted(self._known)

    def ranks(self) -> list[psutil.Process]:
        """torchrun's own children, alive: the ranks (a rank's own children, decode workers, are not ranks)."""
        try:
            children = self._known[self.root.pid].children() if self.root.pid in self._known else []
        except psutil.NoSuchProcess:
            return []
        return [child for child in children if is_running(child)]

    def alive(self) -> list[psutil.Process]:
        with self._lock:
            procs = list(self._known.values())
        return [p for p in procs if is_running(p)]

    def terminate(self, grace_s: float) -> None:
        """SIGTERM every group in the tree, SIGKILL what is left after ``grace_s``. Idempotent."""
        self.scan()  # ranks started since the last poll
        with self._lock:
            self.killed = True
        stop_processes(self.alive(), grace_s)
        if self.scan():  # a rank started during the grace period: no grace for it
            stop_processes(self.alive(), 0.0)
        try:
            self.root.wait(timeout=REAP_WAIT_S)  # reap torchrun: no zombie
        except subprocess.TimeoutExpired:
            pass


# PR_SET_PDEATHSIG, run in the child between fork and exec: the child gets SIGTERM when the
# launching THREAD dies (Linux ties it to the thread, which is why the supervisor waits on torchrun
# in the same thread that started it). The getppid check closes the race where the parent
# died before prctl ran.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0);"
    "os.getppid() == int(sys.argv[1]) or os._exit(143);"
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """``argv`` wrapped so the started process gets SIGTERM when this thread dies (Linux; as is elsewhere)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def catches_signal(proc: psutil.Process, signum: int) -> bool:
    """Whether ``proc`` has a handler of its own for ``signum`` (Linux: the SigCgt mask of /proc/PID/status).
    False where that cannot be read (another OS, the process gone): the caller then does not rely on it."""
    try:
        with open(f"/proc/{proc.pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError):
        return False
    return False


def chain_to_previous_handler(previous, signum: int, frame) -> None:
    """Do what the signal handler we replaced would have done (launchers stop their ranks first, then call this)."""
    if callable(previous):
        previous(signum, frame)  # e.g. Prefect's bridge (raises TerminationSignal) or KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of the signal, as the default would
    # SIG_IGN: the stop reason set by the handler ends the wait with LaunchInterrupted.


@contextmanager
def forward_signals(
    stop: Callable[[int], bool | None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[dict[int, object]]:
    """While inside: ``signals`` (SIGTERM and SIGINT) call ``stop(signum)`` first (a launcher stops what it
    started), then do what the handler they replaced would have done (``chain_to_previous_handler``), unless
    ``stop`` returns True: it holds the signal back (the ranks are saving) and chains later itself, with the
    replaced handlers this yields. The old handlers come back on the way out. Only the main thread may set
    handlers: elsewhere this does nothing, and the caller watches the main thread instead."""
    previous: dict[int, object] = {}
    if threading.current_thread() is not threading.main_thread():
        yield previous
        return

    def handler(signum, frame):
        if not stop(signum):
            chain_to_previous_handler(previous[signum], signum, frame)

    for sig in dict.fromkeys(signals):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield previous
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
