"""The sweep's trials: each one a real DDP run of the base config with its own values, told to Optuna.

    setup = SweepSetup(sweep, directory, dataset_dir, manifest, layout, tracking_uri, parent_run_id,
                       run_context, train=lambda request, run_id: run_train_stage(request))
    run_trials(setup, study)      # until sweep.trials trials have finished, a resumed sweep's included

One trial (``run_trial``): ``study.ask`` gives its values; its config is the base config with them set
(``Sweep.trial_config``) and ``train.run_root`` in the sweep's directory; its run directory is the one an
interrupted attempt left (``find_resumable_run``: the same training identity, resumed from its checkpoint)
or a new ``trial-NNN``; an MLflow child run nests under the sweep's parent; ``setup.train`` launches it
through the train stage (``ddpflow/launch/stage.py``: the launcher ``train.launcher`` names, local or
Slurm) while ``EpochJudge`` reports each epoch to the pruner (a training script's trial: ``ReportJudge``, each
report of the objective). How it ended is told to Optuna:
complete (its value: the selected epoch's objective, the weights model.pt holds), pruned (the last value
reported), or failed with its reason (a crash, NaN, a config the data refuses); the sweep goes on. An
interruption (Ctrl-C, SIGTERM, a cancelled flow run) leaves the trial RUNNING for the next run of the same
command (ddpflow/sweep/study.py: ``requeue_interrupted``) and is raised.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from ddpflow.launch.failure import LaunchInterrupted
from ddpflow.launch.stage import TrainRequest, TrainResult
from ddpflow.launch.supervisor import DEFAULT_GRACE_S
from ddpflow.rundirs import find_resumable_run, new_run_dir, record_mlflow_run
from ddpflow.sweep.pruning import EpochJudge, ReportJudge
from ddpflow.sweep.space import Sweep
from ddpflow.sweep.study import (
    FAIL_REASON,
    INTERRUPTED,
    MODEL_PATH,
    PRUNED_AT,
    RUN_DIR,
    RUN_ID,
    TRIALS_DIR,
    best_trial,
    decode,
    distributions,
    finished_trials,
)
from ddpflow.tracking.runs import end_pipeline_run, link_resumed_run
from ddpflow.tracking.sweep import finish_trial_run, start_trial_run
from training.core.config import PipelineConfig
from training.core.manifest import Manifest
from training.core.topology import RankLayout
from training.loop.selection import SELECTED_PREFIX
from training.models.registry import with_resolved_model
from training.preflight import check_data
from training.resolve import resolve_script

COMPLETE, PRUNED, FAILED = "complete", "pruned", "failed"
_STATES = {TrialState.COMPLETE: COMPLETE, TrialState.PRUNED: PRUNED, TrialState.FAIL: FAILED}


@dataclass
class SweepSetup:
    sweep: Sweep
    directory: Path  # ddpflow/sweep/study.py: sweep_dir
    dataset_dir: str | None  # None (and no manifest): a training script without a data section
    manifest: Manifest | None
    layout: RankLayout
    tracking_uri: str
    parent_run_id: str
    run_context: dict[str, Any]  # ddpflow/tracking/sweep.py: start_trial_run's
    train: Callable[[TrainRequest, str], TrainResult]  # (request, the trial's MLflow run id) -> result
    report: Callable[[str], None] = print  # one line per trial: the terminal, the Prefect log
    grace_s: float = DEFAULT_GRACE_S


@dataclass
class TrialOutcome:
    trial: int
    params: dict[str, Any]
    state: str  # complete | pruned | failed
    value: float | None = None
    reason: str | None = None
    run_id: str | None = None
    pruned_at: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_trials(setup: SweepSetup, study: optuna.Study) -> None:
    """Ask, run and tell until ``sweep.trials`` trials have finished; ``sweep.parallel`` at once."""
    lock, in_flight, stopping = threading.Lock(), [0], threading.Event()

    def next_trial() -> optuna.Trial | None:
        with lock:
            if stopping.is_set() or len(finished_trials(study)) + in_flight[0] >= setup.sweep.sweep.trials:
                return None
            in_flight[0] += 1
            return study.ask(distributions(setup.sweep))

    def work() -> None:
        while (trial := next_trial()) is not None:
            try:
                outcome = run_trial(setup, study, trial)
            except BaseException:
                stopping.set()  # the other trials under way finish; no new one starts
                raise
            finally:
                with lock:
                    in_flight[0] -= 1
            setup.report(progress_line(study, outcome, setup.sweep))

    parallel = setup.sweep.sweep.parallel
    if parallel == 1:
        work()
        return
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(guarded,), name=f"sweep-{i}")
        for i in range(parallel)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def trial_config(setup: SweepSetup, params: dict[str, Any]) -> PipelineConfig:
    """The base config with the trial's values, its runs under the sweep's directory, the model resolved (a
    training script: its path and hash, training/resolve.py)."""
    run_root = str(setup.directory / TRIALS_DIR)
    config = setup.sweep.trial_config({**params, "train.run_root": run_root})
    return resolve_script(config) if config.train.script else with_resolved_model(config, setup.manifest)


def run_trial(setup: SweepSetup, study: optuna.Study, trial: optuna.Trial) -> TrialOutcome:
    """One trial from its values to what Optuna and MLflow are told (see the module docstring)."""
    params = decode(setup.sweep, trial.params)
    outcome = TrialOutcome(trial.number, params, FAILED)
    try:
        config = trial_config(setup, params)
        if not config.train.script:  # a training script's data and batch are its own
            check_data(config, setup.manifest, setup.layout)  # e.g. a batch size above a rank's share of the rows
    except ValueError as error:
        return _failed(setup, study, trial, outcome, error)
    run_root = Path(config.train.run_root)
    fingerprint = setup.manifest.fingerprint if setup.manifest is not None else None
    run_dir = find_resumable_run(run_root, fingerprint, config) or new_run_dir(run_root, f"trial-{trial.number:03d}")
    outcome.run_id = run_id = start_trial_run(
        config, setup.parent_run_id, setup.sweep.study_name(), trial.number, run_dir, setup.run_context
    )
    objective = setup.sweep.objective
    if config.train.script:
        judge = ReportJudge(trial, run_dir, objective)  # its reports, not ddpflow's epochs
    else:
        judge = EpochJudge(trial, run_dir, objective, config.train.epochs)
    try:
        _record_run(setup, trial, run_dir, run_id)
        request = TrainRequest(
            config, setup.dataset_dir, str(run_dir), tracking_uri=setup.tracking_uri, layout=setup.layout,
            grace_s=setup.grace_s,
        )  # fmt: skip
        with judge:
            result = setup.train(request, run_id)
    except LaunchInterrupted:
        end_pipeline_run(run_id, setup.tracking_uri, status="KILLED")
        raise
    except Exception as error:
        outcome.value = judge.last_value
        return _failed(setup, study, trial, outcome, error)
    except BaseException:  # Ctrl-C, SIGTERM, a cancelled flow run: the trial stays RUNNING, run again on resume
        end_pipeline_run(run_id, setup.tracking_uri, status="KILLED")
        raise
    if judge.pruned_at is not None:
        outcome.state, outcome.value, outcome.pruned_at = PRUNED, judge.last_value, judge.pruned_at
        trial.set_user_attr(PRUNED_AT, judge.pruned_at)
        study.tell(trial, state=TrialState.PRUNED)
        finish_trial_run(setup.tracking_uri, run_id, PRUNED, judge.last_value, pruned_at=judge.pruned_at)
        return outcome
    value = result.metrics.get(SELECTED_PREFIX + objective, judge.last_value)  # a script's: its last report
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        error = ValueError(f"{objective} is {value} after training: nothing to judge the trial by")
        return _failed(setup, study, trial, outcome, error)
    outcome.state, outcome.value = COMPLETE, float(value)
    trial.set_user_attr(MODEL_PATH, result.model_path)
    study.tell(trial, float(value))
    finish_trial_run(setup.tracking_uri, run_id, COMPLETE, float(value))
    return outcome


def _record_run(setup: SweepSetup, trial: optuna.Trial, run_dir: Path, run_id: str) -> None:
    """RUN_DIR names the trial's MLflow run, the trial its run; an interrupted attempt's run is linked and KILLED."""
    earlier = record_mlflow_run(run_dir, run_id)
    if earlier is not None:  # an interrupted attempt of the same point trained here: one story in the UI
        link_resumed_run(setup.tracking_uri, earlier, run_id)
        end_pipeline_run(earlier, setup.tracking_uri, status="KILLED")
    trial.set_user_attr(RUN_ID, run_id)
    trial.set_user_attr(RUN_DIR, str(run_dir))


def _failed(
    setup: SweepSetup, study: optuna.Study, trial: optuna.Trial, outcome: TrialOutcome, error: BaseException
) -> TrialOutcome:
    reason = f"{type(error).__name__}: {str(error).strip()}"[:2000]
    outcome.state, outcome.reason = FAILED, reason
    trial.set_user_attr(FAIL_REASON, reason)
    study.tell(trial, state=TrialState.FAIL)
    if outcome.run_id is not None:
        finish_trial_run(setup.tracking_uri, outcome.run_id, FAILED, outcome.value, reason=reason)
    return outcome


def progress_line(study: optuna.Study, outcome: TrialOutcome, sweep: Sweep) -> str:
    """``trial 3 pruned after epoch 1 (val_loss 0.9) · 3/8 done: 1 complete, 1 pruned, 1 failed · best ...``"""
    shown = {key.removeprefix("train."): value for key, value in outcome.params.items()}
    how = {
        COMPLETE: f"complete: {sweep.objective} {outcome.value:.6g}" if outcome.value is not None else COMPLETE,
        PRUNED: f"pruned {_where(outcome.pruned_at, sweep)} ({sweep.objective} {outcome.value})",
        FAILED: f"failed: {outcome.reason}",
    }[outcome.state]
    done = finished_trials(study)
    states = [_STATES[trial.state] for trial in done]
    tally = ", ".join(f"{states.count(state)} {state}" for state in (COMPLETE, PRUNED, FAILED))
    best = best_trial(study)
    best_text = f"best {sweep.objective} {best.value:.6g} (trial {best.number})" if best is not None else "no best yet"
    return f"trial {outcome.trial} {shown}: {how} · {len(done)}/{sweep.sweep.trials} done: {tally} · {best_text}"


def _where(pruned_at: int | None, sweep: Sweep) -> str:
    """After ddpflow's epoch N (1-based), or at a training script's report step."""
    if sweep.base.train.script:
        return f"at step {pruned_at}"
    return f"after epoch {(pruned_at or 0) + 1}"


def trial_rows(study: optuna.Study, sweep: Sweep) -> list[dict[str, Any]]:
    """One row per counted trial (interrupted attempts left out): the parent run's table and plot."""
    best = best_trial(study)
    rows = []
    for trial in finished_trials(study):
        value = trial.value if trial.state == TrialState.COMPLETE else _last_report(trial)
        rows.append({
            "trial": trial.number,
            "state": _STATES[trial.state],
            "value": value,
            **decode(sweep, trial.params),
            "run_id": trial.user_attrs.get(RUN_ID),
            "pruned_at_epoch": trial.user_attrs.get(PRUNED_AT),
            "reason": trial.user_attrs.get(FAIL_REASON),
            "best": best is not None and trial.number == best.number,
        })  # fmt: skip
    return rows


def _last_report(trial: Any) -> float | None:
    if not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]


def interrupted_trials(study: optuna.Study) -> int:
    return sum(bool(trial.user_attrs.get(INTERRUPTED)) for trial in study.get_trials(deepcopy=False))
