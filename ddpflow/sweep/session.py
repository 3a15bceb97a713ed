"""A sweep from its prepared data to its best trial, in the order the flow runs it (plain Python, no Prefect).

    setup, study = open_sweep(sweep, dataset_dir, manifest, layout, tracking_uri, prefect_context, train=...)
    run_trials(setup, study)                 # ddpflow/sweep/trials.py
    best = summarise(setup, study)           # the parent run's table, plot and best trial; None: no trial completed

``flows/sweep.py`` runs these with the Prefect tasks (``train_model`` for each trial's launch, then
``evaluate_model`` and ``register_model`` for the best trial alone); ``plain_train`` launches a trial
without Prefect, mirroring its epochs into its MLflow run as the train task does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ddpflow.launch.stage import TrainRequest, TrainResult, run_train_stage
from ddpflow.sweep.space import Sweep
from ddpflow.sweep.study import (
    MODEL_PATH,
    PARENT_RUN,
    RUN_DIR,
    RUN_ID,
    best_trial,
    decode,
    open_study,
    requeue_interrupted,
    sweep_dir,
)
from ddpflow.sweep.trials import SweepSetup, trial_config, trial_rows
from ddpflow.tracking.metrics import EpochMetricsFollower
from ddpflow.tracking.sweep import log_sweep_summary, start_sweep_run
from training.core.layout import METRICS, run_file
from training.core.manifest import Manifest
from training.core.topology import RankLayout
from training.models.registry import with_resolved_model
from training.preflight import check_data
from training.resolve import resolve_script


@dataclass
class BestTrial:
    number: int
    value: float
    params: dict[str, Any]
    run_id: str
    model_path: str | None  # a training script's: its exported program, None when it logged no model
    config: Any  # PipelineConfig of the trial
    run_dir: str | None = None


def open_sweep(
    sweep: Sweep,
    dataset_dir: str | None,
    manifest: Manifest | None,
    layout: RankLayout,
    tracking_uri: str,
    prefect_context: dict[str, Any],
    train: Callable[[TrainRequest, str], TrainResult],
    report: Callable[[str], None] = print,
    **options: Any,
):
    """The study (created or resumed, interrupted trials queued again) and the parent MLflow run. ``manifest``
    None: a training script without a data section."""
    if sweep.base.train.script:
        base = resolve_script(sweep.base)  # its data and model are its own: nothing to check against data
    else:
        base = with_resolved_model(sweep.base, manifest)
        check_data(base, manifest, layout)  # the base config fits the data; each trial's values are checked too
    directory = sweep_dir(sweep)
    study = open_study(sweep, directory)
    for number in requeue_interrupted(study):
        report(
            f"trial {number} was interrupted: its values run again (resuming its run directory if it has a checkpoint)"
        )
    run_context = {
        "tracking_uri": tracking_uri,
        "prefect_context": prefect_context,
        "fingerprint": manifest.fingerprint if manifest is not None else None,
        "manifest": manifest,
        "ddp": {"nproc_per_node": layout.nproc_per_node, "nnodes": layout.nnodes, "world_size": layout.world_size,
                "backend": layout.backend},
        "dataset_dir": dataset_dir,
    }  # fmt: skip
    section = sweep.sweep.model_dump(mode="json")
    parent = start_sweep_run(
        base, sweep.study_name(), section, directory, run_context, study.user_attrs.get(PARENT_RUN)
    )
    study.set_user_attr(PARENT_RUN, parent)
    setup = SweepSetup(
        sweep, directory, dataset_dir and str(dataset_dir), manifest, layout, tracking_uri, parent, run_context, train,
        report,
        **options,
    )  # fmt: skip
    return setup, study


def summarise(setup: SweepSetup, study: Any) -> BestTrial | None:
    """The parent run's table of every trial, its plot and its best trial; the best complete trial, if any."""
    sweep = setup.sweep
    keys = list(sweep.sweep.space)
    log_keys = tuple(key for key, dimension in sweep.sweep.space.items() if dimension.log)
    log_sweep_summary(
        setup.tracking_uri, setup.parent_run_id, trial_rows(study, sweep), keys, sweep.objective, log_keys
    )
    best = best_trial(study)
    if best is None:
        return None
    params = decode(sweep, best.params)
    return BestTrial(
        best.number, best.value, params, best.user_attrs[RUN_ID], best.user_attrs.get(MODEL_PATH),
        trial_config(setup, params), best.user_attrs.get(RUN_DIR),
    )  # fmt: skip


def plain_train(request: TrainRequest, run_id: str) -> TrainResult:
    """A trial's launch without Prefect: the train stage, its epochs mirrored into the trial's MLflow run."""
    follower = EpochMetricsFollower(run_file(request.run_dir, METRICS), run_id, request.tracking_uri).start()

    def on_line(line: Any) -> None:
        print(line, flush=True)
        follower.poke()

    try:
        return run_train_stage(replace(request, on_line=on_line))
    finally:
        follower.close()
