"""The benchmark harness: repeat and summarise, describe the machine, write
``results.json`` and regenerate the tables in ``docs/benchmarks.md``.

Every benchmark family (a module named in ``bench/__main__.py: FAMILIES``)
exposes ``run(ctx) -> list[Result]``.
A benchmark reports a RATIO measured in the same run (ddpflow's figure divided
by a reference measured next to it), so a noisy shared machine moves both
sides together. Each repeat yields one ratio; the median is the headline and
min/max show the spread.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from training.fileio import atomic_write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS_BEGIN = "<!-- bench:{name}:begin -->"
DOCS_END = "<!-- bench:{name}:end -->"


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

    @property
    def met(self) -> bool | None:
        if self.ratio is None or self.target is None or self.status != "ok":
            return None
        return self.ratio.median >= self.target if self.direction == "ge" else self.ratio.median <= self.target

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "—"
        return f"{'≥' if self.direction == 'ge' else '≤'} {self.target:g}"

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["met"] = self.met
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


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """What the figures were measured on; recorded with every run."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    info["versions"] = _versions("torch", "pyarrow", "numpy", "pandas", "prefect", "mlflow")
    info["gpu"] = _gpu()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _versions(*packages: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _gpu() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "bf16": torch.cuda.is_bf16_supported(),
    }


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


# --------------------------------------------------------------------------- docs


def render_machine(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    versions = machine.get("versions", {})
    gpu = machine.get("gpu")
    load = machine.get("load_average") or []
    lines = [
        "| | |",
        "|---|---|",
        f"| measured | {payload['started_at']} ({payload['mode']} run, {payload['wall_s']:.0f} s in all) |",
        f"| CPU | {machine.get('cpu_model')}, {machine.get('cpus_usable')} usable cores of "
        f"{machine.get('cpu_count')} |",
        f"| memory | {machine.get('memory_gib', '?')} GiB |",
        f"| GPU | {gpu['name'] + ' x' + str(gpu['count']) if gpu else 'none'} |",
        f"| load average at start / end | {_load(load)} / {_load(machine.get('load_average_end') or [])} |",
        f"| software | Python {machine.get('python')}, "
        + ", ".join(f"{name} {value}" for name, value in versions.items() if value)
        + " |",
        f"| platform | {machine.get('platform')} |",
    ]
    return "\n".join(lines)


def _load(values: Sequence[float]) -> str:
    return " ".join(f"{value:.1f}" for value in values) or "?"


def render_summary(benchmarks: Sequence[dict[str, Any]], kept_rows: dict[str, str] | None = None) -> str:
    """One row per benchmark; ``kept_rows`` (title -> row) replaces the rendered row of a benchmark not re-run."""
    lines = ["| benchmark | measured ratio: median (min–max) | target | met | measured at |", "|---|---|---|---|---|"]
    for bench in benchmarks:
        when = bench.get("measured_at", "")
        rendered = (
            f"| [{bench['title']}](#{_anchor(bench['title'])}) | {_ratio_cell(bench)} | {bench['target_text']} "
            f"| {_met_cell(bench)} | {when} |"
        )
        lines.append((kept_rows or {}).get(bench["title"], rendered))
    return "\n".join(lines)


def summary_rows(text: str) -> dict[str, str]:
    """The rows of the summary block in ``text``, by benchmark title."""
    begin, end = DOCS_BEGIN.format(name="summary"), DOCS_END.format(name="summary")
    block = text.partition(begin)[2].partition(end)[0]
    rows = {}
    for line in block.splitlines():
        if line.startswith("| ["):
            rows[line[3:].partition("](")[0]] = line
    return rows


def render_benchmark(bench: dict[str, Any]) -> str:
    lines = [
        f"**{bench.get('ratio_label') or 'ratio'}: {_ratio_cell(bench)}**, target {bench['target_text']}: "
        f"{_met_cell(bench)}."
    ]
    if bench["status"] != "ok":
        lines.append("")
        lines.append(f"Not measured in this run: {bench['reason']}")
    if bench["rows"]:
        lines += ["", "| | measured: median (min–max) | ratio or difference | note |", "|---|---|---|---|"]
        for row in bench["rows"]:
            value = _stats_text(row["value"], row["unit"])
            ratio = _stats_text(row["ratio"], "")
            lines.append(f"| {row['label']} | {value} | {ratio} | {row['note']} |")
    if bench["notes"]:
        lines.append("")
        lines += [f"- {note}" for note in bench["notes"]]
    lines.append("")
    lines.append(
        f"<sub>Measured by `python -m bench --only {bench.get('family', bench['name'])}` "
        f"({bench['seconds']:.0f} s in this run).</sub>"
    )
    return "\n".join(lines)


def _stats_text(raw: dict[str, Any] | None, unit: str) -> str:
    if not raw:
        return ""
    return Stats(**raw).fmt(3, unit)


def _ratio_cell(bench: dict[str, Any]) -> str:
    if bench["status"] == "skipped":
        return "not measured"
    if bench["status"] == "error":
        return "error"
    return _stats_text(bench["ratio"], "") or "—"


def _met_cell(bench: dict[str, Any]) -> str:
    if bench["status"] != "ok":
        return "—"
    return {True: "yes", False: "**no**", None: "—"}[bench["met"]]


def _anchor(title: str) -> str:
    return "".join(ch for ch in title.lower().replace(" ", "-") if ch.isalnum() or ch in "-_")


def replace_block(text: str, name: str, body: str) -> str:
    """Swap the generated block ``name`` in ``text``; append it (with a heading) when absent."""
    begin, end = DOCS_BEGIN.format(name=name), DOCS_END.format(name=name)
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        return head + block + tail
    return text.rstrip() + "\n\n" + block + "\n"


def render_docs(payload: dict[str, Any], docs_path: Path, families: Collection[str] | None = None) -> Path:
    """Regenerate only the marked blocks; the hand-written prose around them stays.

    ``families``: only these families' blocks and summary rows are re-rendered (a ``--only`` run); the
    others keep what the docs say, which may come from a run whose figures results.json no longer holds.
    """
    text = docs_path.read_text() if docs_path.exists() else "# Benchmarks\n"

    def rerun(bench: dict[str, Any]) -> bool:
        return families is None or bench.get("family", bench["name"]) in families

    existing = summary_rows(text)
    kept_rows = {
        bench["title"]: existing[bench["title"]]
        for bench in payload["benchmarks"]
        if not rerun(bench) and bench["title"] in existing
    }
    text = replace_block(text, "machine", render_machine(payload))
    text = replace_block(text, "summary", render_summary(payload["benchmarks"], kept_rows))
    for bench in payload["benchmarks"]:
        present = f"<!-- bench:{bench['name']}:begin -->" in text
        if present and not rerun(bench):
            continue
        if not present:
            text = text.rstrip() + f"\n\n## {bench['title']}\n"
        text = replace_block(text, bench["name"], render_benchmark(bench))
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(text)
    return docs_path


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
