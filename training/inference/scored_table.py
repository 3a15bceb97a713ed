"""The scores' distribution of a finished batch scoring, read back from the output's part files (score columns
only; no rank, no MLflow): ``score_distribution``, per class the share of rows predicted and the mean probability,
or a regression's mean, std and quantiles. (Its inputs' drift statistics: ``scored_drift.py``, from the footers.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.inference.batch_scoring import PREDICTION, iter_parts

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
