"""The evaluation's figure for the MLflow run: a confusion matrix, or residuals for regression.

``matplotlib.figure.Figure`` directly: no pyplot state, no GUI backend, safe on a worker thread.
"""

from __future__ import annotations

from training.evaluate import EvalResult


def evaluation_figure(result: EvalResult):
    """(the figure, its file name under ``eval/``)."""
    if result.task == "classification":
        return confusion_figure(result), "confusion_matrix.png"
    return residual_figure(result), "residuals.png"


def confusion_figure(result: EvalResult):
    """Counts per (true, predicted) class."""
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
    if len(labels) <= 20:  # beyond that the numbers overlap
        for row, counts in enumerate(result.confusion_matrix):
            for column, count in enumerate(counts):
                axes.text(column, row, str(count), ha="center", va="center", fontsize=8)
    figure.tight_layout()
    return figure


def residual_figure(result: EvalResult):
    """Predicted against (predicted - true), for the rows the evaluation kept."""
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
