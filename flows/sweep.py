"""The sweep flow: prepare once -> a trial per point (each a DDP run, pruned or not) -> the best trial alone
evaluated on the test split -> the champion gate, as one candidate.

Deployed as flow ``sweep-pipeline`` from entrypoint ``flows/sweep.py:sweep_pipeline``; ``ddpflow sweep
--config CFG`` runs it once. Parameters: ``config_file`` (a YAML file with a ``sweep`` section), ``config``
(the same as a mapping, the section included), ``overrides`` ("section.key=value", like ``--set``;
``sweep.trials=40`` too). The same command after an interruption continues the same sweep
(ddpflow/sweep/study.py). What each piece does: docs/sweeps.md.

Returns a summary: the study, trials complete/pruned/failed, the best trial (its value, values, MLflow run),
the gate's decision and the model version, the parent MLflow run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from ddpflow.launch.slurm.commands import check_cluster
from ddpflow.sweep.session import open_sweep
from ddpflow.sweep.space import Sweep, check_sweep_machine, load_sweep, sweep_from_raw
from ddpflow.sweep.trials import COMPLETE, FAILED, PRUNED, run_trials, trial_rows
from ddpflow.tracking.runs import (
    check_tracking_reachable,
    end_pipeline_run,
    tag_run,
    ui_url,
)
from ddpflow.tracking.sweep import tag_best_version
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from flows.params import _deep_merge
from flows.pipeline import INTERRUPTIONS, _prefect_context, evaluate_trained, gate
from tasks.prepare import prepare_data
from tasks.sweep import SweepProgress, summarise_sweep
from tasks.train import KILL_GRACE_S, TrainResult, train_model
from training.inference.baselines import model_metrics
from training.preflight import check_machine


def resolve_sweep(
    config: dict[str, Any] | None = None, config_file: str | None = None, overrides: list[str] | None = None
) -> Sweep:
    """The file, then the mapping's keys over it, then the overrides (as the train pipeline combines them)."""
    if config is None:
        return load_sweep(config_file, overrides)
    from training.core.config import apply_overrides, read_yaml

    raw = _deep_merge(read_yaml(config_file) if config_file else {}, dict(config))
    return sweep_from_raw(apply_overrides(raw, list(overrides or [])))


def _flow_run_name() -> str:
    params = flow_run.parameters or {}
    try:
        sweep = resolve_sweep(params.get("config"), params.get("config_file"), params.get("overrides"))
        return f"sweep-{sweep.study_name()}"
    except Exception:  # the flow itself reports a bad config, naming the field
        return "sweep-invalid-config"


@flow(name="sweep-pipeline", flow_run_name=_flow_run_name, log_prints=True)
def sweep_pipeline(
    config: dict[str, Any] | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Tune train.* settings on one prepared dataset; the best trial alone meets the test split and the gate."""
    logger = get_run_logger()
    sweep = resolve_sweep(config, config_file, overrides)
    layout = check_machine(sweep.base)
    check_sweep_machine(sweep, layout)  # parallel x nproc_per_node ranks fit the machine
    if sweep.base.train.launcher == "slurm":
        check_cluster(sweep.base)
    tracking_uri = resolve_tracking_uri(sweep.base)
    check_tracking_reachable(tracking_uri)
    prepared = prepare_data(sweep.base) if sweep.base.data is not None else None  # once: every trial's dataset
    dataset_dir = str(prepared.dataset_dir) if prepared is not None else None

    def train(request, run_id):
        return train_model(replace(request, grace_s=KILL_GRACE_S), mlflow_run_id=run_id)

    manifest = prepared.manifest if prepared is not None else None
    setup, study = open_sweep(
        sweep, dataset_dir, manifest, layout, tracking_uri, _prefect_context(), train, report=logger.info,
        grace_s=KILL_GRACE_S,
    )  # fmt: skip
    setup.report = SweepProgress(sweep.sweep.trials, study)
    parent = setup.parent_run_id
    logger.info("sweep %s: %d trial(s) in all, study %s", sweep.study_name(), sweep.sweep.trials, setup.directory)
    try:
        run_trials(setup, study)
        best = summarise_sweep(setup, study)
        if best is None:
            raise RuntimeError(
                f"sweep {sweep.study_name()}: no trial completed, so nothing goes to the gate; "
                f"each trial's reason is in MLflow run {parent}'s sweep/trials.csv"
            )
        # Only the best trial meets the test split, and goes through the gate as one candidate.
        trained = TrainResult(str(best.run_dir), best.model_path)
        candidate = evaluate_trained(best.config, trained, dataset_dir, best.run_id, tracking_uri)
        decision = gate(best.config, candidate, dataset_dir, best.run_id, tracking_uri)
        if decision.get("version"):
            tag_best_version(
                tracking_uri, best.config.registry.model_name, str(decision["version"]), sweep.study_name(), best.run_id
            )
        tag_run(tracking_uri, parent, {f"registry.{k}": str(decision.get(k)) for k in ("decision", "version")})
    except BaseException as error:
        end_pipeline_run(parent, tracking_uri, status="KILLED" if isinstance(error, INTERRUPTIONS) else "FAILED")
        if isinstance(error, INTERRUPTIONS):
            hint = "re-run the same command to continue the sweep: finished trials stay, the interrupted one runs again"
            error.add_note(hint)
            logger.warning("Stopped: %s (study %s)", hint, setup.directory)
        raise
    end_pipeline_run(parent, tracking_uri, status="FINISHED")
    states = [row["state"] for row in trial_rows(study, sweep)]
    return {
        "sweep": sweep.study_name(),
        "sweep_dir": str(setup.directory),
        "trials": {state: states.count(state) for state in (COMPLETE, PRUNED, FAILED)},
        "objective": sweep.objective,
        "best_trial": best.number,
        "best_value": best.value,
        "best_params": best.params,
        "best_run_id": best.run_id,
        "model_name": best.config.registry.model_name,
        "model_version": decision.get("version"),
        "decision": decision.get("decision"),
        "reason": decision.get("reason"),
        "test_metrics": model_metrics(candidate.metrics),
        "mlflow_run_id": parent,
        "mlflow_run_url": ui_url(tracking_uri, parent),
        "tracking_uri": tracking_uri,
        "dataset_dir": dataset_dir,
        "flow_run_id": str(flow_run.id),
    }
