"""The Slurm batch script of a ``RankJob`` (a training run, or a batch scoring) and the sbatch command (plain Python).

    job = RankJob(config, JobPaths(run_dir), job_file, program, nnodes, layout, visible=(...))
    text = batch_script(job, env)        # RUN_DIR/slurm/job.sh, kept for people
    argv = sbatch_command(job)           # a list, never a shell string

A ``RankJob`` is what differs between the stages that run ranks on Slurm: the file every rank reads, the program
it runs, the node count and the setting that asked for it (``train.nnodes``, ``score.nnodes``), what every node
must see, and whether a preempted job saves and requeues itself (training) or simply stops (scoring: run again,
it resumes from its part files). Training's RUN_DIR is the job's run directory; a scoring's is OUTPUT/.score.

What the script does, on the job's first node (where Slurm runs a batch script):
  1. ``srun`` one short step on every node: do the job's files (the dataset, the job file, the model) and the
     Python interpreter exist there? A node that cannot see one prints
     ``ddpflow: node NODE cannot see PATH`` and the job stops before torchrun starts.
  2. The rendezvous: the first node's ``NodeAddr`` and a free port on it.
  3. ``srun --ntasks-per-node=1``: one torchrun agent per node, c10d rendezvous,
     ``--rdzv-id job-<job id>``, ``is_host=1`` only on node 0 (the others would fail
     to bind the store's port), each node's torchrun logs and error file in a folder
     of its own. ``--label`` prefixes every line with the node's index in the job.
  4. Writes its own end (exit code, time) to RUN_DIR/slurm/<job id>/end.json, also
     when scancel or the time limit TERMs it: ``scontrol`` forgets a finished job
     after MinJobAge, and a launcher that reattaches later must still learn how it ended.
  5. Preemption (training only; docs/reliability.md): sbatch
     ``--signal=B:<train.preempt_signal>@<slurm.signal_before_s>`` signals this script ahead of
     the time limit; it passes the signal on to every node's torchrun
     (``scancel --signal``), which passes it to the ranks (``PET_SIGNALS_TO_HANDLE``); they save a
     step checkpoint at their next step and exit (training/loop/preemption.py). A job whose ranks stopped so
     (RUN_DIR/preempted.json, no model.pt; also after ``scontrol requeue`` or a scheduler's preemption, which
     TERM every process of the job) requeues itself with ``slurm.requeue`` (sbatch ``--requeue``), and the
     requeued job, the same id, runs this script again and resumes from that checkpoint.

Files (``JobPaths``)::

    RUN_DIR/slurm/job.sh              this script (rewritten before each submission)
    RUN_DIR/slurm/job.json            the job ddpflow follows: its id, when and how it was submitted
    RUN_DIR/slurm/<id>.out            the job's output: the script's lines and every node's, labelled "K: "
    RUN_DIR/slurm/<id>/end.json       how the job ended, written by the job itself
    RUN_DIR/slurm/<id>/<node>/        that node's torchrun logs (logs/) and root-cause error file (error.json)
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpflow.launch.agent import AGENT_MODULE
from ddpflow.launch.command import ERROR_FILE, LOG_DIR, PROJECT_ROOT
from training.core.config import PipelineConfig
from training.core.layout import FINAL_MODEL, PREEMPTED
from training.core.topology import RankLayout

SLURM_DIR = "slurm"
CANNOT_SEE = "cannot see"  # the check step's words: "ddpflow: node NODE cannot see PATH"
# torchrun prefixes each rank's lines with this; ${rank} is the GLOBAL rank (global rank 0 may be on any node).
RANK_PREFIX_TEMPLATE = "[${role_name}${rank}]:"
# Set per node by the torchrun step (its folder, its rendezvous role), not by the batch script.
PER_NODE_ENV = ("TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class JobPaths:
    """Where a run's Slurm files live (see the module doc)."""

    run_dir: Path

    @property
    def folder(self) -> Path:
        return self.run_dir / SLURM_DIR

    @property
    def script(self) -> Path:
        return self.folder / "job.sh"

    @property
    def record(self) -> Path:
        return self.folder / "job.json"

    def output(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.out"

    def job_folder(self, job_id: str) -> Path:
        return self.folder / str(job_id)

    def end_record(self, job_id: str) -> Path:
        return self.job_folder(job_id) / "end.json"

    def node_folder(self, job_id: str, node: str) -> Path:
        return self.job_folder(job_id) / node

    def node_log_dir(self, job_id: str, node: str) -> Path:
        return self.node_folder(job_id, node) / LOG_DIR


@dataclass(frozen=True)
class RankJob:
    """One Slurm job of torchrun agents, one per node, each starting ``layout.nproc_per_node`` ranks of
    ``program`` that read ``job_file`` (what training and scoring each fill in; see the module doc)."""

    config: PipelineConfig  # its slurm section (partition, time limit, sbatch_args...) and train.num_threads
    paths: JobPaths  # where the job's files go
    job_file: Path  # what every rank reads (--config, or $DDPFLOW_JOB for a training script)
    program: tuple[str, ...]  # what every rank runs, after torchrun's options (command.py: rank_program)
    nnodes: int
    layout: RankLayout  # each node's ranks
    visible: tuple[Path, ...] = ()  # besides job_file and the interpreter: what every node must see
    name: str = ""  # the job's name after "ddpflow-" (default: the run directory's name)
    workdir: Path = PROJECT_ROOT  # where the ranks start (command.py: rank_workdir)
    stage: str = "training"  # what the job does, in its script and in messages
    section: str = "train"  # the config section of its nnodes and timeout_s, named in errors (train, score)
    run_dir_key: str = "train.run_root"  # the setting that placed paths.run_dir, named in errors
    max_restarts: int = 0  # torchrun's restarts of the worker group
    # Training: ranks stopped by a preemption save a step checkpoint (RUN_DIR/preempted.json) and the job requeues
    # itself (``requeue``: slurm.requeue) to resume from it; ``preempt_signal`` (train.preempt_signal) is asked for
    # ahead of the time limit. A scoring does neither: stopped, it is run again and resumes from its part files.
    saves_on_preemption: bool = False
    preempt_signal: str | None = None
    requeue: bool = False


def sbatch_command(job: RankJob) -> list[str]:
    """``sbatch --parsable ...`` for this job: its shape, then the user's extra options."""
    slurm, paths = job.config.slurm, job.paths
    argv = [
        "sbatch", "--parsable",
        f"--job-name=ddpflow-{job.name or paths.run_dir.name}"[:128],
        f"--nodes={job.nnodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts that node's ranks
        # The agent's one task runs every rank of its node: at least a core per rank.
        f"--cpus-per-task={slurm.cpus_per_task or job.layout.nproc_per_node}",
        f"--output={paths.folder}/%j.out",
        "--open-mode=append",  # a requeued job (preempted: it resumes) adds to its output file
        "--requeue" if job.requeue else "--no-requeue",
        f"--chdir={job.workdir}",  # where the local launcher runs torchrun too
    ]  # fmt: skip
    if slurm.partition:
        argv.append(f"--partition={slurm.partition}")
    if slurm.account:
        argv.append(f"--account={slurm.account}")
    if slurm.time_limit:
        argv.append(f"--time={slurm.time_limit}")
    if slurm.gpus_per_node:
        argv.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.signal_before_s and job.preempt_signal:  # to the batch script (B:), which passes it on
        argv.append(f"--signal=B:{job.preempt_signal.removeprefix('SIG')}@{slurm.signal_before_s}")
    return [*argv, *slurm.sbatch_args, str(paths.script)]


def torchrun_argv(job: RankJob) -> list[str]:
    """One node's torchrun agent; ``$head_addr``, ``$port`` and ``$SLURM_JOB_ID`` are filled in by the script."""
    return [
        sys.executable, "-m", AGENT_MODULE,  # torch.distributed.run's main (ddpflow/launch/agent.py)
        "--nnodes", str(job.nnodes),
        "--nproc-per-node", str(job.layout.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--max-restarts", str(job.max_restarts),
        "--tee", "3",  # every rank's lines on torchrun's stdout (and in its log files)
        *job.program,
    ]  # fmt: skip


def batch_script(job: RankJob, env: dict[str, str]) -> str:
    """The batch script's text. ``env``: the variables ddpflow sets for ranks (command.py: launch_env)."""
    paths, layout = job.paths, job.layout
    run_dir = paths.run_dir
    visible = [*job.visible, job.job_file, Path(sys.executable)]
    exports = {key: value for key, value in sorted(env.items()) if key not in PER_NODE_ENV}
    exports["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    threads = str(job.config.train.num_threads) if job.config.train.num_threads else None
    q = shlex.quote
    agent = torchrun_argv(job)
    rendezvous = ["--rdzv-endpoint", '"$head_addr:$port"', "--rdzv-id", '"job-$SLURM_JOB_ID"']
    lines = [
        "#!/bin/bash",
        f"# ddpflow {job.stage} job for {run_dir}",
        "# Written by ddpflow/launch/slurm/script.py and kept for people to read. Submitted as:",
        "#   " + " ".join(q(part) for part in sbatch_command(job)),
        "# Its output: RUN_DIR/slurm/<job id>.out (every node's lines, labelled 'K: ' with the node's index).",
        "set -u",
        f"run_dir={q(str(run_dir))}",
        f"job_dir={q(str(paths.folder))}/$SLURM_JOB_ID",
        'mkdir -p "$job_dir"',
        f'rm -f "$job_dir/end.json" "$run_dir/{PREEMPTED}"  # a requeued job runs again: not its last end or stop',
        "",
        "# How the job ended, written by the job itself: scontrol forgets finished jobs after MinJobAge.",
        "record_end() {",
        '    printf \'{"job_id": "%s", "exit_code": %d, "how": "%s", "ended_at": "%s"}\\n\' \\',
        '        "$SLURM_JOB_ID" "$1" "$2" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$job_dir/end.json.tmp"',
        '    mv -f "$job_dir/end.json.tmp" "$job_dir/end.json"',
        "}",
        "# scancel and the time limit send TERM: record it, and let Slurm stop the steps (a requeue: not an end).",
        "requeueing=0",
        "trap 'if [ \"$requeueing\" = 1 ]; then exit 0; fi; record_end 143 terminated; exit 143' TERM",
        *_preempt_trap(job.preempt_signal),
        "",
        "# What every rank inherits (ddpflow/launch/command.py: launch_env).",
        *(f"export {key}={q(value)}" for key, value in exports.items()),
        "",
        f"# 1. Every node must see the {job.stage} job's files and the Python interpreter.",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 /bin/sh -c \\",
        f'    \'for path; do [ -e "$path" ] || {{ echo "ddpflow: node $SLURMD_NODENAME {CANNOT_SEE} $path"; '
        "bad=1; }; done; exit ${bad:-0}' \\",
        "    ddpflow-check " + " ".join(q(str(path)) for path in visible) + " &",
        "wait $!",
        "status=$?",
        'if [ "$status" -ne 0 ]; then record_end "$status" node-check; exit "$status"; fi',
        "",
        "# 2. The rendezvous: the first node (this one) by its NodeAddr (node names need not resolve), a free port.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "head_addr=$(scontrol show node \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        # (-I -S: no site packages to import, so the interpreter starts in a few milliseconds.)
        f'port=$({q(sys.executable)} -I -S -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
        "print(s.getsockname()[1])')",
        'echo "ddpflow: rendezvous on $head_node ($head_addr:$port) for $SLURM_JOB_NUM_NODES nodes"',
        "",
        "# 3. One torchrun agent per node, each with its own folder; only node 0 hosts the rendezvous store.",
        "# (srun does not pass the job's --cpus-per-task on to a step by itself since Slurm 22.05.)",
        'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 --label /bin/sh -c \'',
        '    node_dir="$0/$SLURMD_NODENAME"; mkdir -p "$node_dir"',
        f'    export TORCHELASTIC_ERROR_FILE="$node_dir/{ERROR_FILE}" PET_LOG_DIR="$node_dir/{LOG_DIR}"',
        '    export PET_RDZV_CONF="is_host=$(( SLURM_NODEID == 0 ))"',
        *(
            [f"    export OMP_NUM_THREADS={threads}"]
            if threads
            else [
                f"    threads=$(( ${{SLURM_CPUS_ON_NODE:-1}} / {layout.nproc_per_node} ))",
                "    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))",
            ]
        ),
        '    exec "$@"\' "$job_dir" \\',
        "    " + " ".join(q(part) for part in agent[:3]) + " \\",
        "    " + " ".join(q(part) for part in agent[3 : agent.index("--tee")]) + " " + " ".join(rendezvous) + " \\",
        "    " + " ".join(q(part) for part in agent[agent.index("--tee") :]) + " &",
        "step=$!",
        "wait $step",
        "status=$?",
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done  # a trapped signal ends a wait early',
        *(_requeue_if_preempted(job.requeue) if job.saves_on_preemption else []),
        'record_end "$status" finished',
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _preempt_trap(name: str | None) -> list[str]:
    """train.preempt_signal, sent to this script alone (sbatch --signal=B:...): on to every torchrun of the job."""
    if not name:
        return []
    short = name.removeprefix("SIG")
    return [
        f"# {name} (sbatch --signal=B:{short}@N, before the time limit): on to every node's torchrun and its ranks,",
        "# which save a step checkpoint at their next step and stop.",
        f'trap \'echo "ddpflow: {name}: the ranks save a checkpoint and stop"; '
        f'scancel --signal={short} "$SLURM_JOB_ID"\' {short}',
    ]


def _requeue_if_preempted(requeue: bool) -> list[str]:
    """After the torchrun step: ranks that stopped preempted (RUN_DIR/preempted.json, no model.pt) requeue the job,
    which then resumes from their checkpoint (slurm.requeue); without it the job ends and the launcher says so."""
    lines = [
        f'if [ -f "$run_dir/{PREEMPTED}" ] && [ ! -f "$run_dir/{FINAL_MODEL}" ]; then',
        f'    echo "ddpflow: the ranks were preempted and saved: $(tr -d \'\\n\' < "$run_dir/{PREEMPTED}")"',
    ]
    if requeue:
        lines += [
            "    requeueing=1",
            '    echo "ddpflow: requeueing job $SLURM_JOB_ID: it resumes from that checkpoint"',
            '    if scontrol requeue "$SLURM_JOB_ID"; then sleep 600 & wait $!; exit 0; fi',  # Slurm TERMs us now
            "    requeueing=0",
        ]
    return [*lines, '    record_end "$status" preempted', '    exit "$status"', "fi"]
