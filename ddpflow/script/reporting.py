"""``ddpflow.report(metrics, step=None)``: a training script's metrics, into its run's MLflow run and its gate.

    ddpflow.report({"train_loss": loss}, step=global_step)
    ddpflow.report({"test_accuracy": accuracy})             # the gate reads the last value of its metric

Safe on every rank: rank 0's values are kept, every other rank returns at once. Rank 0 appends one JSON line per
call to ``RUN_DIR/script/reports.jsonl`` (``{"step", "time", "metrics"}``); the process that launched the ranks
mirrors it into MLflow as it grows (``ddpflow/tracking/metrics.py``) and the gate takes the last value of its
metric from it (``ddpflow/tracking/script_models.py``), so no rank imports MLflow or waits for the tracking store.
``step`` unset: the number of reports made before, 0 first. Under a bare torchrun nothing is recorded; rank 0 says
so once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ddpflow.script.run import current_run, rank, say_once
from training.core.layout import SCRIPT_REPORTS

_reported = 0  # reports made by this process: the default step


def report(metrics: Mapping[str, Any], step: int | None = None) -> None:
    """Record ``metrics`` (name -> a number: int, float, a 0-d tensor or numpy scalar) at ``step`` (module doc)."""
    global _reported
    values = numbers(metrics)  # checked on every rank: the mistake shows where it is made
    if rank() != 0:
        return
    run = current_run()
    if run is None:
        say_once("report", "not run by ddpflow, so report() records nothing (`ddpflow run` tracks the script)")
        return
    line = {"step": _reported if step is None else int(step), "time": round(time.time(), 3), "metrics": values}
    _reported += 1
    path = run.file(SCRIPT_REPORTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:  # one write of one line: a reader sees whole lines, or a torn last one
        handle.write(json.dumps(line, allow_nan=True) + "\n")


def numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Each metric as a float; TypeError naming the metric that is not a number, or a name that is not text."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"ddpflow.report takes a dict of metric name -> number, not {type(metrics).__name__}")
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"ddpflow.report: metric names are non-empty strings, not {name!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"ddpflow.report: metric {name!r} is {type(value).__name__} {value!r}, not a number"
            ) from None
        values[name] = number
    return values
