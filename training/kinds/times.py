"""The datetime kind: timestamp and date columns as the source has them, and the one reading of a time
(``wall_clock``) that the kind's features and the time split (training/prepare/time_split.py) share.

A value is read as its wall-clock time in one zone, ``wall_clock(array, zone)``:
- a timestamp with a time zone (Parquet ``timestamp[.., tz=...]``, pandas ``datetime64[ns, tz]``) is converted
  to ``zone`` (the train column's own zone), else to UTC, and read on that clock;
- a timestamp without a zone, a date (date32/date64) and an ISO-8601 string without an offset are the wall-clock
  time they show;
- an ISO-8601 string with an offset (``Z``, ``+02:00``) is converted like a zoned timestamp; an empty string (a
  blank CSV cell) is a null.

So a model trained on a column in Europe/Oslo reads hour 9 as 09:00 in Oslo, also when a served row brings the
same instant as ``07:00Z``. Features (``DatetimeCodec``, float32 ``[rows, D]``, the built-in model's DENSE block):
the time of day, day of week, day of year (hour is left out for a date column) and month, each as a point on a
circle (sin, cos: December sits next to January), then the time since the train split's earliest value, scaled so
that the train split spans 0..1 (later rows, a time split's val and test, run past 1); a null is a value (the
circle's centre, the train mean time, and a 0/1 missing indicator when the train split held any). The time since
the start carries bins (``InputInfo.bins``, ``bins_column``): the train split's quantiles of it, as a numeric
input's, so the mlp's numeric embeddings take it as they take a numeric input (the level of each
stretch of days, not a trend alone).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.core.errors import DataError
from training.kinds.arrow_types import is_text, value_type
from training.kinds.base import DENSE, NUMBERS, Codec, plain
from training.kinds.inputs import InputInfo
from training.kinds.stats import RunningHistogram, merge_histograms
from training.kinds.tabular import quantile_edges

US_PER_DAY = 86_400_000_000
# An ISO-8601 time with an offset at its end (a date alone, "2024-05-31", has none: its "-31" is the day).
_OFFSET = re.compile(r"\d:\d{2}(?::\d{2}(?:[.,]\d+)?)?\s*(?:[Zz]|[+-]\d{2}(?::?\d{2})?)$")
ISO_DATE = re.compile(r"^\s*\d{4}-\d{2}-\d{2}")  # what a column of strings must start with to read as times
CYCLES = ("hour", "day_of_week", "day_of_year", "month")  # the parts on a circle, in the feature order
DRIFT_MEASURES = ("hour", "day_of_week", "month")  # the histograms drift compares (not the time itself: it moves)
EXAMPLES = "2024-05-31, 2024-05-31T14:30:00, 2024-05-31T14:30:00+02:00"


def is_time(kind: pa.DataType) -> bool:
    """A timestamp (with or without a zone) or a date column."""
    kind = value_type(kind)
    return pa.types.is_timestamp(kind) or pa.types.is_date(kind)


def takes_time(kind: pa.DataType) -> bool:
    """What the datetime kind and the time split take: a time column, or strings (ISO 8601)."""
    return is_time(kind) or is_text(kind)


def zone_of(kind: pa.DataType) -> str | None:
    """A column's own time zone: a zoned timestamp's, else None (its values are wall-clock times)."""
    kind = value_type(kind)
    return kind.tz if pa.types.is_timestamp(kind) else None


def looks_like_times(strings: pa.Array) -> bool:
    """Whether every one of these (non-null) strings is an ISO-8601 date or time: what prepare suggests the
    datetime kind for."""
    values = [value for value in plain(strings).to_pylist() if value is not None]
    return bool(values) and all(ISO_DATE.match(value) for value in values) and not wall_clock(strings, None)[2].any()


def wall_clock(array: pa.Array, zone: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each value's wall-clock time in ``zone`` (module docstring) as int64 microseconds since 1970-01-01, whether
    it is present (not null), and whether it is a string that is not an ISO-8601 date or time (not present)."""
    array = plain(array)
    if is_text(array.type):
        return _parsed(array, zone)
    if pa.types.is_date(array.type):
        array = pc.cast(array, pa.timestamp("us"))
    elif not pa.types.is_timestamp(array.type):
        raise ValueError(f"holds {array.type} values; a datetime input takes timestamps, dates or ISO-8601 strings")
    if array.type.tz is not None:
        array = pc.local_timestamp(pc.cast(array, pa.timestamp(array.type.unit, zone or "UTC")))
    micros = pc.cast(pc.cast(array, pa.timestamp("us"), safe=False), pa.int64())
    present = pc.is_valid(micros).to_numpy(zero_copy_only=False)
    values = pc.fill_null(micros, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return values, present, np.zeros(len(values), dtype=bool)


def _parsed(array: pa.Array, zone: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ISO-8601 strings (module docstring): those with an offset converted to ``zone`` (UTC without one)."""
    import pandas as pd

    text = pd.Series(array.to_numpy(zero_copy_only=False), dtype=object)
    given = (text.notna() & (text.str.strip() != "")).to_numpy()  # a blank CSV cell is a missing time
    offset = text.str.contains(_OFFSET, na=False).to_numpy()
    times = np.zeros(len(text), dtype="datetime64[us]")
    for rows, aware in ((given & ~offset, False), (offset, True)):
        if rows.any():
            parsed = pd.to_datetime(text[rows], format="ISO8601", errors="coerce", utc=aware)
            if aware:
                parsed = parsed.dt.tz_convert(zone or "UTC").dt.tz_localize(None)
            times[rows] = parsed.to_numpy(dtype="datetime64[us]")
    present = given & ~np.isnat(times)
    values = np.where(present, times.view(np.int64), 0)
    return values, present, given & ~present


def cycle_phases(micros: np.ndarray, cycles: tuple[str, ...]) -> np.ndarray:
    """Where each wall-clock time (int64 microseconds) is on each cycle, in [0, 1): ``[len(cycles), rows]``; the
    calendar (day of year, month, leap years) is Arrow's."""
    days = np.floor_divide(micros, US_PER_DAY)
    of_day = (micros - days * US_PER_DAY) / US_PER_DAY
    clock = pa.array(micros, pa.timestamp("us"))

    def calendar(function) -> np.ndarray:
        return function(clock).to_numpy(zero_copy_only=False).astype(np.float64)

    phase = {
        "hour": lambda: of_day,
        "day_of_week": lambda: ((days + 3) % 7 + of_day) / 7,  # 1970-01-01 was a Thursday; Monday starts the week
        "day_of_year": lambda: (calendar(pc.day_of_year) - 1 + of_day) / (365 + calendar(pc.is_leap_year)),
        "month": lambda: (calendar(pc.month) - 1) / 12,  # January 0, December 11/12
    }
    return np.stack([phase[cycle]() for cycle in cycles]) if cycles else np.empty((0, len(micros)))


class DatetimeCodec(Codec):
    """A time per row, as its features (module docstring): float32 ``[rows, 2 * cycles + 1 (+ 1)]``, the cycles
    (time of day unless the column holds dates, day of week, day of year, month) as sin/cos pairs, the time since
    the train split's earliest value in train spans, and a missing indicator when the train split held a null.
    Fitted on the train split (encoders.json): the zone it reads times in, the origin and span, the mean time a
    null stands for, and the bins of the time since the origin (the train column's quantiles, ``fit_train_column``;
    ``info`` hands them to the model scaled as it sees the time). A string that is not ISO 8601 is invalid
    (``data.on_invalid``); served, it is refused."""

    kind = "datetime"
    reads_train_column = True  # the quantiles of the time since the origin: the numeric embeddings' bins
    model_block = DENSE
    drift_measure = "histograms"  # time of day, day of week, month (``drift_stats``)
    reference_column = NUMBERS  # hour, weekday, day of year, month, days since the origin (``reference_values``)
    takes = staticmethod(takes_time)
    takes_what = f"a timestamp (with or without a time zone), a date, or ISO-8601 strings ({EXAMPLES})"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, options)
        self.zone: str | None = None
        self.cycles: tuple[str, ...] | None = None  # known once a column was seen (or the state loaded)
        self.rows, self.nulls, self._first, self._last = 0, 0, None, None
        self._pivot, self._days = None, 0.0  # the first time seen, and the sum of the days after it
        self.origin, self.span, self.impute, self.indicator = 0, US_PER_DAY, 0.0, False
        self.edges: list[int] | None = None  # the train quantiles (wall-clock microseconds); None: no bins
        self.ordered = False  # a time split is by this column (``orders_the_split``): no bins
        self._drift = RunningHistogram(len(DRIFT_MEASURES))

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return plain(pa.array([], type=source_type)).type

    def _learn(self, array: pa.Array) -> None:
        """The zone and the cycles, from the source column's type (the first batch prepare shows)."""
        if self.cycles is None:
            self.zone = zone_of(array.type)
            dates = pa.types.is_date(value_type(array.type))
            self.cycles = tuple(cycle for cycle in CYCLES if not (dates and cycle == "hour"))

    def _times(self, array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._learn(array)
        try:
            return wall_clock(array, self.zone)
        except ValueError as problem:
            raise ValueError(f"datetime input {self.name!r} {problem}") from None

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        """Every time and null; a string that is not ISO 8601 is invalid."""
        return ~self._times(array)[2]

    def invalid_error(self, where: str, array: pa.Array, ok: np.ndarray) -> DataError | None:
        if ok.all():
            return None
        return DataError(f"{where}: {self._not_times(array, ~ok)}: fix the data or set data.on_invalid=drop")

    def _not_times(self, array: pa.Array, bad: np.ndarray) -> str:
        first = int(np.flatnonzero(bad)[0])
        return (
            f"datetime column {self.name!r} holds {plain(array)[first].as_py()!r} (row {first}; {int(bad.sum())} "
            f"such in these rows), not an ISO-8601 date or time ({EXAMPLES})"
        )

    def observe(self, array: pa.Array) -> None:
        """Train rows: how many and how many null, the earliest, latest and mean time, the drift histograms."""
        micros, present, _ = self._times(array)
        times = micros[present]
        self.rows += len(micros)
        self.nulls += len(micros) - len(times)
        self._drift.update(self._drift_columns(micros, present))
        if not len(times):
            return
        self._pivot = int(times[0]) if self._pivot is None else self._pivot
        self._first = int(times.min()) if self._first is None else min(self._first, int(times.min()))
        self._last = int(times.max()) if self._last is None else max(self._last, int(times.max()))
        self._days += float(((times - self._pivot) / US_PER_DAY).sum())

    def orders_the_split(self) -> None:
        """No bins for the column a time split is by: its val, test and served rows lie past the train split's last
        time, beyond every bin, where the level of a stretch of train days says nothing of the days to come (on
        the real tables it cost seattle-weather's and NYSE's time splits accuracy and R²: docs/benchmarks.md)."""
        self.ordered = True

    def fit_train_column(self, array: pa.Array) -> None:
        """The train split's whole column: the quantiles of its present times (``quantile_edges``, as a numeric
        input's), the bins of the time since the origin; none for the column a time split is by."""
        if self.ordered:
            return
        micros, present, _ = self._times(array)
        self.edges = [int(edge) for edge in quantile_edges(np.sort(micros[present]))] if present.any() else []

    def fit(self) -> dict[str, Any]:
        if self.rows and self._first is not None:
            present = self.rows - self.nulls
            mean = self._pivot + self._days / present * US_PER_DAY
            self.origin, self.span = self._first, max(self._last - self._first, US_PER_DAY)
            self.impute = (mean - self.origin) / self.span
            self.indicator = self.nulls > 0
        return {
            "zone": self.zone, "cycles": list(self.cycles or CYCLES), "origin": self.origin, "span": self.span,
            "origin_time": str(np.datetime64(self.origin, "us")), "impute": self.impute, "indicator": self.indicator,
            "rows": self.rows, "nulls": self.nulls, "edges": self.edges,
        }  # fmt: skip

    def load(self, state: dict[str, Any]) -> None:
        self.zone, self.cycles = state["zone"], tuple(state["cycles"])
        self.origin, self.span, self.impute = int(state["origin"]), int(state["span"]), float(state["impute"])
        self.indicator, self.rows, self.nulls = bool(state["indicator"]), int(state["rows"]), int(state["nulls"])
        self.edges = None if state.get("edges") is None else [int(edge) for edge in state["edges"]]

    def scaled(self, micros: np.ndarray) -> np.ndarray:
        """The time since the origin in train spans: the train split lies in 0..1."""
        return (micros - self.origin) / self.span

    def info(self) -> InputInfo:
        """With the bins of the time since the origin (``bins_column``: its column, after the cycles' pairs),
        scaled as ``encode`` gives it in float32, strictly increasing; none for the column a time split is by, or
        before PREPARE_VERSION 7."""
        if self.edges is None:
            return super().info()
        edges = np.unique(self.scaled(np.array(self.edges, dtype=np.int64)).astype(np.float32))
        return replace(super().info(), bins=tuple(float(edge) for edge in edges), bins_column=2 * len(self.cycles))

    def shape(self) -> tuple[int, ...]:
        return (2 * len(self.cycles) + 1 + int(self.indicator),)

    def encode(self, array: pa.Array) -> np.ndarray:
        """float32 ``[rows, D]``: the cycles' (sin, cos), the scaled time since the origin, the missing
        indicator; a null: (0, 0) per cycle, the train mean time, 1. ValueError naming a string that is no time."""
        micros, present, bad = self._times(array)
        if bad.any():
            raise ValueError(self._not_times(array, bad))
        angles = 2 * np.pi * cycle_phases(micros, self.cycles)
        columns = [part for angle in angles for part in (np.sin(angle), np.cos(angle))]
        columns = [np.where(present, column, 0.0) for column in columns]
        columns.append(np.where(present, self.scaled(micros), self.impute))
        if self.indicator:
            columns.append((~present).astype(np.float64))
        return np.stack(columns, axis=1).astype(np.float32) if columns else np.empty((len(micros), 0), np.float32)

    # ------------------------------------------------------------------ the reference, drift

    def reference_values(self, array: pa.Array) -> np.ndarray:
        """What scikit-learn's reference takes: float64 ``[rows, cycles + 1]``, each cycle's position in its own
        units (the hour of day, day of week 0-6, day of year 0-365, month 0-11) and the days since the origin; a
        null is NaN (boosting takes missing values natively)."""
        micros, present, _ = self._times(array)
        units = {"hour": 24, "day_of_week": 7, "day_of_year": 366, "month": 12}
        phases = cycle_phases(micros, self.cycles)
        columns = [phase * units[cycle] for phase, cycle in zip(phases, self.cycles, strict=True)]
        columns.append((micros - self.origin) / US_PER_DAY)
        return np.where(present[:, None], np.stack(columns, axis=1), np.nan)

    def reference_width(self) -> int:
        return len(self.cycles) + 1

    def _drift_columns(self, micros: np.ndarray, present: np.ndarray) -> np.ndarray:
        """The drift measures' values ``[len(DRIFT_MEASURES), rows]`` (hour 0-24, weekday 0-7, month 0-12), NaN
        for a null (counted as the histograms' nulls)."""
        units = np.array([24.0, 7.0, 12.0])[:, None]
        values = cycle_phases(micros, DRIFT_MEASURES) * units
        return np.where(present[None, :], values, np.nan).astype(np.float32)

    def _measures(self) -> tuple[str, ...]:
        return tuple(name for name in DRIFT_MEASURES if name in (self.cycles or CYCLES))

    def drift_stats(self) -> dict[str, Any]:
        """What drift compares (ddpflow/drift/): the train split's histograms of the time of day (not for dates),
        the day of week and the month, nulls counted; not the time itself, which moves on by design."""
        histograms = dict(zip(DRIFT_MEASURES, self._drift.to_list(), strict=True))
        return {"kind": self.kind, **{name: histograms[name] for name in self._measures()}}

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """The scored rows' histograms, as ``drift_stats`` holds the train split's."""
        micros, present, _ = self._times(array)
        histograms = RunningHistogram(len(DRIFT_MEASURES))
        histograms.update(self._drift_columns(micros, present))
        measured = dict(zip(DRIFT_MEASURES, histograms.to_list(), strict=True))
        return {"kind": self.kind, **{name: measured[name] for name in self._measures()}}

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        measures = [name for name in DRIFT_MEASURES if name in first]
        return {"kind": cls.kind, **{name: merge_histograms(first[name], second[name]) for name in measures}}

    # ------------------------------------------------------------------ serving

    @classmethod
    def serving_example(cls, values, source_type: str | None):
        """The times as the source has them: a zoned column as zoned pandas timestamps, strings as strings, a
        naive timestamp or a date as naive pandas timestamps (MLflow's ``datetime``)."""
        import pandas as pd

        if source_form(source_type) != NAIVE:
            return values
        return pd.Series(pd.to_datetime(values), index=values.index, name=values.name)

    @classmethod
    def declared_any(cls, source_type: str | None, info) -> bool:
        """A zoned or string source column is declared ``any``: MLflow's ``datetime`` holds naive times only (it
        refuses every zoned frame, and a JSON string with an offset), and the model reads them all."""
        return source_form(source_type) != NAIVE


NAIVE, ZONED, TEXT = "naive", "zoned", "text"


def source_form(source_type: str | None) -> str:
    """How a datetime input's source column holds its times, from its type's text (``model.pt``'s
    ``source_types``): ZONED (a timestamp with a zone), TEXT (strings) or NAIVE (a timestamp without one, a date;
    also a model.pt that does not say)."""
    text = source_type or ""
    if "tz=" in text:
        return ZONED
    return TEXT if re.match(r"(large_)?string|string_view|dictionary<values=(large_)?string", text) else NAIVE
