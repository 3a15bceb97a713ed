"""Talking to Slurm: the preflight, ``sbatch``, ``scontrol show job`` and ``scancel`` (plain Python).

    check_cluster(config)                    # before submitting: commands answer, partition exists, nodes fit
    check_cluster(config, "score")           # the same for a scoring: its node count and errors are score.*
    job_id = submit(argv)                    # sbatch --parsable; SlurmSetupError with sbatch's own words
    job = show_job(job_id)                   # JobInfo, or None once Slurm has forgotten the job
    cancel(job_id, confirm_s=30)             # scancel, then wait until no step of the job is left

Every command runs from an argument list (never a shell) with the caller's environment, so
``SLURM_CONF`` and the Slurm programs are those of the place where the flow runs (a login
node, or a Prefect worker on it). Accounting (``sacct``) is often missing on clusters, so
only ``scontrol`` is used to follow a job.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

from ddpflow.launch.failure import LaunchError
from training.core.config import PipelineConfig

COMMAND_TIMEOUT_S = 30.0
CANCEL_CONFIRM_S = 30.0  # scancel -> no step left, or the stop is reported as failed
REQUIRED = ("sbatch", "scontrol", "scancel")

# Job states after which nothing of the job runs any more (squeue(1), JOB STATE CODES).
ENDED_STATES = frozenset(
    {
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
    }
)  # fmt: skip
# PENDING reasons that explain themselves badly, in the user's words.
PENDING_REASONS = {
    "PartitionTimeLimit": "slurm.time_limit is above the partition's MaxTime: the job will wait forever",
    "PartitionNodeLimit": "the job's nodes (train.nnodes, score.nnodes) are outside the partition's node limits: "
    "the job will wait forever",
    "PartitionDown": "the partition is down",
    "ReqNodeNotAvail": "a node the job needs is unavailable (down, drained or reserved)",
    "Resources": "waiting for free nodes",
    "Priority": "waiting behind jobs of higher priority",
    "QOSMaxWallDurationPerJobLimit": "slurm.time_limit is above the QOS's limit: the job will wait forever",
    "AssocMaxWallDurationPerJobLimit": "slurm.time_limit is above the account's limit: the job will wait forever",
    "InvalidAccount": "slurm.account is not valid for you",
}


class SlurmSetupError(LaunchError, ValueError):
    """The job cannot run as configured or on this machine; retrying would fail the same way."""


@dataclass(frozen=True)
class JobInfo:
    """The fields of ``scontrol show job`` a launcher needs."""

    job_id: str
    state: str  # JobState: PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, ...
    reason: str  # Reason=: why it is pending, or why it ended ("None" when there is none)
    exit_code: str  # ExitCode=: "status:signal" of the batch script
    node_list: str  # NodeList=: n[1-2], "(null)" while pending
    fields: dict[str, str]

    @property
    def ended(self) -> bool:
        """Nothing of the job runs any more (COMPLETING still has processes on some node)."""
        return self.state in ENDED_STATES

    @property
    def pending_reason(self) -> str | None:
        if self.state != "PENDING" or self.reason in ("None", ""):
            return None
        explained = PENDING_REASONS.get(self.reason)
        return f"{self.reason} ({explained})" if explained else self.reason


def run_command(argv: list[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm command; a missing program or one that does not answer is a SlurmSetupError."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmSetupError(_missing_message([argv[0]])) from None
    except subprocess.TimeoutExpired:
        raise SlurmSetupError(f"`{' '.join(argv)}` did not answer within {timeout_s:g} s") from None


def _missing_message(missing: list[str], section: str = "train") -> str:
    return (
        f"{section}.launcher 'slurm' needs the Slurm commands where the flow runs (a login node, or a Prefect "
        f"worker on one); not found on PATH: {', '.join(missing)}"
    )


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (scontrol's one-line form) as a dict."""
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def check_cluster(config: PipelineConfig, section: str = "train") -> dict[str, str]:
    """The preflight: the commands exist and answer, the partition exists and has the nodes. Returns it.

    ``section``: the stage's settings, ``train`` (train.nnodes) or ``score`` (score.nnodes). Raises
    SlurmSetupError naming the missing command or the field (slurm.partition, train.nnodes, score.nnodes).
    """
    missing = [name for name in REQUIRED if shutil.which(name) is None]
    if missing:
        raise SlurmSetupError(_missing_message(missing, section))
    done = run_command(["scontrol", "show", "partition", "-o"])
    if done.returncode != 0:
        raise SlurmSetupError(f"scontrol does not answer (exit {done.returncode}): {_last_line(done)}")
    partitions = [parse_fields(line) for line in done.stdout.splitlines() if line.strip()]
    names = [p.get("PartitionName", "?") for p in partitions]
    wanted = config.slurm.partition
    if wanted is None:
        partition = next((p for p in partitions if p.get("Default") == "YES"), None)
        if partition is None:
            raise SlurmSetupError(f"slurm.partition: the cluster has no default partition; name one of {names}")
    else:
        partition = next((p for p in partitions if p.get("PartitionName") == wanted), None)
        if partition is None:
            raise SlurmSetupError(f"slurm.partition: {wanted!r} does not exist on this cluster; it has {names}")
    nodes, wanted_nodes = partition.get("TotalNodes", ""), getattr(config, section).nnodes
    if nodes.isdigit() and wanted_nodes > int(nodes):
        raise SlurmSetupError(
            f"{section}.nnodes: {wanted_nodes} nodes asked for, but partition "
            f"{partition['PartitionName']!r} has {nodes}"
        )
    return partition


def submit(argv: list[str]) -> str:
    """Run ``sbatch --parsable ...``; the job id. SlurmSetupError with sbatch's message when it refuses."""
    done = run_command(argv)
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    if done.returncode != 0 or not job_id.isdigit():
        raise SlurmSetupError(f"sbatch refused the job (exit {done.returncode}): {_last_line(done)}")
    return job_id


def show_job(job_id: str) -> JobInfo | None:
    """The job as scontrol knows it; None once it has forgotten it (MinJobAge after the end).

    A controller that does not answer raises SlurmUnreachable: the caller decides whether to wait.
    """
    done = run_command(["scontrol", "show", "job", "-o", str(job_id)])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise SlurmUnreachable(f"scontrol show job {job_id} failed (exit {done.returncode}): {_last_line(done)}")
    fields = parse_fields(done.stdout)
    return JobInfo(
        job_id=str(job_id),
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        exit_code=fields.get("ExitCode", ""),
        node_list=fields.get("NodeList", ""),
        fields=fields,
    )


class SlurmUnreachable(LaunchError):
    """slurmctld did not answer a query (it may be restarting)."""


def expand_nodes(node_list: str) -> list[str]:
    """``n[1-2]`` -> ``['n1', 'n2']`` in Slurm's order (the order of SLURM_NODEID)."""
    done = run_command(["scontrol", "show", "hostnames", node_list])
    return done.stdout.split() if done.returncode == 0 else []


def cancel(job_id: str, *, confirm_s: float = CANCEL_CONFIRM_S, poll_s: float = 0.25) -> JobInfo | None:
    """scancel the job and wait until Slurm says nothing of it runs; the last state seen.

    Raises LaunchError when the job still has processes after ``confirm_s`` (a node that does not
    answer): the message names the job and its state, so a person can look.
    """
    run_command(["scancel", str(job_id)])
    deadline = time.monotonic() + confirm_s
    while True:
        try:
            job = show_job(job_id)
        except SlurmUnreachable:
            job = JobInfo(str(job_id), "UNKNOWN", "", "", "", {})
        if job is None or job.ended:
            return job
        if time.monotonic() > deadline:
            raise LaunchError(
                f"scancel {job_id}: the job is still {job.state} on {job.node_list} after {confirm_s:g} s; "
                f"check those nodes (scontrol show job {job_id})"
            )
        time.sleep(poll_s)


def _last_line(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or done.stdout or "").strip()
    return text.splitlines()[-1] if text else "no output"
