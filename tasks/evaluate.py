"""Prefect task: score the trained model on the test split and record it.

The numbers come from ``training/evaluate.py`` (plain code). This task writes
them where people look: ``RUN_DIR/eval/metrics.json``, the MLflow run
(metrics, ``eval/metrics.json``, a confusion-matrix or residual plot) and a
Prefect markdown artifact with a link to the run.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.tracking import how_to_open
from training.config import PipelineConfig
from training.data.manifest import read_manifest
from training.evaluate import EvalResult, evaluate_split
from training.layout import EVAL_METRICS

PLOT_ROWS = 20_000  # residual plot: enough points to see structure, bounded memory


def write_json_atomically(path: Path, payload: dict[str, Any]) -> Path:
    """A reader never sees half a file: temp file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def confusion_figure(result: EvalResult):
    """Counts per (true, predicted) class. ``Figure`` directly: no pyplot state, no GUI backend."""
    from matplotlib.figure import Figure

    labels = result.class_labels or []
    size = max(4.0, 0.6 * len(labels) + 2)
    figure = Figure(figsize=(size, size))
    axes = figure.add_subplot()
    image = axes.imshow(result.confusion_matrix, cmap="Blues")
    figure.colorbar(image, ax=axes)
    axes.set(
        xticks=range(len(labels)),
        yticks=range(len(labels)),
        xlabel="predicted",
        ylabel="true",
        title=f"Confusion matrix ({result.samples} {result.split} rows)",
    )
    axes.set_xticklabels(labels, rotation=45, ha="right")
    axes.set_yticklabels(labels)
    if len(labels) <= 20:
        for row, counts in enumerate(result.confusion_matrix):
            for column, count in enumerate(counts):
                axes.text(column, row, str(count), ha="center", va="center", fontsize=8)
    figure.tight_layout()
    return figure


def residual_figure(result: EvalResult):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4.5))
    axes = figure.add_subplot()
    residuals = result.predictions - result.targets
    axes.scatter(result.predictions, residuals, s=4, alpha=0.4)
    axes.axhline(0.0, color="black", linewidth=0.8)
    axes.set(
        xlabel="predicted",
        ylabel="predicted - true",
        title=f"Residuals (first {len(residuals)} of {result.samples} {result.split} rows)",
    )
    figure.tight_layout()
    return figure


def evaluation_markdown(result: EvalResult, model_path: str, run_link: str) -> str:
    rows = "\n".join(
        f"| {name} | {value:.6g} |"
        for name, value in result.metrics.items()
        if not name.split("_", 1)[1].startswith(("precision_", "recall_"))
    )
    text = f"# Evaluation on {result.samples} {result.split} rows\n\n| metric | value |\n|---|---|\n{rows}\n"
    if result.per_class:
        per_class = "\n".join(
            f"| {label} | {v['precision']:.4f} | {v['recall']:.4f} | {v['support']} |"
            for label, v in result.per_class.items()
        )
        text += f"\n| class | precision | recall | support |\n|---|---|---|---|\n{per_class}\n"
    link = f"[{run_link}]({run_link})" if run_link.startswith("http") else run_link
    return text + f"\nModel: `{model_path}`\n\nMLflow: {link}\n"


def log_evaluation(client: MlflowClient, run_id: str, result: EvalResult, metrics_path: Path) -> None:
    client.log_batch(run_id, metrics=[Metric(name, value, _now_ms(), 0) for name, value in result.metrics.items()])
    client.log_artifact(run_id, str(metrics_path), "eval")
    figure = confusion_figure(result) if result.task == "classification" else residual_figure(result)
    client.log_figure(
        run_id, figure, "eval/confusion_matrix.png" if result.task == "classification" else "eval/residuals.png"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


@task(name="evaluate-model", task_run_name="evaluate-{run_id}", cache_policy=NO_CACHE)  # logs to MLflow: never skip
def evaluate_model(
    model_path: str, dataset_dir: str, run_id: str, tracking_uri: str, config: PipelineConfig
) -> dict[str, float]:
    """Test-split metrics (``test_accuracy``, ``test_rmse``, ...), logged to the MLflow run; returns them."""
    logger = get_run_logger()
    model_path = str(model_path)
    # Per-row predictions only for the residual plot; a confusion matrix is counted on the fly.
    regression = read_manifest(dataset_dir).task == "regression"
    result = evaluate_split(
        model_path,
        dataset_dir,
        "test",
        config.eval.batch_size,
        return_predictions=regression,
        max_predictions=PLOT_ROWS,
    )
    metrics_path = write_json_atomically(
        Path(model_path).parent / EVAL_METRICS, result.to_dict()
    )  # RUN_DIR/eval/metrics.json
    client = MlflowClient(tracking_uri=tracking_uri)
    log_evaluation(client, run_id, result, metrics_path)
    # What `ddpflow register --run-id` needs to re-run the gate for this run later.
    client.set_tag(run_id, "ddpflow.model_path", str(Path(model_path).resolve()))
    client.set_tag(
        run_id,
        "ddpflow.dataset_dir",
        str(Path(dataset_dir).resolve()) if "://" not in str(dataset_dir) else str(dataset_dir),
    )
    run_link = how_to_open(tracking_uri, run_id)
    create_markdown_artifact(
        markdown=evaluation_markdown(result, model_path, run_link),
        key="model-evaluation",
        description=f"Test metrics of MLflow run {run_id}",
    )
    nan = [name for name, value in result.metrics.items() if math.isnan(value)]
    if nan:
        logger.warning("metrics %s are NaN: registration will reject this model", nan)
    logger.info(
        "Evaluated %s on %d test rows in %.2fs: %s", model_path, result.samples, result.seconds, _headline(result)
    )
    return result.metrics


def _headline(result: EvalResult) -> str:
    names = (
        ("test_accuracy", "test_macro_f1", "test_loss")
        if result.task == "classification"
        else ("test_rmse", "test_mae", "test_r2")
    )
    return ", ".join(f"{name}={result.metrics[name]:.4f}" for name in names)
