"""``python -m bench --profile FAMILY``: one repeat of a family under py-spy, following every process it starts
(``py-spy record --subprocesses``: the bench process with its references, a ``ddpflow`` command, torchrun's
agent, the ranks), and a summary of where the CPU went, per process.

    python -m bench --profile scoring --rows 200000      # bench/profiles/scoring.txt and scoring.md

``scoring.txt`` holds py-spy's samples as collapsed stacks (one line per stack and its count: what flamegraph.pl
and speedscope.app read); ``scoring.md`` the summary written by ``summarise``: each process's share of the samples
and, within it, the time spent importing modules and the functions with the largest inclusive share (ddpflow's
own code and the libraries' entry points), and the leaf functions where the CPU was (self time).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.results import REPO_ROOT, log

RATE_HZ = 100  # samples per second and process
TOP = 12  # functions shown per process and list
IMPORTING = "_find_and_load"  # a frame of the import system: the stack is importing a module
# Frames that every stack of a process shares (the interpreter's start, a thread's start): no information.
PLUMBING = re.compile(r"^(<module>|_run_module_as_main|_run_code|Thread\._bootstrap.*|Thread\.run|_worker|"
                      r"_WorkItem\.run|_call_with_frames_removed|_find_and_load.*|_load_unlocked|exec_module|"
                      r"_LoaderBasics\.exec_module|_handle_fromlist|_gcd_import|import_module)$")  # fmt: skip
FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^():]*)(:\d+)?\)$")


def profile_family(family: str, bench_args: list[str], out_dir: Path) -> Path:
    """Run ``python -m bench --only FAMILY --repeats 1 --no-docs`` under py-spy; returns the summary's path."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() and shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy: pip install -c constraints.txt py-spy (in the dev extras)")
    out_dir.mkdir(parents=True, exist_ok=True)
    raw, summary = out_dir / f"{family}.txt", out_dir / f"{family}.md"
    results = out_dir / f"{family}-results.json"
    argv = [spy, "record", "--subprocesses", "--rate", str(RATE_HZ), "--format", "raw", "--output", str(raw), "--",
            sys.executable, "-m", "bench", "--only", family, "--repeats", "1", "--no-docs", "--out", str(results),
            *bench_args]  # fmt: skip
    log(f"profiling {family}: {' '.join(argv)}")
    subprocess.run(argv, cwd=REPO_ROOT, check=True)
    summary.write_text(summarise(raw, title=f"`python -m bench --profile {family}` ({' '.join(bench_args)})"))
    log(f"profile: {raw} (collapsed stacks), summary: {summary}")
    return summary


@dataclass
class Process:
    """One command line's samples (ranks with the same command line are one entry)."""

    command: str
    pids: set[str] = field(default_factory=set)
    samples: int = 0
    importing: int = 0
    inclusive: Counter = field(default_factory=Counter)
    leaf: Counter = field(default_factory=Counter)


def summarise(raw: Path, title: str = "profile") -> str:
    """A markdown summary of a py-spy raw profile (collapsed stacks, ``--subprocesses``)."""
    processes: dict[str, Process] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = _frames(stack)
        owners = [frame for frame in frames if frame.startswith("process ")]
        pid, command = _process(owners[-1]) if owners else ("?", "?")
        entry = processes.setdefault(command, Process(command))
        entry.pids.add(pid)
        _add(entry, [frame for frame in frames if not frame.startswith(("process ", "thread "))], int(count))
    total = sum(entry.samples for entry in processes.values()) or 1
    lines = [f"# {title}", "", f"{total:,} samples at {RATE_HZ} Hz per process ({total / RATE_HZ:.1f} CPU-s).", ""]
    for entry in sorted(processes.values(), key=lambda entry: -entry.samples):
        lines += _process_lines(entry, total)
    return "\n".join(lines) + "\n"


def _frames(stack: str) -> list[str]:
    """A collapsed stack's frames; a ``process PID:"command line"`` frame kept whole when its command line holds
    semicolons (a ``python -c`` program)."""
    frames: list[str] = []
    for piece in stack.split(";"):
        if frames and frames[-1].startswith("process ") and not frames[-1].endswith('"'):
            frames[-1] += ";" + piece
        else:
            frames.append(piece)
    return frames


def _process(frame: str) -> tuple[str, str]:
    head, _, command = frame.removeprefix("process ").partition(":")
    return head, command.strip('"')


def _add(entry: Process, frames: list[str], count: int) -> None:
    entry.samples += count
    names = [_name(frame) for frame in frames]
    if any(IMPORTING in frame for frame in frames):
        entry.importing += count
    for name in set(names):
        if not PLUMBING.match(name.split(" ")[0]):
            entry.inclusive[name] += count
    if names:
        entry.leaf[names[-1]] += count


def _name(frame: str) -> str:
    """``function (file)`` without the line number, the file relative to site-packages or the repository."""
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["file"].split("site-packages/")[-1].removeprefix(str(REPO_ROOT) + "/")
    return f"{match['name']} ({path})"


def _process_lines(entry: Process, total: int) -> list[str]:
    share = lambda count: f"{100 * count / entry.samples:.1f}%"  # noqa: E731
    command = entry.command if len(entry.command) < 160 else entry.command[:157] + "..."
    if "os.execv" in entry.command:  # ddpflow's exec wrapper (PR_SET_PDEATHSIG), then torchrun: its first name
        command = "torchrun's agent (py-spy names it by the wrapper that execs it: " + command[:60] + "...)"
    lines = [
        f"## {command}",
        "",
        f"{len(entry.pids)} process(es), {entry.samples:,} samples ({100 * entry.samples / total:.1f}% of all); "
        f"importing modules: {share(entry.importing)}.",
        "",
        "| inclusive | function | | self | leaf function |",
        "|---|---|---|---|---|",
    ]
    inclusive, leaf = entry.inclusive.most_common(TOP), entry.leaf.most_common(TOP)
    for i in range(max(len(inclusive), len(leaf))):
        left = (share(inclusive[i][1]), f"`{inclusive[i][0]}`") if i < len(inclusive) else ("", "")
        right = (share(leaf[i][1]), f"`{leaf[i][0]}`") if i < len(leaf) else ("", "")
        lines.append(f"| {left[0]} | {left[1]} | | {right[0]} | {right[1]} |")
    return [*lines, ""]
