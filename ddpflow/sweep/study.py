"""The Optuna study behind a sweep: its SQLite storage in the sweep's directory, sampler, pruner and distributions,
and what a resumed sweep does with the trials an interruption left behind.

    <train.run_root>/sweeps/<study name>/study.db     Optuna's RDBStorage (one SQLite file)
    <train.run_root>/sweeps/<study name>/trials/      each trial's run directory (ddpflow/rundirs.py)

Resuming: the same command opens the same study (``Sweep.study_name``). Finished trials (complete, pruned,
failed) stay. A trial still RUNNING was interrupted (SIGTERM, a machine lost): ``requeue_interrupted`` marks it
failed with ``ddpflow.interrupted`` and enqueues its parameters again, so the next ``ask`` runs the same point,
and the launch resumes its run directory from its last checkpoint (the same training identity). Interrupted
trials do not count: the sweep ends at ``trials`` finished trials in all (``finished_trials``).

A choice that Optuna cannot store (a list such as ``[256, 256]``) is stored as its JSON text and decoded back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from ddpflow.sweep.space import Dimension, Sweep, is_integer_range

STORAGE_FILE = "study.db"
TRIALS_DIR = "trials"
INTERRUPTED = "ddpflow.interrupted"  # user attr: failed because the sweep stopped, run again
RERUN_OF = "ddpflow.rerun_of"  # user attr of the re-run: the interrupted trial's number
FAIL_REASON = "ddpflow.fail_reason"
RUN_ID, RUN_DIR, MODEL_PATH = "ddpflow.run_id", "ddpflow.run_dir", "ddpflow.model_path"
PRUNED_AT = "ddpflow.pruned_at_epoch"
PARENT_RUN = "ddpflow.parent_run_id"  # study user attr: the sweep's MLflow parent run, kept across resumes
ENQUEUED = "ddpflow.enqueued"  # study user attr: sweep.enqueue was queued once
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def sweep_dir(sweep: Sweep) -> Path:
    return Path(sweep.base.train.run_root).resolve() / "sweeps" / sweep.study_name()


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _encode(value: Any) -> Any:
    return value if _is_scalar(value) else json.dumps(value)


def distributions(sweep: Sweep) -> dict[str, BaseDistribution]:
    """Each space key's Optuna distribution, in the space's order."""
    return {key: _distribution(key, dimension) for key, dimension in sweep.sweep.space.items()}


def _distribution(key: str, dimension: Dimension) -> BaseDistribution:
    if dimension.choices is not None:
        return CategoricalDistribution([_encode(choice) for choice in dimension.choices])
    if is_integer_range(key, dimension):
        return IntDistribution(int(dimension.low), int(dimension.high), log=dimension.log)
    return FloatDistribution(float(dimension.low), float(dimension.high), log=dimension.log)


def decode(sweep: Sweep, params: dict[str, Any]) -> dict[str, Any]:
    """A trial's stored parameters as the config takes them (a list choice back from its JSON text)."""
    decoded = {}
    for key, value in params.items():
        dimension = sweep.sweep.space.get(key)
        choices = dimension.choices if dimension is not None else None
        decoded[key] = next((c for c in choices if _encode(c) == value), value) if choices else value
    return decoded


def grid(sweep: Sweep) -> dict[str, list[Any]]:
    """The grid sampler's points: every choice, every integer of an integer range (space.py refuses floats)."""
    points = {}
    for key, dimension in sweep.sweep.space.items():
        if dimension.choices is not None:
            points[key] = [_encode(choice) for choice in dimension.choices]
        else:
            points[key] = list(range(int(dimension.low), int(dimension.high) + 1))
    return points


def sampler(sweep: Sweep) -> optuna.samplers.BaseSampler:
    seed = sweep.sweep.seed
    if sweep.sweep.sampler == "grid":
        return optuna.samplers.GridSampler(grid(sweep), seed=seed)
    if sweep.sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    if sweep.sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=sweep.sweep.startup_trials, n_warmup_steps=0)
    if sweep.sweep.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def open_study(sweep: Sweep, directory: Path) -> optuna.Study:
    """Create the study, or load it: the same command continues the same sweep."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep logs each trial itself
    directory.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{directory / STORAGE_FILE}", engine_kwargs={"connect_args": {"timeout": 60}}
    )
    study = optuna.create_study(
        study_name=sweep.study_name(),
        storage=storage,
        direction="maximize" if sweep.maximize else "minimize",
        sampler=sampler(sweep),
        pruner=pruner(sweep),
        load_if_exists=True,
    )
    if not study.user_attrs.get(ENQUEUED):
        for point in sweep.sweep.enqueue:
            study.enqueue_trial({key: _encode(value) for key, value in point.items()}, skip_if_exists=True)
        study.set_user_attr(ENQUEUED, True)
    return study


def requeue_interrupted(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a sweep that stopped: failed as interrupted, their parameters queued again."""
    requeued = []
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial = optuna.trial.Trial(study, frozen._trial_id)
        trial.set_user_attr(INTERRUPTED, True)
        trial.set_user_attr(FAIL_REASON, "interrupted: the sweep stopped while it ran; run again")
        study.tell(trial, state=TrialState.FAIL)
        study.enqueue_trial(frozen.params, user_attrs={RERUN_OF: frozen.number})
        requeued.append(frozen.number)
    return requeued


def counts(trial: FrozenTrial) -> bool:
    """Whether a trial counts towards ``sweep.trials``: finished, and not merely interrupted."""
    return trial.state in FINISHED and not trial.user_attrs.get(INTERRUPTED)


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    return [trial for trial in study.get_trials(deepcopy=False) if counts(trial)]


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial (a pruned one never: its model saw fewer epochs), or None."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return study.best_trial if complete else None
