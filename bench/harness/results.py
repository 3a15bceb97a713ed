"""What a benchmark measures and records: figures summarised over repeats, one ``Result`` per benchmark,
and ``results.json``.

A benchmark reports a RATIO measured in the same run (ddpflow's figure divided
by a reference measured next to it), so a noisy shared machine moves both
sides together. Each repeat yields one ratio; the median is the headline and
min/max show the spread.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.ddpflow_api import atomic_write_json

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        values = [float(value) for value in values]
        if not values:
            raise ValueError("Stats.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, digits: int = 3, unit: str = "") -> str:
        suffix = f" {unit}" if unit else ""
        if self.n == 1 or self.min == self.max:
            return f"{_num(self.median, digits)}{suffix}"
        return f"{_num(self.median, digits)}{suffix} ({_num(self.min, digits)}–{_num(self.max, digits)})"


def _num(value: float, digits: int) -> str:
    if value != value:  # NaN
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def repeat(measure: Callable[[], dict[str, float]], times: int) -> dict[str, Stats]:
    """Call ``measure`` ``times`` times; each call returns named figures. Median/min/max per name."""
    samples: dict[str, list[float]] = {}
    for _ in range(times):
        for name, value in measure().items():
            samples.setdefault(name, []).append(value)
    return {name: Stats.of(values) for name, values in samples.items()}


def turns(items: Sequence, repeat: int) -> list:
    """The order for one repeat: as given, then reversed (A B, B A, ...), so neither side always goes first."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


class Timer:
    """``with Timer() as t: ...; t.seconds``"""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    """One line of a benchmark's table: a measured figure, optionally with its ratio."""

    label: str
    value: Stats | None = None
    unit: str = ""
    ratio: Stats | None = None
    note: str = ""


@dataclass
class Result:
    """One benchmark: a headline ratio checked against a target, plus its table."""

    name: str
    title: str
    ratio: Stats | None = None
    target: float | None = None
    direction: str = "ge"  # "ge": ratio >= target is good; "le": ratio <= target is good
    ratio_label: str = ""
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    family: str = ""
    seconds: float = 0.0  # wall time of the family that measured it
    # The most the ratio can read on this machine, measured in the same run (a bound the family derives, e.g. from
    # the cores the processes had), and the target restated from it by the rule the family's notes give; both None
    # where nothing bounds the ratio below its target.
    ceiling: Stats | None = None
    restated_target: float | None = None

    @property
    def met(self) -> bool | None:
        return self._meets(self.target)

    @property
    def restated_met(self) -> bool | None:
        return self._meets(self.restated_target)

    def _meets(self, target: float | None) -> bool | None:
        if self.ratio is None or target is None or self.status != "ok":
            return None
        return self.ratio.median >= target if self.direction == "ge" else self.ratio.median <= target

    def bounded_by(self, ceiling: Stats, share: float, at_least: float = 0.0) -> Result:
        """This result with a measured ceiling below its ("ge") target: the ceiling, and the target restated as
        ``share`` of the ceiling's median, at least ``at_least``. Unchanged where the ceiling leaves the target
        possible."""
        if self.target is None or ceiling.median >= self.target:
            return self
        self.ceiling, self.restated_target = ceiling, round(max(at_least, share * ceiling.median), 3)
        return self

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "—"
        return f"{'≥' if self.direction == 'ge' else '≤'} {self.target:g}"

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["met"] = self.met
        raw["restated_met"] = self.restated_met
        raw["target_text"] = self.target_text
        return raw


def skipped(name: str, title: str, reason: str) -> Result:
    return Result(name=name, title=title, status="skipped", reason=reason)


def run_guarded(name: str, title: str, body: Callable[[], list[Result]]) -> list[Result]:
    """A benchmark that breaks is recorded as an error; the others still run."""
    start = time.perf_counter()
    try:
        results = body()
    except Exception as error:
        traceback.print_exc()
        results = [Result(name=name, title=title, status="error", reason=f"{type(error).__name__}: {error}")]
    elapsed = time.perf_counter() - start
    for result in results:
        result.seconds = elapsed  # the family's time: its benchmarks share set-up and data
        result.family = name
    return results


def write_results(
    path: Path,
    *,
    mode: str,
    machine: dict[str, Any],
    results: Sequence[Result],
    started: float,
    argv: list[str],
    kept: Sequence[dict[str, Any]] = (),
    order: Sequence[str] = (),
) -> Path:
    """``kept``: benchmarks of an earlier run that this one did not repeat (``--only``); they keep their own time."""
    started_at = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")
    fresh = [dict(result.to_dict(), measured_at=started_at) for result in results]
    payload = {
        "mode": mode,
        "argv": argv,
        "started_at": started_at,
        "wall_s": round(time.time() - started, 1),
        "machine": machine,
        "benchmarks": sorted(
            [*kept, *fresh],
            key=lambda bench: list(order).index(bench["family"]) if bench.get("family") in order else len(order),
        ),
    }
    return atomic_write_json(path, payload)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
