"""Whether a higher value of a metric is better: the one rule the champion gate (``registry.metric``,
ddpflow/tracking/gate.py) and model selection (a validation monitor) infer a direction by.

A metric is named ``<split>_<kind>[_<class label>]`` (``test_accuracy``, ``val_log_loss``,
``test_recall_cat``). The kind decides, not any word in the name: ``test_precision_error`` is the
precision of a class called "error" (higher is better), and ``val_log_loss`` a loss (lower).
Kinds not listed here (a user objective's metrics) fall back to the words that mean a cost.

Imports nothing heavy: training/config.py uses it.
"""

from __future__ import annotations

SPLITS = ("train", "val", "test", "gate_candidate", "gate_champion")
HIGHER_IS_BETTER = (
    "accuracy", "top5_accuracy", "macro_f1", "micro_f1", "f1", "roc_auc", "pr_auc", "auc", "r2", "precision", "recall",
    "exact_match", "token_accuracy",
)  # fmt: skip
LOWER_IS_BETTER = ("loss", "log_loss", "rmse", "mse", "mae", "huber", "error", "perplexity")
COST_WORDS = ("loss", "rmse", "mse", "mae", "error")


def higher_is_better(metric: str) -> bool:
    """True for accuracy, F1, AUC, R², precision, recall...; False for losses and errors (module docstring)."""
    kind = metric
    for split in SPLITS:
        if metric.startswith(split + "_"):
            kind = metric[len(split) + 1 :]
            break
    # Longest kind first: "log_loss" before "loss", "top5_accuracy" before "accuracy".
    for known in sorted(HIGHER_IS_BETTER + LOWER_IS_BETTER, key=len, reverse=True):
        if kind == known or kind.startswith(known + "_"):
            return known in HIGHER_IS_BETTER
    return not any(word in kind for word in COST_WORDS)
