"""The time split, ``data.split: {by: time, column, val, test}``: the newest rows go to test, the ones before them
to val, the rest to train, so a model is judged on the rows after those it learnt from, as it will be used.

Each row's time is ``column``'s value read as ``training/kinds/times.py: wall_clock`` reads it (the wall-clock time
in the column's own zone: a zoned timestamp in its zone, a naive one, a date or an ISO string as it shows, a
string with an offset in UTC), and compared with two cut-offs:

    test:  time >= test_from          val:  val_from <= time < test_from          train:  time < val_from

A cut-off is given (an ISO-8601 date or time: midnight of a date; read in the column's zone unless it names an
offset) or, for a fraction, the time at that quantile of the source's rows: ``test: 0.1`` makes test_from the
time of the row at position ceil(0.9 n) of the n rows sorted by time, so test holds the newest tenth of the rows
(more where rows share the cut-off's time: a time's rows stay together, in the newer split). Quantiles of rows
rather than of the time range, so that a few rows far in the future or past cannot empty a split; they cost one
pass over the column before the rows are written, holding 8 bytes a row. The cut-offs are in the manifest
(``extra["split"]``). Rows added later with newer times land in the newest split: past a given cut-off, or at
the top of the sorted times that a fraction's cut-off is taken from.

A column that is missing, that holds no times, a null in it or a string that is not a time: a ``DataError`` that
names the file and the column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from training.core.config import DataConfig
from training.core.errors import DataError
from training.kinds.times import EXAMPLES, takes_time, wall_clock, zone_of
from training.prepare.split import TEST, TRAIN, VAL

NEVER = np.iinfo(np.int64).max  # a cut-off no time reaches: an empty split


def splits_by_time(data: DataConfig) -> bool:
    return data.split is not None and data.split.by == "time"


@dataclass(frozen=True)
class TimeSplit:
    """The two cut-offs (wall-clock microseconds in ``zone``) and how each row's time is read."""

    column: str
    zone: str | None
    val_from: int
    test_from: int
    given: dict[str, Any]  # data.split as the config gave it, the fractions filled in

    def codes(self, file: str, column: pa.Array) -> np.ndarray:
        """TRAIN/VAL/TEST per row of a read batch; DataError naming ``file`` for a null or a string that is no time."""
        times = _times(file, self.column, column, self.zone)
        codes = np.full(len(times), TRAIN, dtype=np.int8)
        codes[times >= self.val_from] = VAL
        codes[times >= self.test_from] = TEST
        return codes

    def describe(self) -> dict[str, Any]:
        """What the manifest records (``extra["split"]``): the rule as given and the cut-offs it came to."""
        return {**self.given, "zone": self.zone, "val_from": _text(self.val_from), "test_from": _text(self.test_from)}

    def rule(self) -> str:
        """One line for an error: the rule and its cut-offs."""
        return (
            f"data.split by time on {self.column!r}: val from {_text(self.val_from)}, test from {_text(self.test_from)}"
        )


def plan_time_split(source, data: DataConfig) -> TimeSplit:
    """The cut-offs of ``data.split`` over ``source`` (``training/prepare/sources.py``); a fraction's from one pass
    over the column (module docstring). DataError naming the source or file and the column."""
    spec, where = data.split, source.description
    if spec.column not in source.schema.names:
        raise DataError(
            f"{where}: split column {spec.column!r} (data.split.column) not found; the columns are "
            f"{source.schema.names}"
        )
    kind = source.schema.field(spec.column).type
    if not takes_time(kind):
        raise DataError(
            f"{where}: split column {spec.column!r} (data.split.column) has type {kind}, not a time: a time split "
            f"takes a timestamp, a date or ISO-8601 strings ({EXAMPLES})"
        )
    zone = zone_of(kind)
    val = spec.val if spec.val is not None else data.val_fraction
    test = spec.test if spec.test is not None else data.test_fraction
    given = {"by": "time", "column": spec.column, "val": val, "test": test}
    dates = isinstance(val, str) and isinstance(test, str)
    times = None if dates else _sorted_times(source, spec.column, zone, data.read_batch_rows)
    test_from = _given(test, zone) if isinstance(test, str) else _at(times, 1.0 - test, test > 0)
    if isinstance(val, str):
        val_from = _given(val, zone)
        if val_from > test_from:
            raise DataError(
                f"{where}: data.split.val {val!r} is after the test cut-off {_text(test_from)} (data.split.test "
                f"{test!r}): val holds the rows before test"
            )
    else:  # the val share of all rows, just before the first test row
        first_test = len(times) if test_from == NEVER else int(np.searchsorted(times, test_from))
        val_from = _at(times, (first_test - val * len(times)) / max(len(times), 1), val > 0, before=test_from)
    return TimeSplit(spec.column, zone, val_from, test_from, given)


def _given(text: str, zone: str | None) -> int:
    """A cut-off given as ISO text: its wall-clock time in the column's zone (converted there if it names one)."""
    return int(wall_clock(pa.array([text.strip()]), zone)[0][0])


def _at(times: np.ndarray, share: float, some: bool, before: int = NEVER) -> int:
    """The time at ``share`` of the sorted ``times`` (position ceil(share * n)); ``before`` when ``some`` is false
    (a fraction of 0: no row) or the position is past the rows."""
    position = max(0, math.ceil(share * len(times)))
    return int(times[position]) if some and position < len(times) and times[position] < before else before


def _sorted_times(source, column: str, zone: str | None, batch_rows: int) -> np.ndarray:
    """Every row's time (int64 microseconds, wall clock), sorted: 8 bytes a row."""
    parts = [_times(file, column, batch.column(0), zone) for file, batch in source.iter_batches([column], batch_rows)]
    return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)


def _times(file: str, column: str, values: pa.Array, zone: str | None) -> np.ndarray:
    micros, present, bad = wall_clock(values, zone)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{file}: split column {column!r} (data.split.column) holds {values[first].as_py()!r}, not an ISO-8601 "
            f"date or time ({EXAMPLES})"
        )
    if not present.all():
        raise DataError(
            f"{file}: split column {column!r} (data.split.column) holds {int((~present).sum())} null(s) in one read "
            "batch; a time split needs each row's time: fill them, drop those rows, or split by hash (no data.split)"
        )
    return micros


def _text(micros: int) -> str | None:
    """A cut-off as ISO text (wall clock); None for NEVER."""
    return None if micros == NEVER else str(np.datetime64(micros, "us"))
