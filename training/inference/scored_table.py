"""What a finished batch scoring tells about its table (read back, memory flat; no rank, no MLflow):

- ``score_distribution``: the scores' distribution, from the output's part files (score columns only): per class the
  share of rows predicted and the mean probability, or a regression's mean, std and quantiles;
- ``numeric_profile``: each numeric input's mean, std and histogram over the source, the same running statistics
  prepare keeps for the train split (``training/kinds/stats.py``), so drift compares the scored table with the
  champion's training data by the same PSI (``ddpflow/tracking/scoring.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.inference.batch_scoring import PREDICTION, iter_parts, open_scoring_source
from training.kinds.stats import RunningHistogram, RunningMoments

QUANTILES = (0.05, 0.5, 0.95)


def score_distribution(output: str | Path, task: str) -> dict[str, float]:
    """Flat metrics: ``score_share_<label>`` and ``score_mean_probability_<label>`` (classification), else
    ``score_mean``, ``score_std`` and ``score_p5/p50/p95`` (regression)."""
    parts = list(iter_parts(output))
    if not parts:
        return {}
    if task == "regression":
        values = np.concatenate([pq.read_table(p, columns=[PREDICTION])[PREDICTION].to_numpy() for p in parts])
        if not len(values):
            return {}
        quantiles = dict(zip(QUANTILES, np.quantile(values, QUANTILES), strict=True))  # 4 bytes a row, read once
        metrics = {"score_mean": float(values.mean()), "score_std": float(values.std())}
        return metrics | {f"score_p{round(q * 100)}": float(v) for q, v in quantiles.items()}
    counts: dict[str, int] = {}
    sums: dict[str, float] = {}
    rows = 0
    for part in parts:
        table = pq.read_table(part)
        rows += table.num_rows
        if task == "classification":
            for entry in pc.value_counts(table[PREDICTION]).to_pylist():
                counts[str(entry["values"])] = counts.get(str(entry["values"]), 0) + entry["counts"]
        for name in table.column_names:
            if name.startswith("probability_"):
                sums[name] = sums.get(name, 0.0) + float(pc.sum(table[name]).as_py() or 0.0)
    metrics = {f"score_share_{label}": count / rows for label, count in counts.items()} if rows else {}
    metrics |= {f"score_mean_{name}": total / rows for name, total in sums.items()} if rows else {}
    return metrics


def numeric_profile(source: str, file_format: str, names: list[str], batch_rows: int = 131_072) -> dict[str, Any]:
    """{"features", "feature_mean", "feature_std", "feature_histograms", "rows"} of the source's numeric ``names``
    (bools as 0/1, nulls and NaN missing), read in record batches."""
    opened = open_scoring_source(source, file_format)
    moments, histograms, rows = RunningMoments(len(names)), RunningHistogram(len(names)), 0
    for _, batch in opened.iter_batches(names, batch_rows):
        columns = np.stack([_as_float(batch.column(name)) for name in names]) if names else np.empty((0, 0))
        columns[~np.isfinite(columns)] = np.nan  # inf is refused by the model: not a value of the table
        moments.update(columns)
        histograms.update(columns)
        rows += batch.num_rows
    return {"features": names, "feature_mean": [float(v) for v in moments.mean],
            "feature_std": [float(v) or 1.0 for v in moments.std()],
            "feature_histograms": histograms.to_list(), "rows": rows}  # fmt: skip


def _as_float(column) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_boolean(column.type):
        column = pc.cast(column, pa.int8())
    return pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
