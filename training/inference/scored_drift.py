"""The drift statistics of a batch scoring's table, per input, by the same measures prepare keeps for a train split.

    tally = DriftTally(codecs)                    # a scoring rank, one per part file
    tally.update(scored_rows)                     # each batch's rows the model scored
    writer.add_key_value_metadata(tally.metadata())
    profile = scored_profile(output, manifest["files"], inputs)   # after the run: the parts' tallies merged

Each input's kind keeps its own (``Codec.scored_drift_stats``, ``merge_drift_stats``, ``reported_drift_stats``:
a numeric input's running moments and dyadic histogram, a categorical's value counts, a vector's dimension
moments, an image's width, height and brightness histograms, a text's lengths and words; a hashed id none). A
rank tallies the rows it scores, as it scores them, into each part file's footer (``ddpflow.drift``): a resumed
scoring keeps the tallies of the parts it finished, and nothing reads the source a second time. Rows the model
refused (``rejects/``) are not in them, as prepare leaves invalid rows out of a train split's.

``scored_profile`` merges the parts' tallies into what ddpflow/drift/report.py compares with the model's
training data (the manifest's names: ``features``, ``feature_mean``, ``feature_std``, ``feature_histograms`` for
the numeric inputs, ``drift_stats["inputs"]`` for the others), so the PSI is the retraining flow's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from training.kinds.base import Codec
from training.kinds.inputs import InputInfo, numeric_names
from training.kinds.registry import kind_record

DRIFT_KEY = "ddpflow.drift"  # a part file's footer: its rows' drift statistics, JSON, by input


class NoDriftStatistics(ValueError):
    """A part of the output holds no drift statistics (a part written without them)."""


class DriftTally:
    """One part's drift statistics, merged batch by batch."""

    def __init__(self, codecs: dict[str, Codec]):
        self.codecs = codecs
        self.stats: dict[str, dict[str, Any]] = {}

    def update(self, rows: pa.RecordBatch | pa.Table) -> None:
        if not rows.num_rows:
            return
        for name, codec in self.codecs.items():
            stats = codec.scored_drift_stats(rows.column(name))
            if stats is not None:
                before = self.stats.get(name)
                self.stats[name] = stats if before is None else codec.merge_drift_stats(before, stats)

    def metadata(self) -> dict[str, str]:
        return {DRIFT_KEY: json.dumps(self.stats)}


def scored_profile(output: str | Path, files: list[str], inputs: dict[str, InputInfo]) -> dict[str, Any]:
    """The parts' statistics merged: ``{"features", "feature_mean", "feature_std", "feature_histograms",
    "drift_stats": {"inputs": ...}}``; NoDriftStatistics naming a part that holds none."""
    merged: dict[str, dict[str, Any]] = {}
    for name in files:
        path = Path(output) / name
        footer = pq.read_metadata(path)
        raw = (footer.metadata or {}).get(DRIFT_KEY.encode())
        if raw is None:
            raise NoDriftStatistics(f"{path} holds no drift statistics (scored by an older ddpflow)")
        for column, stats in json.loads(raw).items():
            record = kind_record(inputs[column].kind)
            merged[column] = record.merge_drift_stats(merged[column], stats) if column in merged else stats
    reported = {column: kind_record(inputs[column].kind).reported_drift_stats(s) for column, s in merged.items()}
    numeric = [column for column in numeric_names(inputs) if column in reported]
    return {
        "features": numeric,
        "feature_mean": [reported[column]["mean"] for column in numeric],
        "feature_std": [reported[column]["std"] for column in numeric],
        "feature_histograms": [reported[column]["histogram"] for column in numeric],
        "drift_stats": {"inputs": {column: s for column, s in reported.items() if column not in numeric}},
    }
