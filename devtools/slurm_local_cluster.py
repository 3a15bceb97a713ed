"""A two-node Slurm cluster on this machine: for the tests, the benchmark, and trying ``launcher: slurm``.

    cluster = start(Path("/tmp/slurm"))      # slurmctld + slurmd n1, n2; SLURM_CONF=cluster.conf for clients
    ...
    stop(cluster)                            # TERM, 5 s, KILL, by PID

Debian's packages (slurmctld, slurmd, slurm-client, munge; recipe: ../shared/SLURM.md), run as
root with ``auth/none``, a fresh state directory and free ports: partition ``debug`` (both nodes,
no time limit, the default) and ``short`` (both nodes, MaxTime 1 minute: a job asking for more
pends with PartitionTimeLimit). Batch jobs are scheduled when submitted (``batch_sched_delay=0``;
Slurm's default of 3 s suits clusters that take many submissions a second). Both nodes share
this machine's filesystem and address, except that ``n2`` runs in a private mount namespace where
``hidden_from_n2`` is an empty tmpfs: a path there exists here and on ``n1`` but not on ``n2``,
which is how a node that does not see the shared filesystem looks. Nothing here is needed on a
real cluster, and it is not installed with ddpflow (devtools/ is for tests and bench/ only).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from devtools.ports import free_ports
from devtools.waiting import wait_until

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
NODES = ("n1", "n2")
PARTITION = "debug"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0

SLURM_CONF_TEMPLATE = """\
ClusterName=ddpflowtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MailProg=/bin/true
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
Waittime=0
# Schedule a batch job when it is submitted (the default lets sbatch jobs wait up to 3 s for a batch of them).
SchedulerParameters=batch_sched_delay=0
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs={cpus} RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName={partition} Nodes=n1,n2 Default=YES MaxTime=UNLIMITED State=UP
PartitionName=short Nodes=n1,n2 Default=NO MaxTime=1 State=UP
"""


@dataclass
class LocalSlurmCluster:
    """A running test cluster: its files, its client environment and a few probes for assertions."""

    dir: Path
    conf: Path
    partition: str = PARTITION
    hidden_from_n2: Path | None = None  # exists here and on n1, an empty tmpfs on n2 (None: no mount namespaces)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict ({} once Slurm has forgotten the job)."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if done.returncode != 0:
            return {}
        return dict(part.split("=", 1) for part in done.stdout.split() if "=" in part)

    def job_ids(self) -> list[str]:
        """Every job the controller still knows (finished ones stay MinJobAge = 300 s)."""
        done = self.run("squeue", "-h", "-t", "all", "-o", "%i")
        return sorted(done.stdout.split(), key=int)

    def active_job_ids(self) -> list[str]:
        done = self.run("squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED", "-o", "%i")
        return done.stdout.split()

    def cancel_all(self) -> None:
        """scancel every job of both partitions and wait until none runs."""
        self.run("scancel", "--partition", self.partition, check=False)
        self.run("scancel", "--partition", "short", check=False)
        wait_until(lambda: not self.active_job_ids(), 30, "every job of the session to end")

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)


def missing_requirements() -> list[str]:
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd runs as root)")
    return missing


def can_hide_paths() -> bool:
    """Whether a private mount namespace with a tmpfs can be made here (root with CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs probe /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def write_conf(directory: Path) -> Path:
    for sub in ("state", "spool/n1", "spool/n2", "run", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, n1_port, n2_port = free_ports(3)
    # Each node may claim the host's CPUs (never more than `slurmd -C` reports, or it drains).
    conf = SLURM_CONF_TEMPLATE.format(
        host=socket.gethostname().split(".")[0],
        ctld_port=ctld_port,
        n1_port=n1_port,
        n2_port=n2_port,
        cpus=os.cpu_count() or 1,
        dir=directory,
        partition=PARTITION,
    )
    path = directory / "slurm.conf"
    path.write_text(conf)
    return path


def start(directory: Path) -> LocalSlurmCluster:
    conf = write_conf(directory)
    cluster = LocalSlurmCluster(dir=directory, conf=conf)
    if can_hide_paths():
        cluster.hidden_from_n2 = directory / "hidden-from-n2"
        cluster.hidden_from_n2.mkdir()
    commands = {
        "slurmctld": ["slurmctld", "-D", "-c", "-f", str(conf)],
        "n1": ["slurmd", "-D", "-N", "n1", "-f", str(conf)],
        "n2": ["slurmd", "-D", "-N", "n2", "-f", str(conf)],
    }
    if cluster.hidden_from_n2 is not None:
        # unshare and sh exec into slurmd: the Popen's PID stays slurmd's.
        commands["n2"] = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs ddpflow-hidden "$0" && exec "$@"', str(cluster.hidden_from_n2), *commands["n2"],
        ]  # fmt: skip
    try:
        for name, argv in commands.items():
            with open(directory / "log" / f"{name}.stdout", "wb") as out:
                cluster.daemons.append(
                    subprocess.Popen(
                        argv,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=cluster.env,
                        start_new_session=True,
                    )
                )
            if name == "slurmctld":
                wait_until(lambda: "UP" in cluster.run("scontrol", "ping", check=False).stdout, 30, "slurmctld")
        idle = lambda: cluster.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).stdout.strip() == "2"  # noqa: E731
        wait_until(idle, START_TIMEOUT_S, "both nodes idle")
    except BaseException as error:
        log = cluster.log_tail()
        stop(cluster)
        if isinstance(error, TimeoutError):
            raise RuntimeError(f"the test Slurm cluster did not start: {error}\n{log}") from None
        raise
    return cluster


def stop(cluster: LocalSlurmCluster) -> None:
    """Cancel the jobs left, then TERM the three daemons, wait up to 5 s, KILL what is left; by PID only.

    (slurmstepd outlives slurmd: a job still running when the daemons stop would keep its processes.)
    """
    try:
        if cluster.daemons and cluster.daemons[0].poll() is None:  # the controller still answers
            cluster.cancel_all()
    except (TimeoutError, subprocess.SubprocessError, OSError):
        pass  # stopping the daemons matters more
    for daemon in cluster.daemons:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for daemon in cluster.daemons:
        try:
            daemon.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=5)
