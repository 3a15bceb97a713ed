"""Run a stage's ranks as one Slurm job, and train that way: the train stage's contract, through ``sbatch``
(plain Python, no Prefect).

    result = run_training_on_slurm(TrainRequest(config, dataset_dir, run_dir, on_line=print, on_job=record_job_id))
    job_id = run_slurm_job(SlurmStage(RankJob(...), prepare, finished, env, on_line=print))   # any stage's ranks

``run_slurm_job`` is the part every stage shares (training here, batch scoring in ddpflow/launch/scoring.py):
what follows is what it does; ``run_training_on_slurm`` fills in the training's ``RankJob`` (script.py) and
reads the result.

The train stage's contract (stage.py), as the local launcher (local.py) keeps it: run the ranks
to completion, stream every line to ``request.on_line`` in the calling thread, stop on
cancellation, signals and ``train.timeout_s``, and end with a ``TrainResult`` or one of the same
errors (``RankFailed`` with the root cause, ``LaunchTimeout``, ``LaunchStalled``,
``LaunchInterrupted``, ``LaunchError``). ``LAUNCHERS["slurm"]`` in stage.py.

How:
  * preflight (commands.check_cluster): the commands answer, the partition exists;
  * the batch script and the sbatch argv (script.py), the job id recorded in
    RUN_DIR/slurm/job.json before anything else can happen (signals are held meanwhile);
  * following with ``scontrol show job`` every ``slurm.poll_interval_s`` (PENDING reasons are
    said once each), and every node's lines from the job's output file, labelled
    ``[n2 rank 1]`` / ``[n2 torchrun]`` / ``[slurm]``;
  * the end (output.py): COMPLETED -> the result; otherwise the root cause per node, with
    the local launcher's failure analysis (failure.py) on that node's torchrun lines and logs;
  * any way out before the end (exception, SIGTERM/SIGINT, cancellation, timeout, stall) runs
    ``scancel`` and waits up to 30 s until Slurm says nothing of the job is left;
  * preemption: the job asks for ``train.preempt_signal`` ahead of its time limit and requeues itself once its
    ranks saved (script.py, docs/reliability.md); a requeued job is the same job, followed on to its end;
    ranks that stopped in a job that was not requeued: ``LaunchPreempted`` (the task's retry resumes);
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
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ddpflow.launch import command
from ddpflow.launch.command import launch_env
from ddpflow.launch.failure import LaunchError, LaunchInterrupted, LaunchPreempted, LaunchStalled, LaunchTimeout
from ddpflow.launch.process_tree import forward_signals
from ddpflow.launch.slurm.commands import (
    JobInfo,
    SlurmSetupError,
    SlurmUnreachable,
    cancel,
    check_cluster,
    expand_nodes,
    show_job,
    submit,
)
from ddpflow.launch.slurm.output import (
    SRUN_LABEL,
    OutputTail,
    SlurmLine,
    label_line,
    raise_unless_completed,
    read_end_record,
)
from ddpflow.launch.slurm.script import JobPaths, RankJob, batch_script, sbatch_command
from ddpflow.launch.stage import TrainRequest, TrainResult, check_request, finished_result, write_job
from ddpflow.launch.supervisor import OutputLine, describe_preempted, read_preempted, run_dir_lock
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write_json, atomic_write_text
from training.core.layout import FINAL_MODEL, MANIFEST, SCRIPT_DONE, TRAIN_JOB
from training.core.topology import RankLayout

__all__ = ["RankJob", "SlurmLine", "SlurmStage", "has_unfinished_job", "run_slurm_job", "run_training_on_slurm"]

_TICK_S = 0.2  # how often new output lines and the end record are looked for


# ----------------------------------------------------------------------------- any stage's job


@dataclass(frozen=True)
class SlurmStage:
    """A stage's ranks as one Slurm job: the job, what it needs written first, and the launcher contract's events
    and limits (stage.py: ``TrainRequest``)."""

    job: RankJob
    prepare: Callable[[], None]  # writes the files the ranks read; called only before a new job is submitted
    finished: Callable[[], bool]  # the stage's result is on disk (model.pt, manifest.json): no job to run again
    env: dict[str, str]  # the variables ddpflow sets for the ranks (command.py: launch_env, base={})
    on_line: Callable[[OutputLine], None] = print
    on_start: Callable[[RankLayout, list[str]], None] | None = None  # just before a job is submitted
    on_job: Callable[[str], None] | None = None  # the job it submitted or found
    should_cancel: Callable[[], str | None] | None = None
    cancel_check_s: float = 2.0
    timeout_s: float | None = None  # <section>.timeout_s: submit to end, pending included
    stall_timeout_s: float | None = None  # <section>.stall_timeout_s: no line while RUNNING


def run_slurm_job(stage: SlurmStage) -> str:
    """Submit ``stage.job`` (or reattach to the one its run directory recorded), follow it to its end, and return
    its id when it COMPLETED; every way out before the end scancels it. Errors as the train stage's contract."""
    job = stage.job
    check_cluster(job.config, job.section)  # SlurmSetupError: commands, partition, node count
    paths = job.paths
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    on_line = stage.on_line
    with run_dir_lock(paths.run_dir):
        previous = _RecordedJob.read(paths)
        if previous is not None and previous.completed and stage.finished():
            on_line(SlurmLine(None, f"job {previous.job_id} of this run directory already COMPLETED: nothing to run"))
            return previous.job_id
        job_id = previous.job_id if previous is not None and previous.still_running else None
        if previous is not None and job_id is None:
            on_line(SlurmLine(None, f"{previous.how_it_ended()}: submitting a new job", warning=True))
        follower = _JobFollower(paths, job.config.slurm.poll_interval_s, on_line)
        with follower.scancel_on_signals():
            try:
                if job_id is None:
                    argv = _write_script(stage)
                    if stage.on_start is not None:
                        stage.on_start(job.layout, argv)
                    job_id = follower.submit(argv)
                else:
                    follower.reattach(job_id)
                if stage.on_job is not None:
                    stage.on_job(job_id)
                info = follower.follow(stage, started)
            finally:
                follower.stop_unless_ended()  # every way out before the job ended
        preempted = read_preempted(paths.run_dir) if job.saves_on_preemption else None
        if follower.stop_reason is None and preempted is not None and not stage.finished():
            raise LaunchPreempted(f"Slurm job {job_id}: {describe_preempted(preempted)}", preempted)
        raise_unless_completed(job.config, paths, job_id, info, follower.stop_reason)
    return job_id


def _write_script(stage: SlurmStage) -> list[str]:
    """The files the ranks read, then the batch script; the sbatch argv."""
    paths = stage.job.paths
    if "%" in str(paths.folder):
        raise SlurmSetupError(
            f"{stage.job.run_dir_key}: Slurm reads % in output file names as a pattern: {paths.folder}"
        )
    stage.prepare()
    paths.folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.script, batch_script(stage.job, stage.env), durable=False)
    return sbatch_command(stage.job)


# ----------------------------------------------------------------------------- the train stage


def run_training_on_slurm(request: TrainRequest) -> TrainResult:
    """The train stage's contract (stage.py) as one Slurm job.

    ``request.on_start(layout, sbatch argv)`` is told just before a job is submitted (not when
    reattaching); ``request.on_job(job_id)`` the job it submitted or found.
    """
    config = request.config
    layout = check_request(request)  # each node's ranks (slurm.gpus_per_node); ConfigError: nothing submitted
    run_path = Path(request.run_dir).resolve()
    # Absolute: the nodes' ranks start in the project root (--chdir), not where the flow runs.
    dataset_dir = None if request.dataset_dir is None else str(Path(request.dataset_dir).resolve())
    job = RankJob(
        config,
        JobPaths(run_path),
        job_file=run_path / TRAIN_JOB,
        program=tuple(command.rank_program(config, run_path / TRAIN_JOB)),  # ddpflow's trainer, or train.script
        nnodes=config.train.nnodes,
        layout=layout,
        visible=_visible(config, dataset_dir),
        workdir=command.rank_workdir(config),
        max_restarts=config.train.max_restarts,
        saves_on_preemption=True,
        preempt_signal=config.train.preempt_signal,
        requeue=config.slurm.requeue,
    )
    # Only the variables ddpflow sets (base={}): the job inherits the rest from sbatch's environment.
    # torchrun passes a stop signal on to the ranks and waits this long for them to save (loop/preemption.py).
    grace_s = max(request.grace_s, config.train.preempt_grace_s)
    env = launch_env(config, run_path, tracking_uri=request.tracking_uri, gpus=layout.gpus, grace_s=grace_s, base={})
    stage = SlurmStage(
        job,
        prepare=lambda: write_job(request, run_path, dataset_dir),  # RUN_DIR/config.json and the TrainJob
        finished=(run_path / (SCRIPT_DONE if config.train.script else FINAL_MODEL)).is_file,
        env=env,
        on_line=request.on_line,
        on_start=request.on_start,
        on_job=request.on_job,
        should_cancel=request.should_cancel,
        cancel_check_s=request.cancel_check_s,
        timeout_s=config.train.timeout_s,
        stall_timeout_s=config.train.stall_timeout_s,
    )
    return _train_result(config, run_path, job.paths, run_slurm_job(stage))


def _visible(config: PipelineConfig, dataset_dir: str | None) -> tuple[Path, ...]:
    """What every node must see besides the job file: the dataset's manifest, a training script's file."""
    paths = [Path(dataset_dir) / MANIFEST] if dataset_dir is not None else []
    return (*paths, *([Path(config.train.script)] if config.train.script else []))


def _recorded_job_id(paths: JobPaths) -> str | None:
    try:
        return str(json.loads(paths.record.read_text())["job_id"])
    except (OSError, ValueError, KeyError):
        return None


def has_unfinished_job(run_dir: str | os.PathLike) -> bool:
    """RUN_DIR recorded a Slurm job that has not recorded its end: it may still run (files only, no Slurm call).

    The resume rule (ddpflow/rundirs.py) uses it so that a new run of the same config reattaches to
    that job, even before the job wrote its first checkpoint.
    """
    paths = JobPaths(Path(run_dir))
    job_id = _recorded_job_id(paths)
    return job_id is not None and not paths.end_record(job_id).exists()


@dataclass(frozen=True)
class _RecordedJob:
    """The job RUN_DIR/slurm/job.json names, as Slurm and its own end record tell it."""

    job_id: str
    info: JobInfo | None  # None: scontrol has forgotten it (it ended more than MinJobAge ago)
    end: dict | None  # what the job wrote as it ended (None: it did not, or not yet)

    @classmethod
    def read(cls, paths: JobPaths) -> _RecordedJob | None:
        job_id = _recorded_job_id(paths)
        if job_id is None:
            return None
        try:
            info = show_job(job_id)
        except SlurmUnreachable as error:
            raise LaunchError(
                f"cannot tell whether Slurm job {job_id} of {paths.run_dir} still runs: {error}"
            ) from None
        return cls(job_id, info, read_end_record(paths, job_id))

    @property
    def still_running(self) -> bool:
        """PENDING, RUNNING, COMPLETING...: follow it rather than submit a second job."""
        return self.info is not None and not self.info.ended

    @property
    def completed(self) -> bool:
        """It ended, and wrote that it ended well."""
        return not self.still_running and self.end is not None and self.end.get("exit_code") == 0

    def how_it_ended(self) -> str:
        state = self.info.state if self.info is not None else "forgotten by scontrol"
        how = f"exit code {self.end.get('exit_code')} at {self.end.get('ended_at')}" if self.end else "no end record"
        return f"the previous job {self.job_id} of this run directory ended ({state}, {how})"


class _JobFollower:
    """Submits or finds one job, follows it to its end and streams its lines; cancels it on the way out."""

    def __init__(self, paths: JobPaths, poll_interval_s: float, on_line):
        self.paths = paths
        self.poll_interval_s = poll_interval_s
        self.on_line = on_line
        self.job_id: str | None = None
        self.info: JobInfo | None = None
        self.nodes: list[str] = []
        self.tail: OutputTail | None = None
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
            self.tail = OutputTail(self.paths.output(job_id))
        finally:
            self._release_signals(held)
        self._say(f"submitted job {job_id}: {' '.join(argv)}")
        return job_id

    def reattach(self, job_id: str) -> None:
        self.job_id = job_id
        self.tail = OutputTail(self.paths.output(job_id), from_end=True)  # the earlier lines were streamed before
        self._say(
            f"reattached to job {job_id}, submitted earlier for this run directory (no second job); "
            f"its earlier lines: {self.paths.output(job_id)}"
        )

    # --- following

    def follow(self, stage: SlurmStage, started: float) -> JobInfo | None:
        """Stream lines and poll the job until it ends or a reason to stop it comes; the last JobInfo seen."""
        what, section = stage.job.stage, stage.job.section
        timeout_s, stall_timeout_s, should_cancel = stage.timeout_s, stage.stall_timeout_s, stage.should_cancel
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
            if timeout_s is not None and now - started > timeout_s:
                self.stop_reason = LaunchTimeout(
                    f"{what} exceeded {section}.timeout_s={timeout_s:g}s{self._pending_note()}; "
                    f"cancelled Slurm job {self.job_id}"
                )
            elif running and stall_timeout_s is not None and now - self.last_output > stall_timeout_s:
                self.stop_reason = LaunchStalled(
                    f"{what} stalled: no output for {section}.stall_timeout_s={stall_timeout_s:g}s; "
                    f"cancelled Slurm job {self.job_id}"
                )
            elif not in_main_thread and not threading.main_thread().is_alive():
                self.stop_reason = LaunchInterrupted(
                    f"the launching process is shutting down; cancelled Slurm job {self.job_id}"
                )
            elif should_cancel is not None and now >= next_cancel_check:
                next_cancel_check = now + stage.cancel_check_s
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
        if not self.nodes and any(SRUN_LABEL.match(raw) for raw in raws):
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

    def scancel_on_signals(self):
        """While the job is ours: SIGTERM/SIGINT scancel it first, then go to the previous handler (in the main
        thread only; elsewhere follow() watches the main thread instead)."""

        def stop(signum: int) -> None:
            self.stop_reason = LaunchInterrupted(
                f"received {signal.Signals(signum).name}; cancelled Slurm job {self.job_id}"
            )
            self.scancel_now()

        return forward_signals(stop)

    @staticmethod
    def _hold_signals() -> set | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

    @staticmethod
    def _release_signals(held: set | None) -> None:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came meanwhile is delivered now


def _train_result(config: PipelineConfig, run_path: Path, paths: JobPaths, job_id: str | None) -> TrainResult:
    restarts = 0
    if job_id is not None:
        for node_dir in paths.job_folder(job_id).glob("*/logs"):
            attempts = len(list(node_dir.glob(f"job-{job_id}_*/attempt_*")))
            restarts = max(restarts, attempts - 1)
    return finished_result(config, run_path, restarts, ended=f"Slurm job {job_id} COMPLETED")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
