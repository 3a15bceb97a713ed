"""The training pipeline: prepare -> train (torchrun + DDP) -> evaluate -> register.

Deployed as flow ``train-pipeline`` from entrypoint ``flows/pipeline.py:train_pipeline``.

Parameters (see flows/params.py for how they combine):
    config: PipelineConfig | None   the validated config; the UI renders it as a form
    config_file: str | None         e.g. "configs/demo.yaml", read where the flow runs
    overrides: list[str] | None     "section.key=value" strings, like `ddpflow run --set`

Returns a summary dict: model name and version, the gate's decision, test
metrics, data drift from the champion's training data, the MLflow run id and
URL, the run directory.

The data drift from the champion's training data is measured beside the training (its task is submitted
before the train task, and the flow waits for it before the gate, which reads it).

``train.skip_if_unchanged``: when @champion was trained on this very data with
the same weight-changing settings (ddpflow/tracking/skip.py), the flow ends
Completed after prepare and the checks, without training: the decision is
``skipped`` with the reason (the state's message, a markdown artifact
``training-skipped``, and an MLflow run tagged ``ddpflow.skipped=true``).

On any failure after the MLflow run exists, the run is ended FAILED (KILLED
when it was stopped from outside), the run directory (checkpoints, metrics.jsonl) stays on disk, the champion alias is
never touched, and the original error is re-raised so its root cause shows. A run stopped from outside
says how to go on: "re-run the same command to resume from epoch N" (a note on the error, which
`ddpflow run` prints, and a line in the flow run's log).

A run that resumes an unfinished run directory is tagged ``ddpflow.resumed_from`` with the MLflow run
that trained there before, and that run ``ddpflow.resumed_by`` with it (RUN_DIR/mlflow_run.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import Abort, TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Completed, State

from ddpflow.console import LOG_ONLY
from ddpflow.launch.failure import LaunchInterrupted, LaunchPreempted
from ddpflow.launch.slurm.commands import check_cluster
from ddpflow.launch.supervisor import read_preempted
from ddpflow.rundirs import find_resumable_run, new_run_dir, record_mlflow_run, resume_epoch
from ddpflow.tracking.registry import champion_checkpoint
from ddpflow.tracking.runs import (
    RESTARTS_TAG,
    RUN_DIR_TAG,
    check_tracking_reachable,
    end_pipeline_run,
    how_to_open,
    link_resumed_run,
    log_rank_logs,
    preempted_tags,
    start_pipeline_run,
    tag_run,
    ui_url,
)
from ddpflow.tracking.script_models import dataset_model_file, gate_metric, script_outcome
from ddpflow.tracking.skip import SKIPPED, SkipCheck, check_unchanged, record_skipped_run
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from flows.params import resolve_config, run_label
from tasks.drift import measure_data_drift
from tasks.evaluate import evaluate_model, fit_reference_model
from tasks.prepare import prepare_data
from tasks.register import register_model
from tasks.train import KILL_GRACE_S, TrainRequest, TrainResult, train_model
from training.core.config import PipelineConfig
from training.core.topology import RankLayout
from training.inference.baselines import REFERENCE, TRIVIAL, baseline_values, comparison, model_metrics
from training.inference.reference import FittedReference
from training.loop.selection import selection_summary
from training.preflight import check_data, check_machine
from training.prepare.dataset import PreparedDataset
from training.resolve import resolve_for_data, resolve_script

TRACKED = "tracked"  # a training script's run with nothing to register: the decision beside promoted, rejected...

# Stopped from outside (Ctrl-C, a signal, a cancelled flow run): the MLflow run ends KILLED, not FAILED.
# Abort: train_model's answer to a cancelled flow run; TerminationSignal: Prefect's SIGTERM (a worker cancelling).
# LaunchPreempted: the ranks saved and stopped (training/loop/preemption.py), after the task's retry.
INTERRUPTIONS = (KeyboardInterrupt, SystemExit, LaunchInterrupted, LaunchPreempted, Abort, TerminationSignal)


def _flow_run_name() -> str:
    """``<model>-<data>`` from the run's parameters; Prefect calls this with none."""
    params = flow_run.parameters or {}
    try:
        return run_label(resolve_config(params.get("config"), params.get("config_file"), params.get("overrides")))
    except Exception:  # a bad config is reported by the flow itself, with the field's name
        return "invalid-config"


@flow(name="train-pipeline", flow_run_name=_flow_run_name, log_prints=True)
def train_pipeline(
    config: PipelineConfig | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Prepare the data, train with DDP, evaluate on the test split, register in MLflow behind a gate."""
    logger = get_run_logger()
    config = resolve_config(config, config_file, overrides)
    # Everything that can be checked without data is checked before anything starts.
    layout = check_machine(config)  # the ranks this machine will run, and the model import (or the script's file)
    if config.train.launcher == "slurm":
        check_cluster(config)  # the Slurm commands answer, the partition exists and has the nodes
    tracking_uri = resolve_tracking_uri(config)
    check_tracking_reachable(tracking_uri)

    prepared = prepare_data(config) if config.data is not None else None  # a training script may have no data
    config = _resolved(config, prepared, layout)
    fingerprint = prepared.manifest.fingerprint if prepared is not None else None
    if config.train.skip_if_unchanged:
        unchanged = check_unchanged(config, fingerprint, tracking_uri)
        if unchanged.skip:
            return _skipped(config, prepared, unchanged, layout, tracking_uri)
        logger.info("train.skip_if_unchanged: training, because %s", unchanged.reason)

    run_name = flow_run.name or run_label(config)
    run_dir = find_resumable_run(config.train.run_root, fingerprint, config)
    if run_dir is not None:
        logger.info("Resuming the unfinished run in %s", run_dir)
    else:
        run_dir = new_run_dir(config.train.run_root, run_name)
    init_weights = _warm_start_weights(config, Path(run_dir), logger)
    dataset_dir = str(prepared.dataset_dir) if prepared is not None else None

    run_id = start_pipeline_run(
        config,
        run_name=Path(run_dir).name,
        prefect_context=_prefect_context(),
        fingerprint=fingerprint,
        manifest=prepared.manifest if prepared is not None else None,
        ddp=_ddp_params(config, layout),
        dataset_dir=dataset_dir,
    )
    # Beside the training, each reading the prepared data only: the drift (and the champion's profile) and the
    # reference model's fit.
    drifting = referencing = None
    try:
        tag_run(tracking_uri, run_id, {RUN_DIR_TAG: str(run_dir)})
        earlier_run_id = record_mlflow_run(run_dir, run_id)
        if earlier_run_id is not None:
            link_resumed_run(tracking_uri, earlier_run_id, run_id)
        if prepared is not None:
            drifting = measure_data_drift.submit(config, prepared.manifest, run_id, tracking_uri)
            referencing = fit_reference_model.submit(dataset_dir, config)
        request = TrainRequest(
            config,
            dataset_dir,
            str(run_dir),
            init_weights=init_weights,
            tracking_uri=tracking_uri,
            layout=layout,  # checked above: the launcher does not check again
            grace_s=KILL_GRACE_S,
        )
        trained = train_model(request, mlflow_run_id=run_id)
        drift = drifting.result() if drifting is not None else None  # logged to the run before the gate reads it
        tag_run(tracking_uri, run_id, {RESTARTS_TAG: str(trained.restarts)})
        reference = referencing.result() if referencing is not None else None
        candidate = evaluate_trained(config, trained, dataset_dir, run_id, tracking_uri, reference)
        # Everything that can fail runs before the gate: once @champion moves, the flow must not fail.
        mlflow_run_url = ui_url(tracking_uri, run_id)
        decision = gate(config, candidate, dataset_dir, run_id, tracking_uri)
    except BaseException as error:
        for beside in (drifting, referencing):  # the drift logs to the run: both end before the run and the flow do
            if beside is not None:
                beside.wait()
        interrupted = isinstance(error, INTERRUPTIONS)
        if interrupted:
            _tag_preempted(tracking_uri, run_id, Path(run_dir))
        if config.train.script:
            log_rank_logs(tracking_uri, run_id, run_dir)
        end_pipeline_run(run_id, tracking_uri, status="KILLED" if interrupted else "FAILED")
        if interrupted:
            _say_how_to_resume(error, Path(run_dir), logger)
        raise
    end_pipeline_run(run_id, tracking_uri, status="FINISHED")
    evaluated = candidate.evaluated_on_test_split
    return {
        "flow_run": run_name,
        "flow_run_id": str(flow_run.id),
        "model_name": config.registry.model_name,
        "model_version": decision.get("version"),
        "decision": decision.get("decision"),
        "gate_metric": decision.get("metric"),  # the metric that decided (registry.metric, else the objective's)
        "reason": decision.get("reason"),
        **({"warning": decision["warning"]} if decision.get("warning") else {}),
        "test_metrics": model_metrics(candidate.metrics),
        **({"baselines": _baselines(decision.get("metric"), candidate.metrics)} if evaluated else {}),
        **({"selection": selection_summary(trained.metrics, config.train)} if not config.train.script else {}),
        "data_drift": drift,
        "mlflow_run_id": run_id,
        "mlflow_run_url": mlflow_run_url,
        "tracking_uri": tracking_uri,
        "run_dir": str(run_dir),
        "dataset_dir": dataset_dir,
        "cache_hit": prepared.cache_hit if prepared is not None else None,
        "restarts": trained.restarts,
    }


def _resolved(config: PipelineConfig, prepared: PreparedDataset | None, layout: RankLayout) -> PipelineConfig:
    """The config as the run records it. ddpflow's trainer: ``train.model auto`` -> the built-in model for these
    inputs, the mlp's defaults, the batch and the patience for this data (training/resolve.py), then the data
    checks. A training script: its absolute path and its file's sha256 (its data and model are its own)."""
    if config.train.script:
        return resolve_script(config)
    config = resolve_for_data(config, prepared.manifest, layout.world_size)
    check_data(config, prepared.manifest, layout)
    return config


@dataclass(frozen=True)
class Candidate:
    """What the gate judges: the model's file (None: nothing to register, and why) and its metrics: the test
    split's, evaluated here (ddpflow's models; a script's with a data section), or the script's own reports."""

    model_path: str | None
    metrics: dict[str, float]
    evaluated_on_test_split: bool
    nothing_to_register: str | None = None


def evaluate_trained(
    config: PipelineConfig,
    trained: TrainResult,
    dataset_dir: str | None,
    run_id: str,
    tracking_uri: str,
    reference: FittedReference | None = None,
) -> Candidate:
    """The trained model, evaluated exactly on the test split where ddpflow has one (module doc), with the
    ``reference`` fitted beside its training; a training script's rank logs go to its MLflow run first."""
    if not config.train.script:
        metrics = evaluate_model(trained.model_path, dataset_dir, run_id, tracking_uri, config, reference)
        return Candidate(trained.model_path, metrics, True)
    log_rank_logs(tracking_uri, run_id, trained.run_dir)
    outcome = script_outcome(trained.run_dir)
    why_not = outcome.nothing_to_register()
    if why_not is not None:
        return Candidate(None, outcome.reported, False, why_not)
    if dataset_dir is None:
        _, why_not = gate_metric(config, outcome.reported)  # several test_* metrics: tracked, not registered
        return Candidate(str(outcome.program), outcome.reported, False, why_not)
    model_path = str(dataset_model_file(trained.run_dir, outcome.program, dataset_dir))
    metrics = evaluate_model(model_path, dataset_dir, run_id, tracking_uri, config, reference)
    return Candidate(model_path, metrics, True)


def gate(
    config: PipelineConfig, candidate: Candidate, dataset_dir: str | None, run_id: str, tracking_uri: str
) -> dict[str, Any]:
    """The champion gate's decision, or why nothing was registered (a training script's run that stays tracked)."""
    if candidate.nothing_to_register is not None:
        get_run_logger().info("Nothing registered: %s", candidate.nothing_to_register)
        tag_run(tracking_uri, run_id, {"registry.decision": TRACKED, "registry.reason": candidate.nothing_to_register})
        return {"decision": TRACKED, "reason": candidate.nothing_to_register}
    return register_model(config, run_id, candidate.model_path, dataset_dir, candidate.metrics, tracking_uri)


def _skipped(
    config: PipelineConfig,
    prepared: PreparedDataset | None,
    unchanged: SkipCheck,
    layout: RankLayout,
    tracking_uri: str,
) -> State:
    """End Completed without training: the night's MLflow run (tagged skipped, FINISHED), an artifact, the reason.
    ``prepared`` None: a training script without a data section."""
    run_name = flow_run.name or run_label(config)
    dataset_dir = str(prepared.dataset_dir) if prepared is not None else None
    run_id = start_pipeline_run(
        config,
        run_name=f"skipped-{run_name}",
        prefect_context=_prefect_context(),
        fingerprint=unchanged.fingerprint,
        manifest=prepared.manifest if prepared is not None else None,
        ddp=_ddp_params(config, layout),
        dataset_dir=dataset_dir,
    )
    try:
        record_skipped_run(tracking_uri, run_id, unchanged)
        mlflow_run_url = ui_url(tracking_uri, run_id)
    except BaseException as error:
        end_pipeline_run(run_id, tracking_uri, status="KILLED" if isinstance(error, INTERRUPTIONS) else "FAILED")
        raise
    end_pipeline_run(run_id, tracking_uri, status="FINISHED")
    get_run_logger().info("Skipped: %s", unchanged.reason)
    create_markdown_artifact(
        markdown=(
            f"# Training skipped\n\n{unchanged.reason}.\n\n"
            f"`train.skip_if_unchanged` is true; @champion stays {config.registry.model_name} "
            f"v{unchanged.champion_version}.{_dataset_note(prepared)}\n\n"
            f"MLflow: {how_to_open(tracking_uri, run_id)} (tagged `ddpflow.skipped=true`)\n"
        ),
        key="training-skipped",
        description=f"Why flow run {run_name} did not train",
    )
    summary = {
        "flow_run": run_name,
        "flow_run_id": str(flow_run.id),
        "model_name": config.registry.model_name,
        "model_version": unchanged.champion_version,
        "decision": SKIPPED,
        "reason": unchanged.reason,
        "fingerprint": unchanged.fingerprint,
        "training_identity": unchanged.training_identity,
        "test_metrics": {},
        "mlflow_run_id": run_id,
        "mlflow_run_url": mlflow_run_url,
        "tracking_uri": tracking_uri,
        "run_dir": None,
        "dataset_dir": dataset_dir,
        "cache_hit": prepared.cache_hit if prepared is not None else None,
        "restarts": 0,
    }
    return Completed(message=f"skipped: {unchanged.reason}", data=summary)


def _dataset_note(prepared: PreparedDataset | None) -> str:
    return "" if prepared is None else f" Dataset `{prepared.dataset_dir}` (cache hit: {prepared.cache_hit})."


def _baselines(gate_metric: str | None, metrics: dict[str, float]) -> dict[str, Any]:
    """The baselines' test metrics and the line that compares them with the model's (``comparison``): on the gate
    metric that decided, and on ROC AUC where there is one."""
    names = [name for name in (gate_metric, "test_roc_auc") if name]
    return {
        "comparison": comparison(metrics, list(dict.fromkeys(names))),
        "trivial": baseline_values(metrics, TRIVIAL),
        "reference": baseline_values(metrics, REFERENCE),
    }


def _tag_preempted(tracking_uri: str, run_id: str, run_dir: Path) -> None:
    """Ranks that saved and stopped (RUN_DIR/preempted.json): ddpflow.preempted=true and where, on the MLflow run."""
    record = read_preempted(run_dir)
    if record is None:
        return
    try:
        tag_run(tracking_uri, run_id, preempted_tags(record))
    except Exception as error:  # the tracking store must not replace the interruption
        get_run_logger().warning("could not tag MLflow run %s as preempted: %s", run_id, error)


def _say_how_to_resume(error: BaseException, run_dir: Path, logger: Any) -> None:
    """A note on the error (`ddpflow run` prints it) and, for the UI and the log file, a line in the flow run's log."""
    try:
        epoch = resume_epoch(run_dir)
        preempted = read_preempted(run_dir)
    except Exception:  # reading the run directory must not replace the interruption
        return
    if epoch is None and preempted is not None and preempted.get("script"):  # a training script saved its own
        hint = f"re-run the same command to resume from what the script saved in {preempted.get('checkpoint')}"
        error.add_note(f"{hint} (run directory {run_dir})")
        logger.warning("Stopped: %s (run directory %s)", hint, run_dir, extra={LOG_ONLY: True})
        return
    if epoch is None:
        return
    at = f"epoch {epoch}"
    if preempted is not None and preempted.get("step") and int(preempted.get("epoch", -1)) + 1 == epoch:
        at += f", step {preempted['step']}"  # the checkpoint the ranks saved when they were preempted
    hint = f"re-run the same command to resume from {at} (run directory {run_dir})"
    error.add_note(hint)
    logger.warning("Stopped: %s", hint, extra={LOG_ONLY: True})  # the console has the command's own line


def _warm_start_weights(config: PipelineConfig, run_dir: Path, logger: Any) -> str | None:
    """``train.init_from``: 'champion' (the registry alias) or a model.pt path; None: fresh start.

    The champion's model.pt is downloaded into RUN_DIR/init/, so the run keeps
    what it started from. A different architecture is not an error: the ranks
    say so in the log and start from fresh weights.
    """
    if config.train.init_from is None:
        return None
    if config.train.init_from != "champion":
        return config.train.init_from
    checkpoint = champion_checkpoint(config, destination=run_dir / "init")
    if checkpoint is None:
        logger.warning(
            "train.init_from=champion, but %r has no champion yet: starting from fresh weights",
            config.registry.model_name,
        )
        return None
    logger.info("Warm start from the champion's weights: %s", checkpoint)
    return str(checkpoint)


def _prefect_context() -> dict[str, Any]:
    return {
        "flow_run_id": flow_run.id,
        "flow_run_name": flow_run.name,
        "flow_run_url": flow_run.ui_url,
        "deployment_name": deployment.name,
        "deployment_id": deployment.id,
    }


def _ddp_params(config: PipelineConfig, layout: RankLayout) -> dict[str, Any]:
    """The layout the launch will use ('auto' resolved by training/core/topology.py), for the run's ddp.* tags."""
    train = config.train
    return {
        "nproc_per_node": layout.nproc_per_node,
        "nnodes": layout.nnodes,
        "world_size": layout.world_size,
        "backend": layout.backend,
        "max_restarts": train.max_restarts,
    }
