"""Prefect task: score the trained model on the test split and record it.

The numbers come from ``training/inference/evaluate.py``; the MLflow run gets them through
``ddpflow/tracking/runs.py: log_evaluation`` (metrics, ``eval/metrics.json``, a
confusion-matrix or residual plot, where the model and data are). This task
writes ``RUN_DIR/eval/metrics.json`` and a Prefect markdown artifact with a link
to the run. Beside the model, the baselines (``training/inference/baselines.py``: the train
prior or mean, and the HistGradientBoosting reference for tables) are scored on the
same test rows here, in this process, never in the ranks. The reference's fit needs the prepared data only, so
``fit_reference_model`` makes it beside the train task and this task scores it.
"""

from __future__ import annotations

import math
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ddpflow.tracking.runs import how_to_open, log_evaluation
from training.core.config import PipelineConfig
from training.core.fileio import atomic_write_json
from training.core.layout import EVAL_METRICS
from training.core.manifest import read_manifest
from training.inference.baselines import Baselines, evaluate_baselines
from training.inference.evaluate import evaluate_split
from training.inference.model_file import EvalResult
from training.inference.reference import FittedReference, fit_before_scoring
from training.objectives.registry import evaluation_of

PLOT_ROWS = 20_000  # residual plot: enough points to see structure, bounded memory


def evaluation_markdown(result: EvalResult, model_path: str, run_link: str, baselines: Baselines | None = None) -> str:
    """The Prefect UI's view of the evaluation: headline metrics beside the baselines', per-class table, link to
    the MLflow run."""
    baselines = baselines or Baselines()
    trivial, reference = baselines.trivial or {}, baselines.reference or {}

    def cell(values: dict[str, float], name: str) -> str:
        return f"{values[name]:.6g}" if name in values else "—"

    rows = "\n".join(
        f"| {name} | {value:.6g} | {cell(reference, name)} | {cell(trivial, name)} |"
        for name, value in result.metrics.items()
        if not name.split("_", 1)[1].startswith(("precision_", "recall_"))
    )
    text = (
        f"# Evaluation on {result.samples} {result.split} rows\n\n"
        "| metric | model | reference (HistGradientBoosting) | trivial (train prior or mean) |\n"
        f"|---|---|---|---|\n{rows}\n"
    )
    if baselines.notes:
        text += "\n" + "".join(f"- {note}\n" for note in baselines.notes)
    if result.per_class:
        per_class = "\n".join(
            f"| {label} | {v['precision']:.4f} | {v['recall']:.4f} | {v['support']} |"
            for label, v in result.per_class.items()
        )
        text += f"\n| class | precision | recall | support |\n|---|---|---|---|\n{per_class}\n"
    link = f"[{run_link}]({run_link})" if run_link.startswith("http") else run_link
    return text + f"\nModel: `{model_path}`\n\nMLflow: {link}\n"


@task(name="fit-reference", cache_policy=NO_CACHE)
def fit_reference_model(dataset_dir: str, config: PipelineConfig) -> FittedReference | None:
    """The reference model (HistGradientBoosting on the train split, ``eval.reference``) fitted while the candidate
    trains: it reads the prepared data only. None where it is off or does not apply; a failed fit carries its error
    to the evaluation, which names it (a baseline never fails a run). The evaluate task logs what the fit took."""
    if not config.eval.reference:
        return None
    return fit_before_scoring(read_manifest(dataset_dir), dataset_dir, config.eval.reference_max_rows)


@task(name="evaluate-model", task_run_name="evaluate-{run_id}", cache_policy=NO_CACHE)  # logs to MLflow: never skip
def evaluate_model(
    model_path: str,
    dataset_dir: str,
    run_id: str,
    tracking_uri: str,
    config: PipelineConfig,
    reference: FittedReference | None = None,
) -> dict[str, float]:
    """Test-split metrics (``test_accuracy``, ``test_rmse``, ...) and the baselines' on the same rows
    (``baseline_trivial/test_accuracy``, ``baseline_reference/...``: training/inference/baselines.py), logged
    to the MLflow run; returns them. ``reference``: ``fit_reference_model``'s fit, scored here (None: fitted here,
    where ``eval.reference`` asks for one)."""
    logger = get_run_logger()
    model_path = str(model_path)
    # Per-row predictions only for a figure that draws them (residuals, row losses); a confusion matrix is counted
    # on the fly. What the objective's evaluation is: training/objectives/base.py ``Evaluation``.
    manifest = read_manifest(dataset_dir)
    evaluation = evaluation_of(config.train, manifest.task, manifest.n_classes)
    result = evaluate_split(
        model_path,
        dataset_dir,
        "test",
        config.eval.batch_size,
        return_predictions=evaluation.keeps_predictions,
        max_predictions=PLOT_ROWS,
    )
    if evaluation.note:
        logger.info("%s: %s", config.train.objective, evaluation.note.format(samples=result.samples, **result.metrics))
    baselines = evaluate_baselines(
        model_path, dataset_dir, "test", config.eval.reference, config.eval.reference_max_rows, logger, reference
    )
    metrics_path = atomic_write_json(
        Path(model_path).parent / EVAL_METRICS, {**result.to_dict(), "baselines": baselines.metrics()}
    )
    log_evaluation(tracking_uri, run_id, result, metrics_path, model_path, dataset_dir, baselines.metrics())
    create_markdown_artifact(
        markdown=evaluation_markdown(result, model_path, how_to_open(tracking_uri, run_id), baselines),
        key="model-evaluation",
        description=f"Test metrics of MLflow run {run_id}",
    )
    nan = [name for name, value in result.metrics.items() if math.isnan(value)]
    if nan:
        logger.warning("metrics %s are NaN: registration will reject this model", nan)
    headline = _headline(result, evaluation.headline)
    logger.info("Evaluated %s on %d test rows in %.2fs: %s", model_path, result.samples, result.seconds, headline)
    return {**result.metrics, **baselines.metrics()}


def _headline(result: EvalResult, headline: tuple[str, ...]) -> str:
    names = [name for name in headline if name in result.metrics]
    return ", ".join(f"{name}={result.metrics[name]:.4f}" for name in names)
