"""The per-epoch report from rank 0 to the pruner, and the pruner's answer to every rank.

Rank 0 writes each epoch's line to RUN_DIR/metrics.jsonl (training/loop/counting.py: MetricsSink). ``EpochJudge``,
a thread of the process that holds the Optuna study, reads each new line, reports the objective to the
trial (``trial.report(value, epoch)``), asks ``trial.should_prune()``, and writes the verdict the ranks wait
for at the epoch boundary (training/loop/selection.py: ``write_verdict``), where the flag is all-reduced
so every rank stops after the same epoch. A trial's last epoch needs no verdict: it ends there anyway.

A training script's trial has no epochs of ddpflow's: ``ReportJudge`` follows its reports instead
(RUN_DIR/script/reports.jsonl, ``ddpflow.report``), reports each value of the objective at the report's step, and
a pruned trial gets the stop file its ranks' ``ddpflow.should_stop()`` reads (``write_stop``): nothing waits.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any

from training.core.fileio import read_metrics_lines
from training.core.layout import METRICS, SCRIPT_REPORTS, run_file
from training.loop.selection import verdicts_dir, write_stop, write_verdict

logger = logging.getLogger(__name__)
POLL_S = 0.2


class EpochJudge:
    """Follows one trial's metrics.jsonl while its ranks run; ``pruned_at`` is the epoch judged worse, if any."""

    def __init__(self, trial: Any, run_dir: str | Path, objective: str, epochs: int):
        self.trial, self.run_dir, self.objective, self.epochs = trial, Path(run_dir), objective, epochs
        self.path = run_file(self.run_dir, METRICS)
        self.judged: set[int] = set()
        self.last_value: float | None = None  # the objective last reported (a pruned trial's sweep_objective)
        self.pruned_at: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EpochJudge:
        verdicts_dir(self.run_dir).mkdir(parents=True, exist_ok=True)  # the ranks wait for verdicts from now on
        self._thread = threading.Thread(target=self._follow, name="sweep-epoch-judge", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self.catch_up()  # an epoch that landed after the last look

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self.catch_up()

    def catch_up(self) -> None:
        """Judge every epoch line not judged yet; never raises (a ranks' wait times out to 'continue')."""
        try:
            for line in read_metrics_lines(self.path):
                epoch = line.get("epoch")
                if isinstance(epoch, int) and epoch not in self.judged:
                    self.judged.add(epoch)
                    self._judge(epoch, line.get(self.objective))
        except Exception as error:
            logger.warning("sweep: could not judge %s: %s", self.path, error)

    def _judge(self, epoch: int, value: Any) -> None:
        stop = False
        if isinstance(value, (int, float)) and math.isfinite(value):
            self.last_value = float(value)
            self.trial.report(float(value), epoch)
            stop = self.pruned_at is None and epoch + 1 < self.epochs and self.trial.should_prune()
        elif value is None:
            logger.warning("sweep: epoch %d of %s has no %s", epoch, self.run_dir, self.objective)
        if stop:
            self.pruned_at = epoch
        write_verdict(self.run_dir, epoch, stop or self.pruned_at is not None)


class ReportJudge(EpochJudge):
    """Follows a training script's reports while its ranks run (module doc); ``pruned_at`` is the report's step."""

    def __init__(self, trial: Any, run_dir: str | Path, objective: str):
        super().__init__(trial, run_dir, objective, epochs=0)
        self.path = run_file(self.run_dir, SCRIPT_REPORTS)
        self.lines_judged = 0

    def catch_up(self) -> None:
        """Judge every report line not judged yet; never raises."""
        try:
            lines = read_metrics_lines(self.path)
            for line in lines[self.lines_judged :]:
                value = (line.get("metrics") or {}).get(self.objective)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._judge_report(int(line.get("step", 0)), float(value))
            self.lines_judged = max(self.lines_judged, len(lines))
        except Exception as error:
            logger.warning("sweep: could not judge %s: %s", self.path, error)

    def _judge_report(self, step: int, value: float) -> None:
        self.last_value = value
        if self.pruned_at is not None:
            return
        self.trial.report(value, step)
        if self.trial.should_prune():
            self.pruned_at = step
            write_stop(self.run_dir)
