"""Launch ``torchrun`` and own its whole process tree (plain Python, no Prefect).

    argv = torchrun_command(config, run_dir / "train_config.json")
    result = launch(argv, run_dir, env=launch_env(config, ...), on_line=print,
                    timeout_s=config.train.timeout_s, stall_timeout_s=config.train.stall_timeout_s)

Why the launcher must own the tree: torchrun starts every rank in its OWN
session (``start_new_session=True`` in torch's SubprocessHandler), so killing
torchrun's process group does not reach the ranks, and a SIGKILLed torchrun
orphans them. Prefect cannot help either: its ``timeout_seconds`` is not a hard
stop for blocking code and cancelled tasks' children can survive
(PrefectHQ/prefect#13004, #20979, #17593). So this module

* records every descendant PID (psutil, each poll) and, to stop, sends SIGTERM
  to torchrun's group and to every rank's group, waits ``grace_s``, then SIGKILL;
* does that on a non-zero exit of the caller's wait (any exception, including
  Prefect's TerminationSignal), on ``timeout_s``, on a stall, on SIGTERM/SIGINT
  (handlers installed only while torchrun runs, in the main thread, chained to
  the previous handlers), when the interpreter starts shutting down (main thread
  no longer alive: the non-main-thread case), and when ``should_cancel()`` says so;
* gives torchrun PR_SET_PDEATHSIG=SIGTERM, so that even a SIGKILLed launcher
  process takes torchrun down, and torchrun in turn stops its ranks
  (within TORCH_ELASTIC_SHUTDOWN_TIMEOUT = ``grace_s``).
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ddpflow.launch.process_tree import ProcessTree, with_parent_death_signal
from training.config import PipelineConfig, TrainConfig
from training.data.manifest import read_manifest
from training.metrics_sink import MLFLOW_RUN_ENV
from training.preflight import check_fits_dataset, check_runnable, ranks_per_node

PID_FILE = "torchrun.pid"
LOCK_FILE = ".launch.lock"
LOG_DIR = "logs"
ERROR_FILE = "error.json"
RANK_ENTRYPOINT = "training.train"  # what every rank runs; tests point it at a stand-in script

# torchrun --tee prefixes each rank's lines with "[<role><local_rank>]:".
_RANK_PREFIX = re.compile(r"^\[(?P<role>[A-Za-z_]*?)(?P<rank>\d+)\]:(?P<text>.*)$")
# Fields of torchrun's ChildFailedError "Root Cause" block.
_ROOT_CAUSE_FIELD = re.compile(r"^\s*(?P<key>rank|exitcode|error_file|traceback)\s*:\s*(?P<value>.*?)\s*$")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*)(?:Error|Exception|Interrupt|Exit|Failure|Warning)\b.*|^[A-Za-z_][\w.]*: .+"
)

_POLL_S = 0.2  # how often the wait loop checks exit, deadlines and cancellation
_SCAN_S = 1.0  # how often the descendants are recorded


# ----------------------------------------------------------------------------- errors


class LaunchError(RuntimeError):
    """torchrun did not finish successfully; the message says why and which rank."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exitcode: int | None = None,
        root_cause: str | None = None,
        log_file: str | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.root_cause = root_cause
        self.log_file = log_file


class RankFailed(LaunchError):
    """A rank exited non-zero (after torchrun used up its restarts)."""


class LaunchTimeout(LaunchError):
    """train.timeout_s passed; the tree was killed."""


class LaunchStalled(LaunchError):
    """No output line for train.stall_timeout_s; the tree was killed."""


class LaunchInterrupted(LaunchError):
    """The launcher was told to stop (signal, cancellation, interpreter shutdown); the tree was killed."""


# ----------------------------------------------------------------------------- argv and environment


def detect_cuda_devices() -> int:
    """GPUs torch can see (0 without CUDA). Imports torch: call it in the launcher, not at import."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(train: TrainConfig, gpus: int) -> str:
    if train.backend != "auto":
        return train.backend
    return "nccl" if gpus > 0 else "gloo"


def resolve_nproc(train: TrainConfig, gpus: int) -> int:
    return ranks_per_node(train.nproc_per_node, gpus)


def torchrun_command(config: PipelineConfig, job_path: str | os.PathLike, *, gpus: int | None = None) -> list[str]:
    """The torchrun argv, as a list (never a shell string). Logs go to ``<job dir>/logs``."""
    train = config.train
    gpus = detect_cuda_devices() if gpus is None else gpus
    job_path = Path(job_path)
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if train.nnodes == 1:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += [
            "--nnodes", str(train.nnodes),
            "--node-rank", str(train.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", str(train.rdzv_endpoint),
            # Every node must pass the same id; a fixed default works for one job per endpoint.
            "--rdzv-id", train.rdzv_id or "ddpflow",
        ]  # fmt: skip
    argv += [
        "--nproc-per-node", str(resolve_nproc(train, gpus)),
        "--max-restarts", str(train.max_restarts),
        # Per-rank stdout/stderr files under logs/ AND on torchrun's stdout, each line prefixed "[defaultN]:".
        "--log-dir", str(job_path.parent / LOG_DIR),
        "--tee", "3",
    ]  # fmt: skip
    # A module runs as "-m module"; a path (tests' stand-in ranks) runs as a script.
    entry = [RANK_ENTRYPOINT] if RANK_ENTRYPOINT.endswith(".py") else ["-m", RANK_ENTRYPOINT]
    return [*argv, *entry, "--config", str(job_path)]


def launch_env(
    config: PipelineConfig,
    run_dir: str | os.PathLike,
    *,
    tracking_uri: str | None = None,
    gpus: int | None = None,
    grace_s: float = 5.0,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun and its ranks inherit."""
    gpus = detect_cuda_devices() if gpus is None else gpus
    nproc = resolve_nproc(config.train, gpus)
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"  # ranks write to files under --tee: without this, lines arrive in 8 KiB blocks
    # torchrun would silently force 1 thread per rank; give each local rank its share of the cores instead.
    env["OMP_NUM_THREADS"] = str(config.train.num_threads or max(1, available_cores() // nproc))
    # torchrun's own @record copies the root-cause rank's error file here when the rank used @record.
    env["TORCHELASTIC_ERROR_FILE"] = str(Path(run_dir) / ERROR_FILE)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(max(1, grace_s)))  # torchrun's own TERM -> KILL wait for ranks
    # torchrun 2.13 shares one TCP store across restarts, so a restarted rank can read a dead peer's
    # address and hang in gloo's connectFullMesh (pytorch/pytorch#135712). A fresh store per round avoids it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    # The launching process mirrors metrics.jsonl into MLflow (tasks/tracking.py: EpochMetricsFollower);
    # a run id inherited from the caller's shell would have rank 0 log the same epochs as well.
    env.pop(MLFLOW_RUN_ENV, None)
    # The rank imports training.* : make sure the project is importable whatever the caller's cwd.
    project_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH", "")) if p)
    return env


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- preflight


def preflight(config: PipelineConfig, dataset_dir: str | os.PathLike | None, *, gpus: int | None = None) -> int:
    """Reject a launch that cannot work, before any process starts. Returns ranks per node.

    Raises ValueError (ConfigError) naming the field. The machine and data checks are
    training/preflight.py's, shared with the CLI; the backend check needs the GPU count.
    """
    train = config.train
    gpus = detect_cuda_devices() if gpus is None else gpus
    if resolve_backend(train, gpus) == "nccl" and gpus == 0:
        raise ValueError("train.backend: 'nccl' needs CUDA GPUs, and this machine has none (use 'gloo' or 'auto')")
    check_runnable(config)  # ranks vs GPUs/cores, train.model imports
    if dataset_dir is not None:
        check_fits_dataset(config, read_manifest(dataset_dir))  # batch vs each rank's share of the train split
    return resolve_nproc(train, gpus)


# ----------------------------------------------------------------------------- output


@dataclass(frozen=True)
class OutputLine:
    """One line of torchrun's output. ``rank`` is the local rank, None for torchrun's own lines."""

    rank: int | None
    text: str

    def __str__(self) -> str:
        return f"[{'torchrun' if self.rank is None else f'rank {self.rank}'}] {self.text}"


def parse_line(raw: str) -> OutputLine:
    raw = raw.rstrip("\n")
    match = _RANK_PREFIX.match(raw)
    if match:
        return OutputLine(int(match["rank"]), match["text"])
    return OutputLine(None, raw)


# ----------------------------------------------------------------------------- launching


@dataclass
class LaunchResult:
    returncode: int
    restarts: int
    pids: list[int] = field(default_factory=list)  # every PID seen in the tree
    log_dir: str | None = None


@contextmanager
def run_dir_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on RUN_DIR/.launch.lock; fails at once if another launch holds it."""
    path = Path(run_dir) / LOCK_FILE
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(f"{run_dir} is in use by another launch (lock {path} is held)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock


def is_locked(run_dir: str | os.PathLike) -> bool:
    """True when a live launch holds RUN_DIR's lock."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def launch(
    argv: list[str],
    run_dir: str | os.PathLike,
    *,
    env: dict[str, str] | None = None,
    on_line: Callable[[OutputLine], None] = print,
    timeout_s: float | None = None,
    stall_timeout_s: float | None = None,
    grace_s: float = 5.0,
    should_cancel: Callable[[], str | None] | None = None,
    cancel_check_s: float = 2.0,
) -> LaunchResult:
    """Run ``argv`` (torchrun) to completion, streaming its lines to ``on_line`` in THIS thread.

    Raises RankFailed / LaunchTimeout / LaunchStalled / LaunchInterrupted, each after the
    whole tree is gone. ``should_cancel()`` is polled every ``cancel_check_s``; a non-empty
    string it returns is the reason to stop.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(run_dir):
        log_root = run_dir / LOG_DIR
        jobs_before = set(log_root.iterdir()) if log_root.is_dir() else set()
        (run_dir / ERROR_FILE).unlink(missing_ok=True)  # an old attempt's error must not be read as this one's
        launcher = _Launcher(argv, run_dir, env, on_line, grace_s)
        try:
            with launcher.signals_forwarded():  # before start: no window where a signal skips the kill
                launcher.start()
                stop = launcher.wait(timeout_s, stall_timeout_s, should_cancel, cancel_check_s)
        finally:
            # Any way out of wait() (exception, Prefect's TerminationSignal, KeyboardInterrupt) kills the tree.
            if launcher.tree is not None:
                launcher.tree.terminate(grace_s)
                launcher.drain()
        job_dir = _new_job_dir(log_root, jobs_before)
        result = LaunchResult(
            launcher.proc.returncode, _count_restarts(job_dir), launcher.tree.pids(), str(job_dir) if job_dir else None
        )
        if stop is not None:
            raise stop
        if launcher.proc.returncode != 0:
            raise failure_from_output(run_dir, job_dir, launcher.tail, launcher.proc.returncode)
        return result


class _Launcher:
    def __init__(self, argv, run_dir: Path, env, on_line, grace_s: float):
        self.argv = argv
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
            cwd=str(Path(__file__).resolve().parents[1]),
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
        tmp = self.run_dir / f".{PID_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.run_dir / PID_FILE)

    def _deliver(self, raw: str) -> None:
        self.last_output = time.monotonic()
        line = parse_line(raw)
        if not line.text.strip():
            return  # torchrun's tail emits empty "[defaultN]:" lines; they say nothing
        if line.rank is None:
            self.tail = (self.tail + [line.text])[-200:]
        self.on_line(line)

    def wait(self, timeout_s, stall_timeout_s, should_cancel, cancel_check_s) -> LaunchError | None:
        """Stream lines until torchrun's output ends. Returns the reason it was stopped, if it was."""
        started = time.monotonic()
        next_scan = next_cancel_check = started
        in_main_thread = threading.current_thread() is threading.main_thread()
        next_check = started
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
            elif stall_timeout_s is not None and now - self.last_output > stall_timeout_s:
                reason = LaunchStalled(
                    f"training stalled: no output for train.stall_timeout_s={stall_timeout_s:g}s; killed torchrun and its ranks"
                )
            elif not in_main_thread and not threading.main_thread().is_alive():
                reason = LaunchInterrupted("the launching process is shutting down; killed torchrun and its ranks")
            elif should_cancel is not None and now >= next_cancel_check:
                next_cancel_check = now + cancel_check_s
                why = should_cancel()
                if why:
                    reason = LaunchInterrupted(f"{why}; killed torchrun and its ranks")
            if reason is not None:
                self._stop_reason = reason
                break
        if self._stop_reason is None:
            self.proc.wait()
        return self._stop_reason

    def drain(self) -> None:
        """Deliver what torchrun printed before it exited (its failure summary)."""
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
        """While torchrun runs: SIGTERM/SIGINT kill the tree first, then go to the previous handler."""
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set handlers; wait() watches the main thread instead
            return
        previous = {}

        def handler(signum, frame):
            self._stop_reason = LaunchInterrupted(
                f"received {signal.Signals(signum).name}; killed torchrun and its ranks"
            )
            if self.tree is not None:
                self.tree.terminate(self.grace_s)
            _chain(previous[signum], signum, frame)

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _chain(previous, signum: int, frame) -> None:
    """Do what the handler we replaced would have done."""
    if callable(previous):
        previous(signum, frame)  # e.g. Prefect's bridge (raises TerminationSignal) or KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of the signal, as the default would
    # SIG_IGN: the stop reason set by the handler ends the wait with LaunchInterrupted.


# ----------------------------------------------------------------------------- failure analysis


def _new_job_dir(log_root: Path, before: set[Path]) -> Path | None:
    if not log_root.is_dir():
        return None
    created = [p for p in log_root.iterdir() if p.is_dir() and p not in before]
    return max(created, key=lambda p: p.stat().st_mtime) if created else None


def _count_restarts(job_dir: Path | None) -> int:
    if job_dir is None:
        return 0
    attempts = [p for p in job_dir.glob("attempt_*") if p.is_dir()]
    return max(0, len(attempts) - 1)


def root_cause_summary(tail: list[str]) -> dict[str, str]:
    """rank / exitcode / error_file / traceback from torchrun's ChildFailedError block."""
    found: dict[str, str] = {}
    in_root = False
    for text in tail:
        if "Root Cause" in text:
            in_root = True
            continue
        if in_root:
            match = _ROOT_CAUSE_FIELD.match(text)
            if match and match["key"] not in found:
                found[match["key"]] = match["value"]
    return found


def _error_file_message(path: Path) -> str | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = raw.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    return str(message).strip() if message else None


def _last_exception_line(log_file: Path) -> str | None:
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for text in reversed(lines):
        if _EXCEPTION_LINE.match(text.strip()) and not text.startswith(" "):
            return text.strip()
    return None


# What a rank says when a PEER died: never the root cause while another rank has a real error.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|connectFullMesh|Broken pipe|"
    r"NCCL communicator was aborted|remote worker crashing",
    re.IGNORECASE,
)


def _original_failure(job_dir: Path | None, local_rank: int | None) -> tuple[int, str] | None:
    """The rank whose error is its own, when torchrun blamed a rank that only lost its peer.

    torchrun picks the "first observed failure" by error-file timestamps in whole
    seconds, so a rank that merely saw its peer vanish (gloo: "Connection closed by
    peer") often wins the tie and hides the real exception.
    """
    if job_dir is None or local_rank is None:
        return None
    attempts = sorted(job_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return None
    blamed = _error_file_message(attempts[-1] / str(local_rank) / ERROR_FILE)
    if blamed is None or not _PEER_LOST.search(blamed):
        return None
    for error_file in sorted(attempts[-1].glob(f"*/{ERROR_FILE}")):
        message = _error_file_message(error_file)
        if message and not _PEER_LOST.search(message) and error_file.parent.name.isdigit():
            return int(error_file.parent.name), message
    return None


def failure_from_output(run_dir: Path, job_dir: Path | None, tail: list[str], returncode: int) -> RankFailed:
    """An error naming the failing rank, its exit code and the root-cause exception text."""
    summary = root_cause_summary(tail)
    rank_match = re.match(r"(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", summary.get("rank", ""))
    rank = int(rank_match[1]) if rank_match else None
    local_rank = int(rank_match[2]) if rank_match and rank_match[2] else rank
    exit_match = re.match(r"(-?\d+)", summary.get("exitcode", ""))
    exitcode = int(exit_match[1]) if exit_match else None
    original = _original_failure(job_dir, local_rank)
    note = ""
    if original is not None and rank is not None:
        # Global rank = the blamed rank's node offset + the original's local rank. Its exit
        # code is whatever torchrun's shutdown left (often SIGTERM), so the note keeps torchrun's view.
        note = f"; torchrun first saw rank {rank} exit with code {exitcode}, after it lost this peer"
        rank, local_rank = rank - local_rank + original[0], original[0]

    log_file = None
    if job_dir is not None and local_rank is not None:
        attempts = sorted(job_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
        if attempts:
            log_file = attempts[-1] / str(local_rank) / "stderr.log"
    cause = original[1] if original is not None else _error_file_message(run_dir / ERROR_FILE)
    error_file = summary.get("error_file", "")
    if cause is None and error_file and not error_file.startswith("<"):
        cause = _error_file_message(Path(error_file))
    if cause is None and log_file is not None:
        cause = _last_exception_line(log_file)

    if rank is None:
        last = next((t for t in reversed(tail) if t.strip()), "")
        message = f"torchrun exited with code {returncode}: {last}"
    else:
        message = (
            f"rank {rank} failed: {cause}{note}"
            if note
            else f"rank {rank} failed with exit code {exitcode}: {cause or 'no exception recorded'}"
        )
        if log_file is not None:
            message += f" (its log: {log_file})"
    return RankFailed(
        message, rank=rank, exitcode=exitcode, root_cause=cause, log_file=str(log_file) if log_file else None
    )
