"""docs/benchmarks.md from ``results.json``: the generated blocks between ``<!-- bench:NAME:begin/end -->``
marks are replaced, the hand-written prose around them stays."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from bench.harness.results import Stats

DOCS_BEGIN = "<!-- bench:{name}:begin -->"
DOCS_END = "<!-- bench:{name}:end -->"


def render_machine(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    versions = machine.get("versions", {})
    gpu = machine.get("gpu")
    load = machine.get("load_average") or []
    lines = [
        "| | |",
        "|---|---|",
        f"| measured | {payload['started_at']} ({_run_kind(payload)}, {payload['wall_s']:.0f} s in all) |",
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


def _run_kind(payload: dict[str, Any]) -> str:
    """``full run`` or ``quick run``, and the families an ``--only`` run measured (the rest of the page keeps the
    figures of the runs that measured them, each block with its own date)."""
    argv = list(payload.get("argv") or [])
    only = argv[argv.index("--only") + 1] if "--only" in argv[:-1] else None
    return f"{payload['mode']} run" + (f" of --only {only}" if only else "")


def _load(values: Sequence[float]) -> str:
    return " ".join(f"{value:.1f}" for value in values) or "?"


def render_summary(
    benchmarks: Sequence[dict[str, Any]], kept_rows: dict[str, str] | None = None, earlier: dict[str, str] | None = None
) -> str:
    """One row per benchmark; ``kept_rows`` (title -> row) replaces the rendered row of a benchmark not re-run.
    ``earlier`` (title -> row, in the docs' order; a ``--only`` run): the rows the docs already show, kept in
    place also for a benchmark ``benchmarks`` lacks (measured by a run whose results.json is gone); the new ones
    follow them."""
    rendered = {}
    for bench in benchmarks:
        when = bench.get("measured_at", "")
        rendered[bench["title"]] = (kept_rows or {}).get(
            bench["title"],
            f"| [{bench['title']}](#{_anchor(bench['title'])}) | {_ratio_cell(bench)} | {bench['target_text']} "
            f"| {_met_cell(bench)} | {when} |",
        )
    rows = {title: rendered.get(title, row) for title, row in (earlier or {}).items()} | rendered
    lines = ["| benchmark | measured ratio: median (min–max) | target | met | measured at |", "|---|---|---|---|---|"]
    return "\n".join(lines + list(rows.values()))


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
    met = _VERDICT[bench["met"]]
    if bench["met"] is False and bench.get("ceiling") and bench.get("restated_target") is not None:
        sign = "≥" if bench["direction"] == "ge" else "≤"
        met += (
            f"; measured ceiling {_stats_text(bench['ceiling'], '')}, restated target "
            f"{sign} {bench['restated_target']:.3g}: {_VERDICT[bench.get('restated_met')]}"
        )
    return met


_VERDICT = {True: "yes", False: "**no**", None: "—"}


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
    earlier = existing if families is not None else None  # a full run's summary is its own
    text = replace_block(text, "summary", render_summary(payload["benchmarks"], kept_rows, earlier))
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
