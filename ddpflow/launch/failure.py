"""Why a launch failed: the launcher's errors, and the root cause of a failed rank.

    error = failure_from_output(run_dir, job_dir, torchrun_tail, returncode)   # -> RankFailed
    str(error)  # "rank 1 failed with exit code 1: ValueError: ... (its log: RUN_DIR/logs/.../1/stderr.log)"

Where the cause comes from, first found wins:
  1. a rank whose error is its own, when torchrun blamed a rank that only lost its peer
     (torchrun's "first observed failure" is decided by whole-second timestamps, and a rank that
     aborts on its closed gloo pair (SIGABRT) writes no error file: its log's last exception says so);
  2. the error file torchrun's ``@record`` copied to RUN_DIR/error.json, or the one it names;
  3. NCCL's watchdog text in the rank's log: on GPUs a collective that outlives
     ``train.collective_timeout_s`` aborts the rank (SIGABRT) with no Python exception,
     so the rank's own ``CollectiveTimeout`` never appears; the launcher names it instead,
     in the same words as the CPU path (training/distributed/context.py);
  4. the last exception line in the rank's log.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ddpflow.launch.command import ERROR_FILE

# Fields of torchrun's ChildFailedError "Root Cause" block.
_ROOT_CAUSE_FIELD = re.compile(r"^\s*(?P<key>rank|exitcode|error_file|traceback)\s*:\s*(?P<value>.*?)\s*$")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*)(?:Error|Exception|Interrupt|Exit|Failure|Warning)\b.*|^[A-Za-z_][\w.]*: .+"
)
# What a rank says when a PEER died: never the root cause while another rank has a real error.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|connectFullMesh|Broken pipe|"
    r"NCCL communicator was aborted|remote worker crashing",
    re.IGNORECASE,
)
# ProcessGroupNCCL's watchdog (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp), e.g.
# "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1,
#  NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
_NCCL_WATCHDOG = re.compile(
    r"(?P<message>\[Rank \d+\] Watchdog caught collective operation timeout: (?P<work>.*?) "
    r"ran for (?P<ran_ms>\d+) milliseconds before timing out\.?)"
)
_NCCL_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)")
# torch.distributed's excepthook prefixes each line of a rank's uncaught traceback with "[rankN]: ".
_RANK_LINE_PREFIX = re.compile(r"^\[rank\d+\]: ?")


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


class ScriptFailed(RankFailed):
    """A user's training script (train.script) raised: its own error, with the last lines of its traceback
    (``traceback``). Said once, as a user's error; run again, it would fail again (no retry)."""

    def __init__(self, message: str, traceback: str, **fields):
        super().__init__(f"{message}\n{traceback}", **fields)
        self.headline = message
        self.traceback = traceback


class LaunchTimeout(LaunchError):
    """train.timeout_s passed; the tree was killed."""


class LaunchStalled(LaunchError):
    """No output line for train.stall_timeout_s; the tree was killed."""


class LaunchInterrupted(LaunchError):
    """The launcher was told to stop (signal, cancellation, interpreter shutdown); the tree was killed."""


class LaunchPreempted(LaunchError):
    """The ranks were told to stop, saved a checkpoint at one step and exited: resumable. ``record`` is
    RUN_DIR/preempted.json (training/loop/preemption.py). Not a LaunchInterrupted: the same launch again (a task's
    retry, the next flow run) resumes at that step, where the signal did not also stop the launching process."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}


TRACEBACK_LINES = 15  # of a training script's traceback, in its failure (the whole log stays on disk)


def failure_from_output(
    run_dir: Path, job_dir: Path | None, tail: list[str], returncode: int, show_traceback: bool = False
) -> RankFailed:
    """An error naming the failing rank, its exit code and the root-cause text (see the module doc);
    ``show_traceback``: a user's training script, whose failure with a Python traceback is its own error
    (``ScriptFailed``, with the traceback's last ``TRACEBACK_LINES`` lines: the user's code is what the user reads)."""
    summary = root_cause_summary(tail)
    rank_match = re.match(r"(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", summary.get("rank", ""))
    rank = int(rank_match[1]) if rank_match else None
    local_rank = int(rank_match[2]) if rank_match and rank_match[2] else rank
    exit_match = re.match(r"(-?\d+)", summary.get("exitcode", ""))
    exitcode = int(exit_match[1]) if exit_match else None
    attempt = _last_attempt(job_dir)
    original = _original_failure(attempt, local_rank)
    note = ""
    if original is not None and rank is not None:
        # Global rank = the blamed rank's node offset + the original's local rank. Its error is a Python exception
        # of its own, so it exits 1; torchrun lists that code, or a signal where its shutdown stopped the rank while
        # it was still exiting (SIGTERM: -15), which is not the rank's failure.
        note = f"; torchrun first saw rank {rank} exit with code {exitcode}, after it lost this peer"
        rank, local_rank = rank - local_rank + original[0], original[0]
        listed = failed_ranks(tail).get(rank)
        exitcode = listed if listed is not None and listed > 0 else 1

    log_file = attempt / str(local_rank) / "stderr.log" if attempt is not None and local_rank is not None else None
    cause = original[1] if original is not None else _root_cause_text(run_dir, summary, log_file, rank)

    if rank is None:
        last = next((t for t in reversed(tail) if t.strip()), "")
        message = f"torchrun exited with code {returncode}: {last}"
    else:
        code = f" with exit code {exitcode}" if exitcode is not None else ""
        message = f"rank {rank} failed{code}: {cause or 'no exception recorded'}"
        if log_file is not None:
            message += f" (its log: {log_file})"
        message += note
    fields = {"rank": rank, "exitcode": exitcode, "root_cause": cause, "log_file": str(log_file) if log_file else None}
    shown = traceback_tail(_read_text(log_file) or "") if show_traceback and log_file is not None else None
    if shown and rank is not None:
        return ScriptFailed(message, shown, **fields)
    return RankFailed(message, **fields)


def _root_cause_text(run_dir: Path, summary: dict[str, str], log_file: Path | None, rank: int | None) -> str | None:
    cause = _error_file_message(run_dir / ERROR_FILE)
    error_file = summary.get("error_file", "")
    if cause is None and error_file and not error_file.startswith("<"):
        cause = _error_file_message(Path(error_file))
    log_text = _read_text(log_file) if log_file is not None else None
    if cause is None and log_text is not None:
        cause = nccl_watchdog_timeout(log_text, rank)
    if cause is None and log_text is not None:
        cause = _last_exception_line(log_text)
    return cause


def nccl_watchdog_timeout(log_text: str, rank: int | None) -> str | None:
    """The CPU path's CollectiveTimeout message, built from NCCL's watchdog text; None without it.

    ``rank`` is the global rank torchrun blamed (the watchdog's "[Rank N]" counts within the
    process group that timed out); without it, the watchdog's own number is used.
    """
    match = _NCCL_WATCHDOG.search(log_text)
    if match is None:
        return None
    timeout_ms = _NCCL_TIMEOUT_MS.search(match["work"])
    waited_s = int(timeout_ms[1] if timeout_ms else match["ran_ms"]) / 1000
    who = rank if rank is not None else int(re.search(r"\d+", match["message"])[0])
    # The same words as training/distributed/context.py's CollectiveTimeout, so both paths read alike.
    return (
        f"CollectiveTimeout: rank {who}: a collective timed out after train.collective_timeout_s={waited_s:g}s "
        f"waiting for another rank (it stalled or died); NCCL's watchdog aborted the rank: {match['message']}"
    )


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


def failed_ranks(tail: list[str]) -> dict[int, int]:
    """Global rank -> exit code of every failure in torchrun's ChildFailedError block (the others and the root)."""
    found: dict[int, int] = {}
    rank = None
    for text in tail:
        match = _ROOT_CAUSE_FIELD.match(text)
        if match is None:
            continue
        if match["key"] == "rank":
            rank_match = re.match(r"(\d+)", match["value"])
            rank = int(rank_match[1]) if rank_match else None
        elif match["key"] == "exitcode" and rank is not None:
            code = re.match(r"(-?\d+)", match["value"])
            if code:
                found.setdefault(rank, int(code[1]))
            rank = None
    return found


def _last_attempt(job_dir: Path | None) -> Path | None:
    """torchrun's log folder of the last restart round: JOB_DIR/attempt_<n>."""
    if job_dir is None:
        return None
    attempts = sorted(job_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    return attempts[-1] if attempts else None


def is_peer_lost(message: str | None) -> bool:
    """A rank's error that only says a PEER went away: never the root cause while another rank has its own."""
    return bool(message) and _PEER_LOST.search(message) is not None


def _original_failure(attempt: Path | None, local_rank: int | None) -> tuple[int, str] | None:
    """The rank whose error is its own, when torchrun blamed a rank that only lost its peer."""
    if attempt is None or local_rank is None:
        return None
    blamed = _rank_error(attempt / str(local_rank))
    if blamed is None or not _PEER_LOST.search(blamed):
        return None
    ranks = sorted((path for path in attempt.iterdir() if path.name.isdigit()), key=lambda path: int(path.name))
    for rank_dir in ranks:
        message = _rank_error(rank_dir)
        if message and not _PEER_LOST.search(message):
            return int(rank_dir.name), message
    return None


def _rank_error(rank_dir: Path) -> str | None:
    """A rank's own error: its ``@record`` error file, else the last exception line of its log (a user's script
    without ``@record``, or a rank aborted by a C++ error, writes no error file)."""
    message = _error_file_message(rank_dir / ERROR_FILE)
    if message is None:
        log_text = _read_text(rank_dir / "stderr.log")
        message = _last_exception_line(log_text) if log_text else None
    return message


def _error_file_message(path: Path) -> str | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = raw.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    return str(message).strip() if message else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def traceback_tail(log_text: str, limit: int = TRACEBACK_LINES) -> str | None:
    """The last ``limit`` lines of the last Python traceback in a rank's log (through its exception line), or None;
    torchrun's own record of the error (its ``@record`` block) is not part of it."""
    lines = _unprefixed(log_text)
    starts = [i for i, text in enumerate(lines) if text.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    block = lines[starts[-1] :]
    end = next(
        (i for i, text in enumerate(block) if i and _EXCEPTION_LINE.match(text) and not text.startswith(" ")), None
    )
    block = block[: end + 1] if end is not None else block
    return "\n".join(block[-limit:])


def _unprefixed(log_text: str) -> list[str]:
    """The log's lines as the rank wrote them: without torch.distributed's "[rankN]: " on a traceback's lines."""
    return [_RANK_LINE_PREFIX.sub("", text, count=1) for text in log_text.splitlines()]


def _last_exception_line(log_text: str) -> str | None:
    for text in reversed(_unprefixed(log_text)):
        if _EXCEPTION_LINE.match(text.strip()) and not text.startswith(" "):
            return text.strip()
    return None
