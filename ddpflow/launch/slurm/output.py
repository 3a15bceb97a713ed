"""A Slurm job's output and how it ended (plain Python): the other half of launcher.py.

    line = label_line(raw, ["n1", "n2"])          # "1: [default1]:text" -> [n2 rank 1] text
    raise_unless_completed(config, paths, job_id, info, stop)   # nothing when COMPLETED, else the error

The job's output file (RUN_DIR/slurm/<id>.out) holds the batch script's own lines, srun's, and
every node's torchrun output labelled ``K: `` by ``srun --label`` (K: the node's index in the job,
the order of its NodeList) and ``[defaultR]:`` by torchrun (R: the GLOBAL rank, from
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE). A failed job's root cause comes from that file and each
node's torchrun logs, through the local launcher's failure analysis (failure.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ddpflow.launch.failure import (
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    RankFailed,
    failure_from_output,
    is_peer_lost,
)
from ddpflow.launch.slurm.commands import JobInfo, SlurmSetupError, expand_nodes
from ddpflow.launch.slurm.script import CANNOT_SEE, JobPaths
from ddpflow.launch.supervisor import OutputLine, parse_line
from training.core.config import PipelineConfig

SRUN_LABEL = re.compile(r"^\s*(?P<task>\d+): (?P<line>.*)$")  # srun --label: the node's index in the job
_SRUN_TASK_EXIT = re.compile(r"srun: error: (?P<node>\S+): task \d+: Exited with exit code (?P<code>\d+)")
_CANNOT_SEE = re.compile(rf"ddpflow: node (?P<node>\S+) {CANNOT_SEE} (?P<path>.+)$")


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
    match = SRUN_LABEL.match(raw)
    if match is None or not nodes:
        return SlurmLine(None, raw)
    task = int(match["task"])
    inner = parse_line(match["line"])
    return SlurmLine(inner.rank, inner.text, node=nodes[task] if task < len(nodes) else f"node{task}")


class OutputTail:
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


def read_end_record(paths: JobPaths, job_id: str) -> dict | None:
    """What the batch script wrote as it ended (exit_code, how, ended_at), or None."""
    try:
        return json.loads(paths.end_record(job_id).read_text())
    except (OSError, ValueError):
        return None


def raise_unless_completed(
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
    raise job_failure(paths, job_id, info, where, show_traceback=bool(config.train.script))


def job_failure(
    paths: JobPaths, job_id: str, info: JobInfo | None, where: str, show_traceback: bool = False
) -> LaunchError:
    """The root cause of a failed job: a node that cannot see a path, else a failed rank, else the job's state.
    ``show_traceback``: the rank's error ends with its traceback's last lines (failure.py)."""
    lines = OutputTail(paths.output(job_id)).read()
    unseen = [match for match in map(_CANNOT_SEE.search, lines) if match]
    if unseen:
        missing = "; ".join(f"node {m['node']} cannot see {m['path']}" for m in unseen)
        return SlurmSetupError(
            f"{where}: {missing}. Every node must see the dataset, RUN_DIR and the Python environment at the "
            "same paths (a shared filesystem, docs/slurm.md)"
        )
    nodes = expand_nodes(info.node_list) if info is not None and info.node_list else []
    by_node = _torchrun_lines_by_node(lines, nodes)
    failures = []
    for node in _failed_nodes_first(lines, by_node):
        node_dir = paths.node_folder(job_id, node)
        failure = failure_from_output(node_dir, _node_job_dir(paths, job_id, node), by_node[node], 1, show_traceback)
        if failure.rank is not None:
            failures.append((node, failure))
    # srun may see the node whose rank only lost its peer fail first: prefer a rank's own error.
    own = [(node, failure) for node, failure in failures if not is_peer_lost(failure.root_cause)]
    for node, failure in (own or failures)[:1]:
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
