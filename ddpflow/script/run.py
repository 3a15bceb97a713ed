"""The ddpflow run a user's training script is part of, as its ranks see it (``$DDPFLOW_JOB``), and the two calls
that only read it: ``checkpoint_dir`` and ``params``.

    run = current_run()     # None under a bare torchrun
    checkpoint_dir()        # RUN_DIR/checkpoints; ./checkpoints under a bare torchrun
    params()                # train.script_params; under a bare torchrun the script's own --key value arguments

The launcher writes the job (``training/core/job.py: TrainJob``: the config, the dataset directory, the run
directory) and names it in ``$DDPFLOW_JOB`` (``training/core/layout.py: JOB_ENV``). Reading it costs a JSON parse:
no torch, Prefect, MLflow or pydantic, so ``import ddpflow`` and these calls stay cheap in every rank.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.core.layout import CHECKPOINTS, JOB_ENV, run_file

BARE_CHECKPOINTS = "checkpoints"  # checkpoint_dir() under a bare torchrun: relative to where it was started


@dataclass(frozen=True)
class ScriptRun:
    """What a rank knows of its ddpflow run: where its files go, its dataset (None without a data section) and
    its config (the run's PipelineConfig as JSON)."""

    run_dir: Path
    dataset_dir: Path | None
    config: dict[str, Any]

    @property
    def train(self) -> dict[str, Any]:
        return self.config.get("train") or {}

    def file(self, name: str) -> Path:
        """A file of the run directory (``training/core/layout.py``'s names)."""
        return run_file(self.run_dir, name)


@functools.cache
def current_run() -> ScriptRun | None:
    """The run this process belongs to; None when no ddpflow run launched it (a bare torchrun, a notebook)."""
    path = os.environ.get(JOB_ENV)
    if not path:
        return None
    job = json.loads(Path(path).read_text())
    dataset = job.get("dataset_dir")
    return ScriptRun(Path(job["run_dir"]), Path(dataset) if dataset else None, job["config"])


def rank() -> int:
    """This process's global rank: torchrun's ``RANK`` (0 in a plain process)."""
    return int(os.environ.get("RANK", "0"))


_said: set[str] = set()


def say_once(what: str, text: str) -> None:
    """One line on rank 0, once per process for ``what``: what a call did not do outside a ddpflow run."""
    if rank() == 0 and what not in _said:
        _said.add(what)
        print(f"ddpflow: {text}", file=sys.stderr, flush=True)


def checkpoint_dir() -> Path:
    """A directory for the script's own snapshots that survives torchrun's restarts and is the same on the re-run
    of an interrupted run (``RUN_DIR/checkpoints``); under a bare torchrun, ``./checkpoints``. Created."""
    run = current_run()
    path = run.file(CHECKPOINTS) if run is not None else Path(BARE_CHECKPOINTS).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def params() -> dict[str, Any]:
    """``train.script_params``: what ddpflow passed as ``--key value`` arguments (a sweep's trial: its values).
    Under a bare torchrun, the script's own ``--key value`` arguments read the same way (a value is JSON when it
    parses as JSON: ``0.01``, ``true``, ``[1, 2]``; else the text)."""
    run = current_run()
    if run is not None:
        return dict(run.train.get("script_params") or {})
    return parse_params(sys.argv[1:])


def parse_params(argv: list[str]) -> dict[str, Any]:
    """``--key value`` pairs of ``argv`` (``--key=value`` too), each value JSON where it parses as JSON."""
    found: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("--") or len(arg) == 2:
            continue
        key, equals, value = arg[2:].partition("=")
        if not equals:
            if index >= len(argv) or argv[index].startswith("--"):
                continue  # a flag without a value is the script's own business
            value, index = argv[index], index + 1
        found[key] = _typed(value)
    return found


def _typed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
