"""Drift of a text input (report.py calls it for each text input both datasets have).

From prepare's train-split statistics (training/kinds/text.py: ``text_drift_stats``), three entries:
- ``<name>:length``: PSI over the tokens-per-row distribution (its bins grouped into about equal shares of the
  reference, as a numeric feature's are); mean shift of the mean length in units of the reference's std;
- ``<name>:words``: PSI over word frequencies (the reference's most frequent words, the rest as "other", an
  "unseen" bucket for words it never had); ``reference_mean`` / ``current_mean`` are the out-of-vocabulary rates,
  the share of word occurrences outside the reference's most frequent words (the current data against the
  champion's, the champion's against itself), ``mean_shift`` their difference;
- ``<name>:unknown_tokens``: where both datasets used the same tokenizer (a user's tokenizer.json): the
  unknown-token rates, ``mean_shift`` their difference, PSI 0. A tokenizer fitted on each dataset's own train
  split knows its own data, so its rate says nothing about drift and is left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpflow.drift.psi import DRIFT_GROUPS, FeatureDrift, category_psi, equal_share_groups, population_stability_index


def text_drift(name: str, reference: dict[str, Any], current: dict[str, Any]) -> list[FeatureDrift]:
    before, after = _padded(reference["lengths"], current["lengths"])
    entries = []
    if before.sum() > 0 and after.sum() > 0:
        group = equal_share_groups(before, DRIFT_GROUPS)
        psi = population_stability_index(np.bincount(group, weights=before), np.bincount(group, weights=after))
        mean_before, std_before = _mean_std(before)
        mean_after, _ = _mean_std(after)
        shift = (mean_after - mean_before) / (std_before or 1.0)
        entries.append(FeatureDrift(f"{name}:length", psi, shift, mean_before, mean_after))
    if reference["counts"] and current["counts"]:
        oov_before = reference["other"] / max(1, sum(reference["counts"].values()) + reference["other"])
        oov_after = out_of_vocabulary_rate(reference, current)
        psi = category_psi(reference, current)
        entries.append(FeatureDrift(f"{name}:words", psi, oov_after - oov_before, oov_before, oov_after))
    if reference.get("tokenizer_sha256") == current.get("tokenizer_sha256"):
        rate_before, rate_after = _unknown_rate(reference), _unknown_rate(current)
        entries.append(FeatureDrift(f"{name}:unknown_tokens", 0.0, rate_after - rate_before, rate_before, rate_after))
    return entries


def out_of_vocabulary_rate(reference: dict[str, Any], current: dict[str, Any]) -> float:
    """The share of ``current``'s word occurrences that are not among the reference's most frequent words."""
    known = reference["counts"]
    total = sum(current["counts"].values()) + current["other"]
    inside = sum(count for word, count in current["counts"].items() if word in known)
    return (total - inside) / total if total else 0.0


def _padded(first: list[int], second: list[int]) -> tuple[np.ndarray, np.ndarray]:
    size = max(len(first), len(second))
    return (np.pad(np.asarray(a, dtype=np.float64), (0, size - len(a))) for a in (first, second))


def _mean_std(counts: np.ndarray) -> tuple[float, float]:
    lengths = np.arange(len(counts))
    mean = float((counts * lengths).sum() / counts.sum())
    return mean, float(np.sqrt((counts * (lengths - mean) ** 2).sum() / counts.sum()))


def _unknown_rate(stats: dict[str, Any]) -> float:
    return stats["unknown"] / stats["tokens"] if stats["tokens"] else 0.0
