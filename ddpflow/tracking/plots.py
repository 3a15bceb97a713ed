"""The MLflow run's figures: the evaluation's (a confusion matrix, or residuals for regression; misclassified
images), data drift, and a sweep's objective against each parameter.

``matplotlib.figure.Figure`` directly: no pyplot state, no GUI backend, safe on a worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from training.inference.evaluate import CONFUSION_MAX_CLASSES
from training.inference.model_file import EvalResult

if TYPE_CHECKING:
    from ddpflow.drift.report import DriftReport

DRIFT_FEATURES_SHOWN = 30  # beyond this the labels are unreadable; the report JSON has them all


def evaluation_figure(result: EvalResult):
    """(the figure, its file name under ``eval/``): a confusion matrix up to ``CONFUSION_MAX_CLASSES`` classes
    (training/inference/evaluate.py), above that the per-class recall (a C x C matrix neither fits in memory nor reads);
    or the figure the model's objective names (``result.figure``: ``FIGURES``, e.g. a language model's rows by
    their loss per target token, as it has no label per row)."""
    if result.figure is not None:
        return FIGURES[result.figure](result), f"{result.figure}.png"
    if result.task == "multilabel":  # labels are not exclusive: no confusion matrix, each label's recall
        return per_class_recall_figure(result), "per_label_recall.png"
    if result.task == "classification":
        if result.confusion_matrix is None:
            return per_class_recall_figure(result), "per_class_recall.png"
        return confusion_figure(result), "confusion_matrix.png"
    return residual_figure(result), "residuals.png"


def per_class_recall_figure(result: EvalResult):
    """The classes of lowest recall (where the model fails), each with its support; all are in eval/metrics.json."""
    from matplotlib.figure import Figure

    classes = sorted(result.per_class.items(), key=lambda item: (item[1]["recall"], item[0]))[:DRIFT_FEATURES_SHOWN]
    if result.task == "multilabel":
        kind, why = "labels", "a row may hold several labels, so no confusion matrix is drawn"
    else:
        kind, why = "classes", f"above {CONFUSION_MAX_CLASSES} classes no confusion matrix is drawn"
    rows = list(range(len(classes)))
    figure = Figure(figsize=(8, max(3.2, 0.3 * len(classes) + 2.0)))
    axes = figure.add_subplot()
    axes.barh(rows, [values["recall"] for _, values in classes], color="tab:blue")
    axes.set(
        yticks=rows,
        xlim=(0, 1),
        xlabel="recall",
        title=f"Lowest recall of {len(result.per_class)} {kind} ({result.samples} {result.split} rows): "
        f"{why}; every one is in eval/metrics.json",
    )
    axes.set_yticklabels([f"{label} (n={values['support']})" for label, values in classes])
    axes.invert_yaxis()
    axes.title.set_fontsize(8)
    figure.tight_layout()
    return figure


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


def misclassified_figure(result: EvalResult):
    """A grid of misclassified test images (training/inference/evaluate.py keeps the first few), each titled
    "true -> predicted"; None when there are none to show."""
    import io

    from matplotlib.figure import Figure
    from PIL import Image

    shown = result.misclassified or []
    if not shown:
        return None
    columns = min(4, len(shown))
    rows = -(-len(shown) // columns)
    figure = Figure(figsize=(2.2 * columns, 2.4 * rows))
    for index, row in enumerate(shown):
        axes = figure.add_subplot(rows, columns, index + 1)
        with Image.open(io.BytesIO(row["bytes"])) as image:
            axes.imshow(image.convert("RGB"))
        axes.set_title(f"{row['true']} -> {row['predicted']}", fontsize=8)
        axes.axis("off")
    figure.suptitle(f"Misclassified {result.split} images (true -> predicted), first {len(shown)}", fontsize=9)
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


def row_loss_figure(result: EvalResult):
    """A language model: how many test rows score each mean loss per target token (the served ``loss``: how
    surprising a row is), for the rows the evaluation kept that have a target; the split's test_loss marked."""
    import numpy as np
    from matplotlib.figure import Figure

    kept = 0 if result.targets is None else len(result.targets)
    losses = result.predictions[result.targets > 0] if kept else np.empty(0)
    figure = Figure(figsize=(6, 4.5))
    axes = figure.add_subplot()
    axes.hist(losses, bins=min(50, max(1, len(losses))), color="tab:blue")
    loss = result.metrics.get(f"{result.split}_loss", float("nan"))
    if np.isfinite(loss):
        axes.axvline(loss, color="black", linestyle="--", linewidth=1, label=f"{result.split}_loss {loss:.3g}")
        axes.legend(fontsize=8)
    axes.set(
        xlabel="mean cross entropy per target token (a row's served loss)",
        ylabel="rows",
        title=f"Rows by loss per target token: {len(losses)} with a target, of the first {kept} of "
        f"{result.samples} {result.split} rows",
    )
    axes.title.set_fontsize(9)
    figure.tight_layout()
    return figure


FIGURES = {"row_loss": row_loss_figure}  # an objective's own figure (training/objectives/base.py: Evaluation.figure)


def drift_figure(report: DriftReport, reference: str, max_psi: float | None = None):
    """Per feature, most drifted on top: PSI (the worst in red) and the standardised mean shift.

    ``reference`` names what the data is compared with ("champion v3's training data");
    ``max_psi`` (``registry.max_drift_psi``) is drawn as a line when set.
    """
    from matplotlib.figure import Figure

    shown = report.features[:DRIFT_FEATURES_SHOWN]
    rows = list(range(len(shown)))
    figure = Figure(figsize=(11, max(3.2, 0.34 * len(shown) + 2.0)))
    psi_axes, shift_axes = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    colours = ["tab:red" if i == 0 else "tab:blue" for i in rows]  # the worst feature stands out
    psi_values = [drift.psi for drift in shown]
    psi_axes.barh(rows, psi_values, color=colours)
    for row, value in zip(rows, psi_values):
        psi_axes.annotate(
            f"{value:.3f}", (value, row), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
        )
    psi_axes.set(yticks=rows, xlabel="population stability index (PSI)", title="PSI against the reference's deciles")
    psi_axes.set_yticklabels([drift.feature for drift in shown])
    psi_axes.invert_yaxis()  # most drifted on top
    psi_axes.set_xlim(0, max(max(psi_values), max_psi or 0) * 1.15 or 1.0)
    if max_psi is not None:
        psi_axes.axvline(
            max_psi, color="black", linestyle="--", linewidth=1, label=f"registry.max_drift_psi = {max_psi:g}"
        )
        psi_axes.legend(loc="lower right", fontsize=8)
    shift_axes.barh(rows, [drift.mean_shift for drift in shown], color=colours)
    shift_axes.axvline(0.0, color="black", linewidth=0.8)
    shift_axes.set(xlabel="(this mean - reference mean) / reference std", title="mean shift")
    more = (
        f"; the {len(shown)} most drifted of {len(report.features)} features"
        if len(report.features) > len(shown)
        else ""
    )
    figure.suptitle(
        f"Data drift of train split {report.current_fingerprint} from {reference} "
        f"({report.reference_fingerprint}){more}",
        fontsize=10,
    )
    figure.tight_layout()
    return figure


def sweep_figure(rows: list[dict[str, Any]], keys: list[str], objective: str, log_keys: tuple[str, ...] = ()):
    """A sweep's objective against each tuned parameter, one panel per key: complete trials as dots (the best
    one ringed), pruned ones as crosses at the last value reported; failed trials have no value to draw.
    ``rows``: ``ddpflow/sweep/trials.py: trial_rows``."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.2 * max(1, len(keys)), 3.8))
    axes_row = figure.subplots(1, max(1, len(keys)), squeeze=False)[0]
    best = next((row for row in rows if row.get("best")), None)
    for axes, key in zip(axes_row, keys):
        for state, marker, colour in (("complete", "o", "tab:blue"), ("pruned", "x", "tab:orange")):
            points = [
                (_plottable(row[key]), row["value"])
                for row in rows
                if row["state"] == state and row["value"] is not None
            ]
            if points:
                axes.scatter(*zip(*points), marker=marker, color=colour, label=state)
        if best is not None:
            axes.scatter([_plottable(best[key])], [best["value"]], s=160, facecolors="none", edgecolors="tab:red",
                         label=f"best (trial {best['trial']})")  # fmt: skip
        if key in log_keys:
            axes.set_xscale("log")
        axes.set(xlabel=key, ylabel=objective)
        axes.legend(fontsize=7)
    failed = sum(row["state"] == "failed" for row in rows)
    figure.suptitle(f"{objective} of {len(rows)} trials ({failed} failed, not drawn)", fontsize=10)
    figure.tight_layout()
    return figure


def _plottable(value: Any) -> Any:
    """A number as itself; a choice such as [256, 256] as its text (a categorical axis)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
