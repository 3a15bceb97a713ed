"""Run torchrun and own its whole process tree until it ends (plain Python, no Prefect).

    result = launch(argv, run_dir, env=env, on_line=print, timeout_s=3600)   # any torchrun argv

This module only supervises processes: ``launch`` starts torchrun, streams its lines
to ``on_line`` in the calling thread, enforces the timeouts and the stall watchdog,
answers cancellation and signals, holds the run-dir lock, and stops the tree on
every way out. The train stage around it (preflight, job file, result) is
stage.py and the local launcher, local.py.

Why the launcher must own the tree: torchrun starts every rank in its OWN
session (``start_new_session=True`` in torch's SubprocessHandler), so killing
torchrun's process group does not reach the ranks, and a SIGKILLed torchrun
orphans them. Prefect cannot help either: its ``timeout_seconds`` is not a hard
stop for blocking code and cancelled tasks' children can survive
(PrefectHQ/prefect#13004, PrefectHQ/prefect#20979, PrefectHQ/prefect#17593). So ``launch``

* records every descendant PID (psutil, each poll) and, to stop, sends SIGTERM
  to torchrun's group and to every rank's group, waits ``grace_s``, then SIGKILL
  (process_tree.py);
* does that on any exception out of the wait (including Prefect's
  TerminationSignal), on ``timeout_s``, on a stall, on SIGTERM/SIGINT (handlers
  installed only while torchrun runs, in the main thread, chained to the
  previous handlers), when the interpreter starts shutting down (main thread no
  longer alive: the non-main-thread case), and when ``should_cancel()`` says so;
* except on a first stop signal (SIGTERM, SIGINT, ``train.preempt_signal``: ``Preemption``) while every
  rank is up with its handler (``catches_signal``): then it passes the signal on to the ranks, which save a
  step checkpoint at their next optimizer step and exit 0 (training/loop/preemption.py), waits up to
  ``train.preempt_grace_s`` for torchrun to end, and only then does what the replaced handler does (Ctrl-C's
  KeyboardInterrupt, Prefect's TerminationSignal, the CLI's exit). Past the grace, or on a second signal, it
  kills the tree at once. torchrun restarts nothing: its ranks exit 0. Ranks that stopped this way (whoever
  signalled them) leave RUN_DIR/preempted.json, and the launch raises ``LaunchPreempted``;
* gives torchrun PR_SET_PDEATHSIG=SIGTERM, so that even a SIGKILLed launcher
  process takes torchrun down, and torchrun in turn stops its ranks
  (within TORCH_ELASTIC_SHUTDOWN_TIMEOUT = ``grace_s``);
* holds an exclusive lock on RUN_DIR while torchrun runs, so two launches never
  share a run directory (``is_locked`` tells the resume rule a run is live);
  ``.launch.lock`` exists only while held, and ``torchrun.pid`` is removed when
  torchrun exits 0 (a failed or stopped launch keeps it: what was stopped).

Why a launch failed: failure.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ddpflow.launch.command import ERROR_FILE, LOG_DIR, PROJECT_ROOT
from ddpflow.launch.failure import (
    LaunchError,
    LaunchInterrupted,
    LaunchPreempted,
    LaunchStalled,
    LaunchTimeout,
    failure_from_output,
)
from ddpflow.launch.process_tree import (
    ProcessTree,
    catches_signal,
    chain_to_previous_handler,
    forward_signals,
    with_parent_death_signal,
)
from training.core.config import TrainConfig
from training.core.fileio import atomic_write_json
from training.core.layout import PREEMPTED
from training.loop.preemption import preempt_signals

PID_FILE = "torchrun.pid"
LOCK_FILE = ".launch.lock"
DEFAULT_GRACE_S = 5.0  # SIGTERM -> SIGKILL

# torchrun --tee prefixes each rank's lines with "[<role><local_rank>]:".
_RANK_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_]*?)(?P<rank>\d+)\]:(?P<line>.*)$")
_POLL_S = 0.2  # how often the wait loop checks exit, deadlines and cancellation
_TRACEBACK = "Traceback (most recent call last):"
_SCAN_S = 1.0  # how often the descendants are recorded


# ----------------------------------------------------------------------------- output


@dataclass(frozen=True)
class OutputLine:
    """One line of torchrun's output. ``rank`` is the local rank, None for torchrun's own lines.
    ``after_stop``: printed after the launcher began stopping the tree (torchrun's shutdown: its
    ``SignalException`` traceback) or in torchrun's own report of a failed rank (its ``ChildFailedError``
    traceback), for the log rather than a person's console."""

    rank: int | None
    text: str
    after_stop: bool = False

    def __str__(self) -> str:
        return f"[{'torchrun' if self.rank is None else f'rank {self.rank}'}] {self.text}"

    @property
    def is_torchrun_warning(self) -> bool:
        """torchrun's own warnings and errors start "W1129 ..." / "E1129 ..." (glog style)."""
        return self.rank is None and self.text[:1] in ("W", "E") and self.text[1:5].isdigit()


def parse_line(raw: str, after_stop: bool = False) -> OutputLine:
    raw = raw.rstrip("\n")
    match = _RANK_PREFIX.match(raw)
    if match:
        return OutputLine(int(match["rank"]), match["line"], after_stop)
    return OutputLine(None, raw, after_stop)


# ----------------------------------------------------------------------------- the run-dir lock


@contextmanager
def run_dir_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on RUN_DIR/.launch.lock; fails at once if another launch holds it.

    The file exists only while a launch holds it: it is removed (still locked) on the way out, so a
    finished run directory keeps no lock file. A launch that opened the file just before that removal
    and locks the removed file afterwards sees that the path no longer names what it locked, and
    reports the directory in use (run it again) rather than share the directory with a newer lock.
    """
    path = Path(run_dir) / LOCK_FILE
    with open(path, "a+") as handle:  # closing releases the lock
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(f"{run_dir} is in use by another launch (lock {path} is held)") from None
        if not _names_this_file(path, handle):
            raise LaunchError(f"{run_dir} was in use by another launch a moment ago (lock {path}); run it again")
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still held: no one can take the lock between the two


def _names_this_file(path: Path, handle) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def is_locked(run_dir: str | os.PathLike) -> bool:
    """True when a live launch holds RUN_DIR's lock."""
    path = Path(run_dir) / LOCK_FILE
    try:
        with open(path) as handle:  # read-only: never creates the file
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except FileNotFoundError:  # no launch holds it: the lock file exists only while one does
        return False


# ----------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class Preemption:
    """A stop signal the launcher passes on to the ranks, which save and exit (training/loop/preemption.py)."""

    ranks: int  # the local ranks torchrun starts: all of them must be up with their handler
    grace_s: float = 30.0  # train.preempt_grace_s: from the signal to the kill
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)  # the ranks' too: + train.preempt_signal

    @classmethod
    def for_train(cls, train: TrainConfig, ranks: int) -> Preemption:
        return cls(ranks, train.preempt_grace_s, preempt_signals(train))  # the signals the ranks catch


def read_preempted(run_dir: str | os.PathLike) -> dict | None:
    """RUN_DIR/preempted.json, written by rank 0 once the ranks saved and stopped; None when absent."""
    try:
        return json.loads((Path(run_dir) / PREEMPTED).read_text())
    except (OSError, ValueError):
        return None


def describe_preempted(record: dict) -> str:
    """ "preempted by SIGTERM: saved step 7 of epoch 1 (PATH)" from RUN_DIR/preempted.json (a training script's:
    "preempted by SIGTERM: the script saved in PATH")."""
    if record.get("script"):
        return f"preempted by {record.get('signal')}: the script saved in {record.get('checkpoint')}"
    step, epoch = int(record.get("step") or 0), int(record.get("epoch") or 0)
    where = f"step {step} of epoch {epoch + 1}" if step else f"the end of epoch {epoch}"
    return f"preempted by {record.get('signal')}: saved {where} ({record.get('checkpoint')})"


@dataclass
class LaunchResult:
    returncode: int
    restarts: int
    pids: list[int] = field(default_factory=list)  # every PID seen in the tree
    log_dir: str | None = None


def launch(
    argv: list[str],
    run_dir: str | os.PathLike,
    *,
    env: dict[str, str] | None = None,
    on_line: Callable[[OutputLine], None] = print,
    timeout_s: float | None = None,
    stall_timeout_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    should_cancel: Callable[[], str | None] | None = None,
    cancel_check_s: float = 2.0,
    preemption: Preemption | None = None,
    cwd: str | os.PathLike = PROJECT_ROOT,
    show_traceback: bool = False,
    meanwhile: Callable[[], object] | None = None,
) -> LaunchResult:
    """Run ``argv`` (torchrun) to completion in ``cwd``, streaming its lines to ``on_line`` in THIS thread.

    Raises RankFailed / LaunchTimeout / LaunchStalled / LaunchInterrupted, each after the
    whole tree is gone. ``should_cancel()`` is polled every ``cancel_check_s``; a non-empty
    string it returns is the reason to stop. ``show_traceback``: a failed rank's error ends with the last lines of its
    traceback (a user's training script). ``preemption``: a first stop signal is passed on to the ranks
    (module doc); without it every signal kills the tree. Ranks that stopped preempted: ``LaunchPreempted``,
    or what the handler of the signal the launcher held back raises. ``meanwhile``: called in this thread once
    torchrun has started (what its ranks wait for: batch scoring writes their job while they import); an exception
    out of it stops the tree and is raised, and torchrun's lines wait until it returns.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(run_dir):
        log_root = run_dir / LOG_DIR
        jobs_before = set(log_root.iterdir()) if log_root.is_dir() else set()
        for stale in (ERROR_FILE, PREEMPTED):  # an old attempt's error or stop must not be read as this one's
            (run_dir / stale).unlink(missing_ok=True)
        launcher = _Launcher(argv, run_dir, env, on_line, grace_s, preemption, cwd)
        try:
            with launcher.signals_forwarded():  # before start: no window where a signal skips the kill
                launcher.start()
                if meanwhile is not None:
                    launcher.muted = True  # stopped now, torchrun would print only its shutdown: not delivered
                    meanwhile()
                    launcher.muted = False
                stop = launcher.wait(timeout_s, stall_timeout_s, should_cancel, cancel_check_s)
        finally:
            # Any way out of wait() (exception, Prefect's TerminationSignal, KeyboardInterrupt) kills the tree.
            launcher.stopping = launcher.stopping or (launcher.tree is not None and launcher.proc.poll() is None)
            if launcher.tree is not None:
                launcher.tree.terminate(0.0 if launcher.held is not None else grace_s)  # ranks had their grace
                launcher.drain()
        job_dir = _new_job_dir(log_root, jobs_before)
        result = LaunchResult(
            launcher.proc.returncode, _count_restarts(job_dir), launcher.tree.pids(), str(job_dir) if job_dir else None
        )
        launcher.chain_held_signal()  # the stop signal held back while the ranks saved: its handler raises now
        if stop is not None:
            raise stop
        preempted = read_preempted(run_dir)
        if preempted is not None:  # whoever signalled the ranks (torchrun, one rank): saved, resumable
            raise LaunchPreempted(describe_preempted(preempted), preempted)
        if launcher.proc.returncode != 0:
            raise failure_from_output(run_dir, job_dir, launcher.tail, launcher.proc.returncode, show_traceback)
        # Finished: the PIDs matter no more. A failed or stopped launch keeps them, to show what was stopped.
        (run_dir / PID_FILE).unlink(missing_ok=True)
        return result


class _Launcher:
    def __init__(
        self, argv, run_dir: Path, env, on_line, grace_s: float, preemption: Preemption | None = None, cwd=PROJECT_ROOT
    ):
        self.argv = argv
        self.cwd = cwd
        self.run_dir = run_dir
        self.env = env
        self.on_line = on_line
        self.grace_s = grace_s
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []  # torchrun's own last lines: the ChildFailedError summary
        self.last_output = time.monotonic()
        self.proc: subprocess.Popen
        self.tree: ProcessTree | None = None
        self._stop_reason: LaunchError | None = None
        self._output_ended = False  # the reader's end-of-output marker has been taken from the queue
        self.stopping = False  # the tree is being stopped: what torchrun prints now is its shutdown
        self.preemption = preemption
        self.held: tuple[int, float] | None = None  # a stop signal passed on to the ranks, and its deadline
        self.replaced: dict[int, object] = {}  # the handlers forward_signals replaced (to chain a held signal)
        self._said_held = False
        self._torchrun_failing = False  # torchrun began printing its failure report
        self.muted = False  # drain() delivers nothing (launch's ``meanwhile`` failed: the ranks never had work)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            with_parent_death_signal(self.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            errors="replace",
            env=self.env,
            cwd=str(self.cwd),
            start_new_session=True,  # torchrun's own session and group: signals to ours don't hit it first
        )
        self.tree = ProcessTree(self.proc)
        self._write_pid_file()
        threading.Thread(target=self._read, name="torchrun-output", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw)
        self.lines.put(None)

    def _write_pid_file(self) -> None:
        record = {
            "launcher_pid": os.getpid(),
            "torchrun_pid": self.proc.pid,
            "pgid": self.proc.pid,
            "descendants": self.tree.pids(),
        }
        atomic_write_json(self.run_dir / PID_FILE, record, durable=False)  # matters only while we run

    def _deliver(self, raw: str) -> None:
        self.last_output = time.monotonic()
        line = parse_line(raw, after_stop=self.stopping or self._torchrun_failing)
        if line.rank is None and line.text.startswith(_TRACEBACK):
            # torchrun's own report of a failed rank (ChildFailedError): for the log and the failure analysis (the
            # launch's error says the root cause); the console has the rank's own lines already.
            self._torchrun_failing = True
            line = OutputLine(line.rank, line.text, after_stop=True)
        if not line.text.strip():
            return  # torchrun's tail emits empty "[defaultN]:" lines; they say nothing
        if line.rank is None:
            self.tail = (self.tail + [line.text])[-200:]
        self.on_line(line)

    def wait(self, timeout_s, stall_timeout_s, should_cancel, cancel_check_s) -> LaunchError | None:
        """Stream lines until torchrun's output ends. Returns the reason it was stopped, if it was."""
        started = time.monotonic()
        next_scan = next_cancel_check = next_check = started
        in_main_thread = threading.current_thread() is threading.main_thread()
        while True:
            try:
                raw = self.lines.get(timeout=_POLL_S)
            except queue.Empty:
                raw = ""
            if raw is None:
                self._output_ended = True
                break
            if raw:
                self._deliver(raw)
            now = time.monotonic()
            if now < next_check:
                continue  # a burst of lines: check limits at most every _POLL_S
            next_check = now + _POLL_S
            if self._stop_reason is not None:
                break
            if now >= next_scan:
                next_scan = now + _SCAN_S
                if self.tree.scan():
                    self._write_pid_file()
            reason = None
            if timeout_s is not None and now - started > timeout_s:
                reason = LaunchTimeout(
                    f"training exceeded train.timeout_s={timeout_s:g}s; killed torchrun and its ranks"
                )
            elif self.held is not None and now > self.held[1]:
                reason = LaunchInterrupted(
                    f"the ranks did not save and exit within train.preempt_grace_s={self.preemption.grace_s:g}s "
                    f"of {signal.Signals(self.held[0]).name}; killed torchrun and its ranks"
                )
            elif stall_timeout_s is not None and now - self.last_output > stall_timeout_s:
                reason = LaunchStalled(
                    f"training stalled: no output for train.stall_timeout_s={stall_timeout_s:g}s; "
                    "killed torchrun and its ranks"
                )
            elif not in_main_thread and not threading.main_thread().is_alive():
                reason = LaunchInterrupted("the launching process is shutting down; killed torchrun and its ranks")
            elif should_cancel is not None and now >= next_cancel_check:
                next_cancel_check = now + cancel_check_s
                why = should_cancel()
                if why:
                    reason = LaunchInterrupted(f"{why}; killed torchrun and its ranks")
            if self.held is not None and not self._said_held:
                self._said_held = True
                self.on_line(OutputLine(None, self._held_note()))
            if reason is not None:
                self._stop_reason = reason
                self.stopping = True
                break
        if self._stop_reason is None:
            self.proc.wait()
        return self._stop_reason

    def drain(self) -> None:
        """Deliver what torchrun printed before it exited (its failure summary)."""
        if self.muted:
            return
        deadline = time.monotonic() + 5
        while not self._output_ended and time.monotonic() < deadline:  # ended: nothing left, no wait
            try:
                raw = self.lines.get(timeout=0.5)
            except queue.Empty:
                return
            if raw is None:
                self._output_ended = True
                return
            self._deliver(raw)

    @contextmanager
    def signals_forwarded(self) -> Iterator[None]:
        """While torchrun runs: a first stop signal goes to the ranks, which save and stop (``Preemption``);
        otherwise, and on a second one, SIGTERM/SIGINT kill the tree first, then go to the previous handler (in
        the main thread only; elsewhere wait() watches the main thread instead)."""

        def stop(signum: int) -> bool:
            if self.held is None and self._pass_to_ranks(signum):
                self.held = (signum, time.monotonic() + self.preemption.grace_s)
                return True  # held back: chained once the ranks are done (chain_held_signal)
            self.stopping = True
            self._stop_reason = LaunchInterrupted(
                f"received {signal.Signals(signum).name}; killed torchrun and its ranks"
            )
            if self.tree is not None:
                self.tree.terminate(0.0 if self.held is not None else self.grace_s)  # a second signal: at once
            return False

        signals = self.preemption.signals if self.preemption is not None else (signal.SIGTERM, signal.SIGINT)
        with forward_signals(stop, signals) as replaced:
            self.replaced = replaced
            yield

    def _pass_to_ranks(self, signum: int) -> bool:
        """Send ``signum`` to every rank when all of them are up and catch it (their preemption handler, set with
        SIGTERM's: Python catches SIGINT by itself); False, sending nothing, otherwise."""
        if self.preemption is None or signum not in self.preemption.signals or self.tree is None:
            return False
        ranks = self.tree.ranks()
        if len(ranks) < self.preemption.ranks or not all(catches_signal(rank, signal.SIGTERM) for rank in ranks):
            return False  # starting up (or ending): nothing trained since the last checkpoint to save
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.Error:
                pass
        return True

    def _held_note(self) -> str:
        name = signal.Signals(self.held[0]).name
        return (
            f"ddpflow: {name} passed on to the ranks: they save a checkpoint at their next step and stop "
            f"(train.preempt_grace_s={self.preemption.grace_s:g}s; a second signal stops them at once)"
        )

    def chain_held_signal(self) -> None:
        """Do what the handler replaced for the held signal would have done (it may raise), once the ranks ended.
        train.preempt_signal with no handler of the caller's (SIGUSR1 would end the process on the spot, skipping
        every cleanup): LaunchInterrupted instead, which the train task does not retry."""
        if self.held is None or self.held[0] not in self.replaced:
            return
        signum, previous = self.held[0], self.replaced[self.held[0]]
        if previous == signal.SIG_DFL and signum not in (signal.SIGTERM, signal.SIGINT):
            record = read_preempted(self.run_dir)
            saved = describe_preempted(record) if record else "the ranks did not save"
            raise LaunchInterrupted(f"received {signal.Signals(signum).name}: {saved}")
        chain_to_previous_handler(previous, signum, None)


def _new_job_dir(log_root: Path, before: set[Path]) -> Path | None:
    """The folder torchrun created under RUN_DIR/logs for this launch."""
    if not log_root.is_dir():
        return None
    created = [p for p in log_root.iterdir() if p.is_dir() and p not in before]
    return max(created, key=lambda p: p.stat().st_mtime) if created else None


def _count_restarts(job_dir: Path | None) -> int:
    if job_dir is None:
        return 0
    attempts = [p for p in job_dir.glob("attempt_*") if p.is_dir()]
    return max(0, len(attempts) - 1)
