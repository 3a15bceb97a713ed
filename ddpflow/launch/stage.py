"""The train stage's one contract: a ``TrainRequest`` in, a ``TrainResult`` out (plain Python, no Prefect).

    request = TrainRequest(config, dataset_dir, run_dir, on_line=print)
    result = launcher_for(config)(request)            # train.launcher picks it from LAUNCHERS

Every launcher (``ddpflow/launch/local.py``: torchrun on this machine; ``slurm/launcher.py``: one batch
job) is a ``Launcher``: it takes the request and returns the result, or raises one of the
same errors (``RankFailed`` with the root cause, ``LaunchTimeout``, ``LaunchStalled``,
``LaunchInterrupted``, ``LaunchError``; ``ConfigError`` from the preflight before anything
starts). A Kubernetes launcher would be one more module and one more entry in ``LAUNCHERS``
(and in ``train.launcher``'s choices); a new stage parameter is one more field of
``TrainRequest``, read by the launchers that need it.

What every launcher does the same way lives here, once: the preflight's data checks, the
run's config.json and the ``TrainJob`` every rank reads, and reading the result.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ddpflow.launch.supervisor import DEFAULT_GRACE_S, OutputLine
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write_json
from training.core.job import TrainJob
from training.core.layout import CONFIG, FINAL_MODEL, METRICS, SCRIPT_DONE, SCRIPT_PROGRAM, TRAIN_JOB, run_file
from training.core.manifest import read_manifest
from training.core.topology import RankLayout
from training.preflight import check_data, check_machine
from training.resolve import resolve_for_data

# train.launcher -> the module:function that runs the stage that way. Imported when chosen, so that
# the contract's types (this module) are importable by every launcher without an import circle.
LAUNCHERS: dict[str, str] = {
    "local": "ddpflow.launch.local:run_training",
    "slurm": "ddpflow.launch.slurm.launcher:run_training_on_slurm",
}


@dataclass(frozen=True)
class TrainRequest:
    """Everything a launcher needs to run the train stage once; frozen, so no launcher edits its caller's."""

    config: PipelineConfig
    dataset_dir: (
        str | os.PathLike | None
    )  # <data.root>/<fingerprint>, holding manifest.json; None: a script without data
    run_dir: str | os.PathLike
    init_weights: str | None = None  # a model.pt to warm-start from (already resolved: a path)
    tracking_uri: str | None = None  # passed to the ranks' environment; no rank talks to MLflow
    layout: RankLayout | None = None  # what the caller's check_machine returned; None: checked here
    # What the launcher tells its caller, in the calling thread:
    on_line: Callable[[OutputLine], None] = print  # every line of every rank, torchrun and the scheduler
    on_start: Callable[[RankLayout, list[str]], None] | None = None  # just before the ranks (or job) start
    on_job: Callable[[str], None] | None = None  # a scheduler's job id, once submitted or found (Slurm)
    should_cancel: Callable[[], str | None] | None = None  # a non-empty reason stops the stage
    cancel_check_s: float = 2.0  # how often should_cancel is asked
    grace_s: float = DEFAULT_GRACE_S  # SIGTERM -> SIGKILL for the ranks


@dataclass
class TrainResult:
    run_dir: str
    model_path: str | None  # model.pt; a training script's: its exported program, None when it logged no model
    metrics: dict[str, Any] = field(default_factory=dict)  # the last line of RUN_DIR/metrics.jsonl
    restarts: int = 0  # torchrun worker-group restarts used by this launch


class Launcher(Protocol):
    """Runs the train stage as ``request`` says; raises a LaunchError (or ConfigError) naming why not."""

    def __call__(self, request: TrainRequest) -> TrainResult: ...


def launcher_for(config: PipelineConfig) -> Launcher:
    """``train.launcher``'s launcher, from ``LAUNCHERS``."""
    module, _, function = LAUNCHERS[config.train.launcher].partition(":")
    return getattr(importlib.import_module(module), function)


def run_train_stage(request: TrainRequest) -> TrainResult:
    """The train stage with the launcher its config names, on the config resolved for the data
    (``training/resolve.py``: a no-op where the pipeline resolved it already; a training script has nothing to
    resolve)."""
    layout = check_machine(request.config) if request.layout is None else request.layout
    resolved = request.config
    if not resolved.train.script:
        resolved = resolve_for_data(resolved, read_manifest(request.dataset_dir), layout.world_size)
    return launcher_for(resolved)(dataclasses.replace(request, config=resolved, layout=layout))


# ----------------------------------------------------------------------------- what every launcher shares


def check_request(request: TrainRequest) -> RankLayout:
    """The preflight's machine (unless the caller ran it) and data checks; ConfigError before anything starts. A
    training script's data is its own business: only the machine is checked."""
    layout = check_machine(request.config) if request.layout is None else request.layout
    if not request.config.train.script:
        check_data(request.config, read_manifest(request.dataset_dir), layout)
    return layout


def write_job(request: TrainRequest, run_dir: Path, dataset_dir: str | os.PathLike | None) -> Path:
    """RUN_DIR/config.json and the TrainJob every rank reads (RUN_DIR/train_config.json); its path."""
    request.config.write_json(run_file(run_dir, CONFIG))
    job = TrainJob(
        config=request.config,
        dataset_dir=None if dataset_dir is None else str(dataset_dir),
        run_dir=str(run_dir),
        init_weights=request.init_weights,
    )
    return job.write(run_file(run_dir, TRAIN_JOB))


def finished_result(config: PipelineConfig, run_dir: Path, restarts: int, ended: str) -> TrainResult:
    """The result of a launch that ended well (``ended`` says how, for the error when model.pt is missing). A
    training script's run is marked done (RUN_DIR/script/done.json: finished, never resumed) and its model is the
    program ``ddpflow.log_model`` exported, if it logged one."""
    if config.train.script:
        atomic_write_json(run_file(run_dir, SCRIPT_DONE), {"restarts": restarts, "ended": ended})
        program = run_file(run_dir, SCRIPT_PROGRAM)
        return TrainResult(str(run_dir), str(program) if program.is_file() else None, {}, restarts)
    model_path = run_file(run_dir, FINAL_MODEL)
    if not model_path.is_file():
        raise RuntimeError(f"{ended} but wrote no {model_path}: training did not finish")
    return TrainResult(str(run_dir), str(model_path), last_metrics(run_file(run_dir, METRICS)), restarts)


def last_metrics(path: Path) -> dict[str, Any]:
    """The last JSON line of metrics.jsonl ({} when there is none)."""
    try:
        lines = [text for text in path.read_text().splitlines() if text.strip()]
    except FileNotFoundError:
        return {}
    return json.loads(lines[-1]) if lines else {}
