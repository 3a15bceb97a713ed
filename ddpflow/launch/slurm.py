"""Train on a Slurm cluster: the train stage's contract, through ``sbatch`` (plain Python, no Prefect).

    result = run_training_on_slurm(config, dataset_dir, run_dir, on_line=print, on_job=record_job_id)

The same contract as ``supervisor.run_training`` (the local backend): run the ranks to
completion, stream every line to ``on_line`` in the calling thread, stop on cancellation,
signals and ``train.timeout_s``, and end with a ``TrainResult`` or one of the same errors
(``RankFailed`` with the root cause, ``LaunchTimeout``, ``LaunchStalled``, ``LaunchInterrupted``,
``LaunchError``). A Kubernetes backend would be one more module with this signature.

How:
  * preflight (slurm_commands.check_cluster): the commands answer, the partition exists;
  * the batch script and the sbatch argv (slurm_script.py), the job id recorded in
    RUN_DIR/slurm/job.json before anything else can happen (signals are held meanwhile);
  * following with ``scontrol show job`` every ``slurm.poll_interval_s`` (PENDING reasons are
    said once each), and every node's lines from the job's output file, labelled
    ``[n2 rank 1]`` / ``[n2 torchrun]`` / ``[slurm]``;
  * the end: COMPLETED -> the result; otherwise the root cause per node, with the local
    launcher's failure analysis (failure.py) on that node's torchrun lines and logs;
  * any way out before the end (exception, SIGTERM/SIGINT, cancellation, timeout, stall) runs
    ``scancel`` and waits up to 30 s until Slurm says nothing of the job is left;
  * reattach: a launch in a RUN_DIR whose recorded job is still pending or running follows
    that job instead of submitting a second one; a recorded job that ended is read from its end
    record (COMPLETED: nothing to do), and a failed one is followed by a new job, which
    resumes from checkpoints/last.pt like any retry.

The task process is not the job's parent: a SIGKILLed launcher leaves the job running, and the
next launch in that RUN_DIR (the task's retry, or a new run of the same config) reattaches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ddpflow.launch.command import launch_env
from ddpflow.launch.failure import (
    LaunchError,
    LaunchInterrupted,
    LaunchStalled,
    LaunchTimeout,
    RankFailed,
    failure_from_output,
)
from ddpflow.launch.slurm_commands import (
    JobInfo,
    SlurmSetupError,
    SlurmUnreachable,
    cancel,
    check_cluster,
    expand_nodes,
    show_job,
    submit,
)
from ddpflow.launch.slurm_script import CANNOT_SEE, JobPaths, batch_script, sbatch_command
from ddpflow.launch.supervisor import (
    DEFAULT_GRACE_S,
    OutputLine,
    TrainResult,
    last_metrics,
    parse_line,
    run_dir_lock,
)
from ddpflow.launch.supervisor import _chain as chain_to_previous_handler
from training.config import PipelineConfig
from training.data.manifest import read_manifest
from training.fileio import atomic_write_json, atomic_write_text
from training.job import TrainJob
from training.layout import CONFIG, FINAL_MODEL, METRICS, TRAIN_JOB, run_file
from training.preflight import check_data
from training.topology import RankLayout, resolve_ranks

_TICK_S = 0.2  # how often new output lines and the end record are looked for
_SRUN_LABEL = re.compile(r"^\s*(?P<task>\d+): (?P<text>.*)$")  # srun --label: the node's index in the job
_SRUN_TASK_EXIT = re.compile(r"srun: error: (?P<node>\S+): task \d+: Exited with exit code (?P<code>\d+)")
_CANNOT_SEE = re.compile(rf"ddpflow: node (?P<node>\S+) {CANNOT_SEE} (?P<path>.+)$")


def node_layout(config: PipelineConfig) -> RankLayout:
    """Ranks and backend on each node of the job: the nodes' GPUs (slurm.gpus_per_node), not this machine's."""
    return resolve_ranks(config.train, gpus=config.slurm.gpus_per_node)


# ----------------------------------------------------------------------------- lines


@dataclass(frozen=True)
class SlurmLine(OutputLine):
    """A line of the job: ``rank`` is the GLOBAL rank; ``node`` None for the job's own lines and ddpflow's."""

    node: str | None = None
    warning: bool = False

    def __str__(self) -> str:
        if self.node is None:
            return f"[slurm] {self.text}"
        return f"[{self.node} {'torchrun' if self.rank is None else f'rank {self.rank}'}] {self.text}"

    @property
    def is_torchrun_warning(self) -> bool:
        return self.warning or super().is_torchrun_warning


def label_line(raw: str, nodes: list[str]) -> SlurmLine:
    """One line of the job's output file, attributed to its node (srun --label) and rank (torchrun --tee)."""
    match = _SRUN_LABEL.match(raw)
    if match is None or not nodes:
        return SlurmLine(None, raw)
    task = int(match["task"])
    inner = parse_line(match["text"])
    return SlurmLine(inner.rank, inner.text, node=nodes[task] if task < len(nodes) else f"node{task}")


class _OutputTail:
    """New complete lines of a file that another machine appends to."""

    def __init__(self, path: Path, from_end: bool = False):
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0
        self.partial = b""

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        return [line.decode(errors="replace") for line in lines]


# ----------------------------------------------------------------------------- the train stage


def run_training_on_slurm(
    config: PipelineConfig,
    dataset_dir: str | os.PathLike,
    run_dir: str | os.PathLike,
    *,
    on_line: Callable[[OutputLine], None] = print,
    on_start: Callable[[RankLayout, list[str]], None] | None = None,
    layout: RankLayout | None = None,
    tracking_uri: str | None = None,
    init_weights: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    should_cancel: Callable[[], str | None] | None = None,
    cancel_check_s: float = 2.0,
    on_job: Callable[[str], None] | None = None,
) -> TrainResult:
    """``supervisor.run_training``'s contract on Slurm; ``on_job(job_id)`` is told the job it submitted or found.

    ``on_start(layout, sbatch argv)`` is told just before a job is submitted (not when reattaching).
    """
    layout = node_layout(config) if layout is None else layout
    check_data(config, read_manifest(dataset_dir), layout)  # ConfigError naming the field; nothing submitted yet
    check_cluster(config)  # SlurmSetupError: commands, partition, node count
    run_path = Path(run_dir).resolve()
    run_path.mkdir(parents=True, exist_ok=True)
    paths = JobPaths(run_path)
    started = time.monotonic()
    with run_dir_lock(run_path):
        job_id = _job_to_follow(paths, on_line)
        if job_id is _ALREADY_COMPLETED:
            return _train_result(run_path, paths, _recorded_job_id(paths))
        follower = _JobFollower(paths, config.slurm.poll_interval_s, on_line)
        with follower.scancel_on_signals():
            try:
                if job_id is None:
                    argv = _write_job(config, paths, dataset_dir, layout, tracking_uri, init_weights, grace_s)
                    if on_start is not None:
                        on_start(layout, argv)
                    job_id = follower.submit(argv)
                else:
                    follower.reattach(job_id)
                if on_job is not None:
                    on_job(job_id)
                info = follower.follow(config, started, should_cancel, cancel_check_s)
            finally:
                follower.stop_unless_ended()  # every way out before the job ended
        _raise_unless_completed(config, paths, job_id, info, follower.stop_reason)
    return _train_result(run_path, paths, job_id)


_ALREADY_COMPLETED = "completed"  # _job_to_follow: the recorded job finished training; nothing to submit


def _write_job(config, paths: JobPaths, dataset_dir, layout, tracking_uri, init_weights, grace_s) -> list[str]:
    """RUN_DIR/config.json, the TrainJob every rank reads, and the batch script; the sbatch argv."""
    config.write_json(run_file(paths.run_dir, CONFIG))
    job = TrainJob(config=config, dataset_dir=str(dataset_dir), run_dir=str(paths.run_dir), init_weights=init_weights)
    job.write(run_file(paths.run_dir, TRAIN_JOB))
    # Only the variables ddpflow sets (base={}): the job inherits the rest from sbatch's environment.
    env = launch_env(config, paths.run_dir, tracking_uri=tracking_uri, gpus=layout.gpus, grace_s=grace_s, base={})
    paths.folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.script, batch_script(config, paths, dataset_dir, layout, env), durable=False)
    return sbatch_command(config, paths, layout)


def _recorded_job_id(paths: JobPaths) -> str | None:
    try:
        return str(json.loads(paths.record.read_text())["job_id"])
    except (OSError, ValueError, KeyError):
        return None


def read_end_record(paths: JobPaths, job_id: str) -> dict | None:
    """What the batch script wrote as it ended (exit_code, how, ended_at), or None."""
    try:
        return json.loads(paths.end_record(job_id).read_text())
    except (OSError, ValueError):
        return None


def _job_to_follow(paths: JobPaths, on_line) -> str | None:
    """The recorded job when it is still pending or running; _ALREADY_COMPLETED; or None: submit one."""
    job_id = _recorded_job_id(paths)
    if job_id is None:
        return None
    end = read_end_record(paths, job_id)
    try:
        info = show_job(job_id)
    except SlurmUnreachable as error:
        raise LaunchError(f"cannot tell whether Slurm job {job_id} of {paths.run_dir} still runs: {error}") from None
    if info is not None and not info.ended:
        return job_id
    state = info.state if info is not None else "forgotten by scontrol"
    if end is not None and end.get("exit_code") == 0 and (paths.run_dir / FINAL_MODEL).is_file():
        on_line(SlurmLine(None, f"job {job_id} of this run directory already COMPLETED ({end.get('ended_at')})"))
        return _ALREADY_COMPLETED
    how = f"exit code {end['exit_code']} at {end.get('ended_at')}" if end else "no end record"
    on_line(SlurmLine(None, f"the previous job {job_id} ended ({state}, {how}): submitting a new one", warning=True))
    return None


class _JobFollower:
    """Submits or finds one job, follows it to its end and streams its lines; cancels it on the way out."""

    def __init__(self, paths: JobPaths, poll_interval_s: float, on_line):
        self.paths = paths
        self.poll_interval_s = poll_interval_s
        self.on_line = on_line
        self.job_id: str | None = None
        self.info: JobInfo | None = None
        self.nodes: list[str] = []
        self.tail: _OutputTail | None = None
        self.stop_reason: LaunchError | None = None
        self.ended = False
        self.last_output = time.monotonic()
        self._said: set[str] = set()  # PENDING reasons and states already told

    # --- starting

    def submit(self, argv: list[str]) -> str:
        # No signal between sbatch answering and the id being on disk: a job nobody knows of would run on.
        held = self._hold_signals()
        try:
            job_id = submit(argv)
            record = {"job_id": job_id, "submitted_at": _now(), "sbatch": argv, "submitted_by_pid": os.getpid()}
            atomic_write_json(self.paths.record, record)
            self.job_id = job_id
            self.tail = _OutputTail(self.paths.output(job_id))
        finally:
            self._release_signals(held)
        self._say(f"submitted job {job_id}: {' '.join(argv)}")
        return job_id

    def reattach(self, job_id: str) -> None:
        self.job_id = job_id
        self.tail = _OutputTail(self.paths.output(job_id), from_end=True)  # the earlier lines were streamed before
        self._say(f"reattached to job {job_id}, submitted earlier for this run directory (no second job)")

    # --- following

    def follow(self, config: PipelineConfig, started: float, should_cancel, cancel_check_s: float) -> JobInfo | None:
        """Stream lines and poll the job until it ends or a reason to stop it comes; the last JobInfo seen."""
        train = config.train
        next_poll = next_cancel_check = 0.0
        in_main_thread = threading.current_thread() is threading.main_thread()
        while self.stop_reason is None:
            self._deliver_new_lines()
            now = time.monotonic()
            if now >= next_poll or self.paths.end_record(self.job_id).exists():
                next_poll = now + self.poll_interval_s
                self._poll()
                if self.ended:
                    self._deliver_new_lines()  # what the nodes wrote last
                    break
            running = self.info is not None and self.info.state == "RUNNING"
            if now - started > train.timeout_s:
                self.stop_reason = LaunchTimeout(
                    f"training exceeded train.timeout_s={train.timeout_s:g}s{self._pending_note()}; "
                    f"cancelled Slurm job {self.job_id}"
                )
            elif running and train.stall_timeout_s is not None and now - self.last_output > train.stall_timeout_s:
                self.stop_reason = LaunchStalled(
                    f"training stalled: no output for train.stall_timeout_s={train.stall_timeout_s:g}s; "
                    f"cancelled Slurm job {self.job_id}"
                )
            elif not in_main_thread and not threading.main_thread().is_alive():
                self.stop_reason = LaunchInterrupted(
                    f"the launching process is shutting down; cancelled Slurm job {self.job_id}"
                )
            elif should_cancel is not None and now >= next_cancel_check:
                next_cancel_check = now + cancel_check_s
                why = should_cancel()
                if why:
                    self.stop_reason = LaunchInterrupted(f"{why}; cancelled Slurm job {self.job_id}")
            if self.stop_reason is None:
                time.sleep(_TICK_S)
        return self.info

    def _poll(self) -> None:
        try:
            info = show_job(self.job_id)
        except SlurmUnreachable as error:
            self._say(f"{error}; asking again in {self.poll_interval_s:g} s", warning=True, once=str(error))
            return
        if info is None:  # forgotten: it ended more than MinJobAge ago
            self.ended = True
            return
        self.info = info
        if info.node_list and not self.nodes and info.state != "PENDING":
            self.nodes = expand_nodes(info.node_list)
        if info.pending_reason:
            self._say(f"job {self.job_id} is PENDING: {info.pending_reason}", warning=True, once=info.reason)
        elif info.state == "RUNNING" and "RUNNING" not in self._said:
            self.last_output = time.monotonic()  # the stall clock starts when the job does
            self._say(f"job {self.job_id} is RUNNING on {info.node_list}", once="RUNNING")
        if info.ended:
            self.ended = True

    def _deliver_new_lines(self) -> None:
        raws = self.tail.read()
        if not self.nodes and any(_SRUN_LABEL.match(raw) for raw in raws):
            self._poll()  # the nodes' names, to label their lines (the job started since the last poll)
        for raw in raws:
            if not raw.strip():
                continue
            line = label_line(raw, self.nodes)
            if not line.text.strip():
                continue  # torchrun's tail emits empty "[defaultN]:" lines
            self.last_output = time.monotonic()
            self.on_line(line)

    def _pending_note(self) -> str:
        if self.info is not None and self.info.state == "PENDING":
            return f" while Slurm job {self.job_id} was still PENDING ({self.info.pending_reason or 'no reason given'})"
        return ""

    def _say(self, text: str, *, warning: bool = False, once: str | None = None) -> None:
        if once is not None:
            if once in self._said:
                return
            self._said.add(once)
        self.on_line(SlurmLine(None, text, warning=warning))

    # --- stopping

    def stop_unless_ended(self) -> None:
        """Every way out of following before the job ended: scancel, and wait until nothing of it is left."""
        if self.job_id is None or self.ended:
            return
        last = cancel(self.job_id)
        self.ended = True
        self._deliver_new_lines()
        self._say(f"cancelled job {self.job_id} ({last.state if last else 'gone'}): no step of it is left")

    def scancel_now(self) -> None:
        """From a signal handler: the job must go even if the process dies of the signal next."""
        if self.job_id is not None and not self.ended:
            try:
                cancel(self.job_id, confirm_s=0)
            except LaunchError:
                pass  # not confirmed yet: stop_unless_ended() waits for it

    @contextmanager
    def scancel_on_signals(self) -> Iterator[None]:
        """While the job is ours: SIGTERM/SIGINT scancel it first, then go to the previous handler."""
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set handlers; follow() watches the main thread instead
            return
        previous = {}

        def handler(signum, frame):
            self.stop_reason = LaunchInterrupted(
                f"received {signal.Signals(signum).name}; cancelled Slurm job {self.job_id}"
            )
            self.scancel_now()
            chain_to_previous_handler(previous[signum], signum, frame)

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    @staticmethod
    def _hold_signals() -> set | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

    @staticmethod
    def _release_signals(held: set | None) -> None:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came meanwhile is delivered now


# ----------------------------------------------------------------------------- the end


def _raise_unless_completed(
    config: PipelineConfig, paths: JobPaths, job_id: str, info: JobInfo | None, stop: LaunchError | None
) -> None:
    """Nothing when the job COMPLETED; otherwise the error that says why not."""
    if stop is not None:
        raise stop
    end = read_end_record(paths, job_id)
    if info is not None:
        state = info.state
    elif end is not None:
        state = "COMPLETED" if end.get("exit_code") == 0 else "FAILED"
    else:
        state = "UNKNOWN"
    if state == "COMPLETED":
        return
    where = f"Slurm job {job_id} ended {state}" + (f" on {info.node_list}" if info is not None else "")
    if state == "TIMEOUT":
        limit = config.slurm.time_limit or "the partition's default"
        raise LaunchTimeout(f"{where}: it reached its time limit (slurm.time_limit: {limit})")
    if state == "CANCELLED":
        raise LaunchInterrupted(f"{where}: it was cancelled outside ddpflow (scancel, an administrator or preemption)")
    raise job_failure(paths, job_id, info, where)


def job_failure(paths: JobPaths, job_id: str, info: JobInfo | None, where: str) -> LaunchError:
    """The root cause of a failed job: a node that cannot see a path, else a failed rank, else the job's state."""
    lines = _OutputTail(paths.output(job_id)).read()
    unseen = [match for match in map(_CANNOT_SEE.search, lines) if match]
    if unseen:
        missing = "; ".join(f"node {m['node']} cannot see {m['path']}" for m in unseen)
        return SlurmSetupError(
            f"{where}: {missing}. Every node must see the dataset, RUN_DIR and the Python environment at the "
            "same paths (a shared filesystem, docs/slurm.md)"
        )
    nodes = expand_nodes(info.node_list) if info is not None and info.node_list else []
    by_node = _torchrun_lines_by_node(lines, nodes)
    for node in _failed_nodes_first(lines, by_node):
        node_dir = paths.node_folder(job_id, node)
        failure = failure_from_output(node_dir, _node_job_dir(paths, job_id, node), by_node[node], returncode=1)
        if failure.rank is not None:
            return RankFailed(
                f"{where}: node {node}: {failure}",
                rank=failure.rank,
                exitcode=failure.exitcode,
                root_cause=failure.root_cause,
                log_file=failure.log_file,
            )
    reason = f" (Reason={info.reason}, ExitCode={info.exit_code})" if info is not None else ""
    last = next((text for text in reversed(lines) if text.strip()), "no output")
    hint = " Ask for more with slurm.sbatch_args, e.g. '--mem=16G'." if info and info.state == "OUT_OF_MEMORY" else ""
    return LaunchError(f"{where}{reason}; its output {paths.output(job_id)} ends: {last}.{hint}")


def _torchrun_lines_by_node(lines: list[str], nodes: list[str]) -> dict[str, list[str]]:
    """Each node's torchrun lines (not its ranks'): where torchrun prints its ChildFailedError summary."""
    by_node: dict[str, list[str]] = {node: [] for node in nodes}
    for raw in lines:
        line = label_line(raw, nodes)
        if line.node is not None and line.rank is None:
            by_node.setdefault(line.node, []).append(line.text)
    return by_node


def _failed_nodes_first(lines: list[str], by_node: dict[str, list[str]]) -> list[str]:
    """Nodes in the order srun saw their agents fail ("task K: Exited with exit code C"), then the rest."""
    failed = [m["node"] for m in map(_SRUN_TASK_EXIT.search, lines) if m and m["code"] != "0"]
    ordered = list(dict.fromkeys(node for node in failed if node in by_node))
    return ordered + [node for node in by_node if node not in ordered]


def _node_job_dir(paths: JobPaths, job_id: str, node: str) -> Path | None:
    """torchrun's log folder on that node for this job: <node>/logs/job-<id>_<random>/."""
    found = sorted(paths.node_log_dir(job_id, node).glob(f"job-{job_id}_*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _train_result(run_path: Path, paths: JobPaths, job_id: str | None) -> TrainResult:
    model_path = run_file(run_path, FINAL_MODEL)
    if not model_path.is_file():
        raise RuntimeError(f"Slurm job {job_id} COMPLETED but wrote no {model_path}: training did not finish")
    restarts = 0
    if job_id is not None:
        for node_dir in paths.job_folder(job_id).glob("*/logs"):
            attempts = len(list(node_dir.glob(f"job-{job_id}_*/attempt_*")))
            restarts = max(restarts, attempts - 1)
    return TrainResult(str(run_path), str(model_path), last_metrics(run_file(run_path, METRICS)), restarts)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
