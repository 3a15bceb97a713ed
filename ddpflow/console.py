"""What a ``ddpflow`` command shows on its console, and the log file that keeps everything.

    log = CommandLog.open(project, "run")      # <project>/.ddpflow/logs/run-<UTC time>-<pid>.log
    log.attach(console_handlers, user_errors)  # once the flow's logging is configured (Prefect: on import)
    log.detach()

The console is for a person: a user's error (bad config, bad data, a missing
column, an unreadable file: the ``user_errors`` types) is said once, by the
command's last line, not by a traceback. Prefect's engines log the exception of
a failed task run and of its flow run with the traceback, then each state
("Finished in state Failed(...)"): the same message four times before the
command's own line. ``ConsoleFilter`` keeps those records off the console only
when the exception is a user's error; the Prefect UI (its API handler) and the
log file keep them whole. An internal error (a bug) still shows its traceback.

A record logged with ``extra={LOG_ONLY: True}`` goes to the log file (and the
Prefect UI), never to the console: torchrun's own output after the launcher
stopped it (its ``SignalException`` traceback on a Ctrl-C).

Ctrl-C is a cancellation, not a crash: Prefect's engines report a KeyboardInterrupt as one ("Crash detected!
Execution was aborted by an interrupt signal.", at ERROR), and the command then ends the runs Cancelled
(flows/cli.py). Those reports (``INTERRUPT_CRASH``) stay in the log file and the Prefect UI, off the console.

Plain ``logging``: no Prefect here (the CLI hands over Prefect's console handlers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

LOG_ONLY = "ddpflow_log_only"  # a record attribute: keep this record off the console
LOG_DIR = Path(".ddpflow") / "logs"  # under the project, beside the stack's logs (ddpflow/services/stack.py)
# Prefect's message for a run a KeyboardInterrupt went through (prefect.states.exception_to_crashed_state).
INTERRUPT_CRASH = "Execution was aborted by an interrupt signal."
KEEP_LOGS = 30  # per command; older command logs are removed when a new one opens
_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"


class ConsoleFilter(logging.Filter):
    """Drops from the console: LOG_ONLY records, Prefect's crash reports of a Ctrl-C, records carrying a user's
    error, and records repeating it."""

    def __init__(self, user_errors: tuple[type[BaseException], ...]):
        super().__init__()
        self.user_errors = user_errors
        self.seen: list[str] = []  # the first line of each user error's message, once seen

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, LOG_ONLY, False) or INTERRUPT_CRASH in record.getMessage():
            return False
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            if not isinstance(error, self.user_errors):
                return True  # a bug: its traceback stays on the console
            first_line = (str(error).splitlines() or [""])[0][:40]  # Prefect may shorten a state message
            if first_line and first_line not in self.seen:
                self.seen.append(first_line)
            return False
        if self.seen:
            message = record.getMessage()
            return not any(seen in message for seen in self.seen)  # "Finished in state Failed('... <message>')"
        return True


@dataclass
class CommandLog:
    """One command's log file: every record, tracebacks included, at INFO and above."""

    path: Path
    handler: logging.FileHandler
    _filtered: list[tuple[logging.Handler, ConsoleFilter]] = field(default_factory=list)
    quiet: bool = False  # a user's error is kept off the console (not --verbose)

    @classmethod
    def open(cls, project: str | os.PathLike, command: str) -> CommandLog:
        directory = Path(project) / LOG_DIR
        directory.mkdir(parents=True, exist_ok=True)
        _prune(directory, command, keep=KEEP_LOGS - 1)
        path = directory / f"{command}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}.log"
        handler = logging.FileHandler(path, encoding="utf-8", delay=False)
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(_FORMAT))
        return cls(path.resolve(), handler)

    @property
    def attached(self) -> bool:
        return self.handler in logging.getLogger().handlers

    def attach(self, console_handlers: list[logging.Handler], user_errors: tuple[type[BaseException], ...]) -> None:
        """Log every record to the file (through the root logger); filter the console's handlers.
        ``user_errors`` empty (--verbose): the console keeps every error's records, tracebacks included."""
        self.quiet = bool(user_errors)
        root = logging.getLogger()
        if self.handler not in root.handlers:
            root.addHandler(self.handler)
        for handler in console_handlers:
            console_filter = ConsoleFilter(user_errors)
            handler.addFilter(console_filter)
            self._filtered.append((handler, console_filter))

    def record_error(self, error: BaseException, what: str = "the command failed") -> None:
        """The command's own error, with its traceback, in the file only."""
        logging.getLogger("ddpflow").error(what, exc_info=error, extra={LOG_ONLY: True})

    def detach(self) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()
        for handler, console_filter in self._filtered:
            handler.removeFilter(console_filter)
        self._filtered.clear()


def _prune(directory: Path, command: str, keep: int) -> None:
    logs = sorted(directory.glob(f"{command}-*.log"), key=lambda p: p.name)
    for old in logs[: max(0, len(logs) - keep)]:
        old.unlink(missing_ok=True)
