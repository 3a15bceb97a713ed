"""What `ddpflow run` shows on its console (ddpflow/console.py): a user's error once, a bug with its trace."""

from __future__ import annotations

import asyncio
import logging
import sys

from ddpflow.console import INTERRUPT_CRASH, LOG_ONLY, CommandLog, ConsoleFilter
from training.core.errors import DataError


def record(message: str, error: BaseException | None = None, **extra) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    made = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, (), exc_info)
    made.__dict__.update(extra)
    return made


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_a_users_error_and_its_repeats_stay_off_the_console_a_bug_keeps_its_trace():
    console = ConsoleFilter(user_errors=(ValueError,))
    data_error = raised(DataError("/data/x.parquet: cannot be read as parquet: truncated"))
    assert not console.filter(record("Task run failed with exception: DataError(...)", data_error))
    finished = (
        "Finished in state Failed('Task run encountered an exception DataError: "
        "/data/x.parquet: cannot be read as parquet: tr..."
    )
    assert not console.filter(record(finished))
    assert console.filter(record("Beginning flow run 'mlp-x' for flow 'train-pipeline'"))
    bug = raised(KeyError("selected_epoch"))
    assert console.filter(record("Encountered exception during execution: KeyError('selected_epoch')", bug))
    assert not console.filter(record("[torchrun] Traceback (most recent call last):", **{LOG_ONLY: True}))
    verbose = ConsoleFilter(user_errors=())  # --verbose: every error's records, tracebacks included
    assert verbose.filter(record("Task run failed with exception: DataError(...)", data_error))
    assert verbose.filter(record(finished))


def test_prefects_crash_reports_of_a_ctrl_c_stay_off_the_console_in_verbose_too():
    """Ctrl-C is a cancellation (flows/cli.py ends the runs Cancelled): Prefect's "Crash detected!" records of the
    KeyboardInterrupt, and its "Finished in state Crashed(...)", are not shown; another crash is."""
    from prefect.states import exception_to_crashed_state

    assert asyncio.run(exception_to_crashed_state(KeyboardInterrupt())).message == INTERRUPT_CRASH  # Prefect's words
    for console in (ConsoleFilter(user_errors=(ValueError,)), ConsoleFilter(user_errors=())):
        assert not console.filter(record(f"Crash detected! {INTERRUPT_CRASH}"))
        assert not console.filter(record(f"Finished in state Crashed({INTERRUPT_CRASH!r})"))
        assert console.filter(record("Crash detected! Execution was interrupted by an unexpected exception: ..."))


def test_the_command_log_keeps_every_trace(tmp_path):
    handler = logging.StreamHandler(sys.stderr)
    log = CommandLog.open(tmp_path, "run")
    log.attach([handler], (ValueError,))
    try:
        assert log.attached and log.quiet and log.path.parent == tmp_path / ".ddpflow" / "logs"
        logging.getLogger("prefect.task_runs").error("failed", exc_info=raised(DataError("bad column 'x'")))
        log.record_error(raised(DataError("bad column 'x'")))
    finally:
        log.detach()
    text = log.path.read_text()
    assert text.count("Traceback") == 2 and "bad column 'x'" in text
    assert not log.attached and handler.filters == []
