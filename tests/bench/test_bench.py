"""The benchmark harness works: `python -m bench --quick` runs, records and renders.

Nothing here asserts speed: figures on a shared machine are noise, and speed
belongs in bench/. These tests prove that the harness measures every path it
claims to and writes results.json and the docs tables.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.harness.report import render_docs, render_summary, replace_block
from bench.harness.results import Result, Row, Stats, repeat

# The in-process families: together they drive prepare, the loader, the training loop and evaluate.
QUICK_FAMILIES = ["datapath", "prepare", "evaluate", "scale"]


def test_stats_and_repeat_summarise_every_call():
    values = iter([3.0, 1.0, 2.0])
    stats = repeat(lambda: {"x": next(values)}, 3)["x"]
    assert (stats.median, stats.min, stats.max, stats.n) == (2.0, 1.0, 3.0, 3)
    assert Stats.of([5.0]).fmt(unit="s") == "5 s"
    with pytest.raises(ValueError):
        Stats.of([])


def test_result_checks_its_target_in_the_right_direction():
    at_least = Result("a", "A", ratio=Stats.of([0.9]), target=0.95)
    at_most = Result("b", "B", ratio=Stats.of([0.9]), target=1.0, direction="le")
    skipped = Result("c", "C", target=1.0, status="skipped", reason="no GPU")
    assert (at_least.met, at_most.met, skipped.met) == (False, True, None)


def test_a_missed_target_shows_the_measured_ceiling_and_the_restated_target_beside_it():
    bounded = Result(
        "s", "S", ratio=Stats.of([1.1, 1.2]), target=1.6, ceiling=Stats.of([1.25, 1.3]), restated_target=1.0
    )
    plain = Result("p", "P", ratio=Stats.of([0.9]), target=0.95)
    assert (bounded.met, bounded.restated_met, plain.restated_met) == (False, True, None)
    payload = {"benchmarks": [dict(bounded.to_dict(), measured_at="now"), dict(plain.to_dict(), measured_at="now")]}
    rows = render_summary(payload["benchmarks"]).splitlines()
    assert "| **no**; measured ceiling 1.27 (1.25–1.3), restated target ≥ 1: yes | now |" in rows[2]
    assert rows[3].endswith("| ≥ 0.95 | **no** | now |")

    # The restated target: the target's share of the ceiling, never below its floor; none where the target stands.
    def bounded(target: float, ceiling: float, **share) -> Result:
        return Result("r", "R", ratio=Stats.of([0.1]), target=target).bounded_by(Stats.of([ceiling]), **share)

    assert bounded(1.6, 1.24, share=0.8, at_least=1.0).restated_target == 1.0
    assert bounded(0.5, 0.46, share=0.5).restated_target == 0.23
    stands = bounded(0.8, 0.955, share=0.8)
    assert (stands.ceiling, stands.restated_target) == (None, None)


def test_docs_blocks_are_replaced_and_prose_kept(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(
        "# Benchmarks\n\nWhy the data path is slow.\n\n"
        "<!-- bench:datapath:begin -->\nold table\n<!-- bench:datapath:end -->\n\nMore prose.\n"
    )
    result = Result(
        "datapath",
        "Data path",
        ratio=Stats.of([0.97, 0.96, 0.99]),
        target=0.95,
        rows=[Row("ddpflow", Stats.of([1.0]), "samples/s")],
    )
    payload = {
        "mode": "quick",
        "started_at": "now",
        "wall_s": 1.0,
        "machine": {"versions": {}, "gpu": None},
        "benchmarks": [result.to_dict()],
    }
    text = render_docs(payload, docs).read_text()
    assert "old table" not in text and "0.97 (0.96–0.99)" in text
    assert "Why the data path is slow." in text and "More prose." in text
    assert "<!-- bench:machine:begin -->" in text and "<!-- bench:summary:begin -->" in text
    assert replace_block("x", "new", "body").endswith("<!-- bench:new:begin -->\nbody\n<!-- bench:new:end -->\n")


def test_an_only_run_rerenders_its_own_families_and_keeps_the_others_as_the_docs_say(tmp_path):
    """The docs may hold figures of a run that results.json no longer holds: a --only run must not overwrite them."""
    measured = {"mode": "full", "started_at": "now", "wall_s": 1.0, "machine": {"versions": {}, "gpu": None}}

    def bench(name: str, ratio: float) -> dict:
        result = Result(name, name.title(), ratio=Stats.of([ratio - 0.05, ratio + 0.05]), target=1.0, rows=[])
        return {**result.to_dict(), "family": name}

    first = [bench("ddp", 0.9), bench("launch", 7.0), bench("scoring", 0.4)]
    docs = render_docs({**measured, "benchmarks": first}, tmp_path / "b.md")
    hand_measured = docs.read_text().replace("7 (6.95–7.05)", "11.6 (11.5–11.7)")
    docs.write_text(hand_measured)
    # results.json holds no scoring figures any more (a run whose results were not kept): the docs' row stays
    text = render_docs({**measured, "benchmarks": [bench("ddp", 1.2), bench("launch", 7.0)]}, docs, ["ddp"]).read_text()
    assert "1.2 (1.15–1.25)" in text and "0.9 (0.85–0.95)" not in text  # the family run now
    assert text.count("11.6 (11.5–11.7)") == 2 and "7 (6.95–7.05)" not in text  # its block and summary row kept
    summary = text.partition("<!-- bench:summary:begin -->")[2].partition("<!-- bench:summary:end -->")[0]
    assert [line.partition("](")[0] for line in summary.splitlines() if line.startswith("| [")] == [
        "| [Ddp",
        "| [Launch",
        "| [Scoring",
    ]  # in the docs' order, the scoring row kept though this payload lacks it


def test_quick_run_measures_each_path_and_writes_results_and_docs(tmp_path, repo_root):
    out, docs = tmp_path / "results.json", tmp_path / "benchmarks.md"
    command = [
        sys.executable,
        "-m",
        "bench",
        "--quick",
        "--only",
        ",".join(QUICK_FAMILIES),
        "--out",
        str(out),
        "--docs",
        str(docs),
        "--workdir",
        str(tmp_path / "work"),
    ]
    completed = subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]

    payload = json.loads(out.read_text())
    assert payload["mode"] == "quick"
    assert payload["machine"]["cpu_count"] >= 1 and payload["machine"]["versions"]["torch"]
    by_name = {bench["name"]: bench for bench in payload["benchmarks"]}
    assert set(by_name) == {"datapath", "datapath_mixed", "prepare", "shards", "evaluate", "scale"}
    for bench in by_name.values():
        assert bench["status"] == "ok", f"{bench['name']}: {bench['reason']}"
        ratio = bench["ratio"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["median"] > 0
        assert bench["met"] in (True, False)
    # The data path compares ddpflow against the compute limit and both reference loaders.
    labels = [row["label"] for row in by_name["datapath"]["rows"]]
    assert any(label.startswith("compute limit") for label in labels) and any(
        label.startswith("ddpflow") for label in labels
    )
    assert any("per-row" in label for label in labels) and any("BatchSampler" in label for label in labels)
    assert by_name["datapath"]["ratio"]["n"] == 2  # quick mode still repeats
    # The floor of a shuffled epoch, for each table: the target restated as 0.95 of it where it reads below 0.95.
    for name in ("datapath", "datapath_mixed"):
        (floor,) = [row for row in by_name[name]["rows"] if row["label"].startswith("the floor of a shuffled epoch")]
        below = floor["ratio"]["median"] < 0.95
        restated = by_name[name]["restated_target"]
        assert restated == round(0.95 * floor["ratio"]["median"], 3) if below else restated is None
    # The mixed table (numeric + 4 categoricals): ddpflow's loader and step against pre-cut batch dicts, per repeat.
    mixed = by_name["datapath_mixed"]
    assert mixed["target"] == 0.95 and mixed["ratio"]["n"] == 2
    sides = ["compute limit", "ddpflow", "ddpflow's loader with the bare step", "the floor of a shuffled epoch"]
    assert [row["label"].split(":")[0].split(" (")[0].strip() for row in mixed["rows"]] == sides
    assert "4 categoricals" in mixed["notes"][0]

    text = docs.read_text()
    for name in by_name:
        assert f"<!-- bench:{name}:begin -->" in text
    assert not (tmp_path / "work").exists()  # the working data is removed afterwards


def test_a_partial_run_keeps_the_other_families_results(tmp_path):
    from bench.__main__ import earlier_benchmarks

    out = tmp_path / "results.json"
    earlier = {
        "mode": "full",
        "started_at": "T0",
        "benchmarks": [{"name": "datapath", "family": "datapath"}, {"name": "scale", "family": "scale"}],
    }
    out.write_text(json.dumps(earlier))
    assert earlier_benchmarks(out, "full", ["datapath"]) == [{"name": "scale", "family": "scale", "measured_at": "T0"}]
    assert earlier_benchmarks(out, "quick", ["datapath"]) == []  # quick figures never mix with full ones


def test_memory_family_measures_the_node_cache_build_and_a_rank_with_an_image_column(tmp_path):
    """The memory family's in-process parts on tiny data: the builder's peak ÷ one record batch (numeric and mixed
    tables) and a rank's anon growth with an encoded-image column (each probe a fresh process, as in a run)."""
    from bench.families import memory
    from bench.harness.context import Context

    ctx = Context.create(quick=True, gpu=False, workdir=str(tmp_path / "work"))
    build = memory.build_memory(ctx)
    labels = [row.label for row in build.rows]
    assert any(label.startswith("numeric: the builder's peak anon") for label in labels)
    assert any(label.startswith("mixed (numeric + 4 categoricals): the builder's peak anon") for label in labels)
    batch = next(row for row in build.rows if row.label == "numeric: one record batch of the shards")
    assert batch.value.median > 0 and build.ratio.median > 0  # the builder holds at least part of a record batch
    assert build.target is None  # reported, no target

    images = memory.image_anon_memory(ctx)
    assert images.name == "rank_anon_memory_images" and images.target == 1.5 and images.direction == "le"
    small, large = (row for row in images.rows if row.label.endswith("train rows"))
    assert int(large.label.split()[0].replace(",", "")) > 3 * int(small.label.split()[0].replace(",", ""))
    assert small.value.median > 0 and images.ratio is not None


# The layers of bench/, bottom first: a module imports only modules of its own layer or a lower one.
BENCH_LAYERS = ("bench.ddpflow_api", "bench.harness", "bench.workloads", "bench.ranks", "bench.families", "bench")
PRODUCT = ("ddpflow", "training", "tasks", "flows")


def _bench_imports(repo_root) -> dict[str, set[str]]:
    """Every bench module -> the names it imports, at any depth (imports inside functions too)."""
    import ast

    graph = {}
    for path in sorted((repo_root / "bench").rglob("*.py")):
        parts = path.relative_to(repo_root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = names
    return graph


def _layer(module: str) -> int:
    return max(i for i, layer in enumerate(BENCH_LAYERS) if module == layer or module.startswith(layer + "."))


def test_only_the_facade_imports_the_product_and_bench_imports_run_one_way(repo_root):
    graph = _bench_imports(repo_root)
    assert {"bench.ddpflow_api", "bench.harness.results", "bench.ranks.ddp", "bench.families.images"} <= set(graph)
    product = {module: sorted(n for n in names if n.split(".")[0] in PRODUCT) for module, names in graph.items()}
    assert {module: names for module, names in product.items() if names and module != "bench.ddpflow_api"} == {}
    assert product["bench.ddpflow_api"], "the facade is where the product is reached"
    upward = {
        module: sorted(name for name in names if name in graph and _layer(name) > _layer(module))
        for module, names in graph.items()
    }
    assert {module: names for module, names in upward.items() if names} == {}
    families = {module for module in graph if module.startswith("bench.families.")}
    crossing = {module: sorted(graph[module] & families - {module}) for module in families}
    assert {module: names for module, names in crossing.items() if names} == {}, "families never import each other"


def test_every_family_is_the_module_named_as_its_only_name(repo_root):
    from bench.__main__ import FAMILIES

    modules = {path.stem for path in (repo_root / "bench" / "families").glob("*.py")} - {"__init__"}
    assert modules == set(FAMILIES)


def test_a_profile_summary_gives_each_process_its_share_and_keeps_a_python_c_command_whole(tmp_path):
    """bench/harness/profile.py reads py-spy's collapsed stacks (``--subprocesses``): a rank started through a
    ``python -c "a;b"`` wrapper is still one process, and the shares are of that process's samples."""
    from bench.harness.profile import summarise

    wrapper = 'process 7:"python -I -c import os;os.execv(x)"'
    rank = 'process 9:"python -m training.inference.batch_scoring --config job.json"'
    raw = tmp_path / "scoring.txt"
    raw.write_text(
        f"{wrapper};{rank};<module> (batch_scoring.py:1);score (training/x.py:3);forward (torch/nn/linear.py:9) 30\n"
        f"{wrapper};{rank};<module> (batch_scoring.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 10\n"
        f"{wrapper};run (torch/distributed/run.py:5) 60\n"
    )
    summary = summarise(raw)
    assert "100 samples" in summary
    assert "## python -m training.inference.batch_scoring --config job.json" in summary
    assert "40 samples (40.0% of all); importing modules: 25.0%" in summary
    assert "| 75.0% | `score (training/x.py)` |" in summary and "| 75.0% | `forward (torch/nn/linear.py)` |" in summary
    assert "torchrun's agent" in summary and "60 samples (60.0% of all)" in summary


def test_the_machine_block_names_the_families_an_only_run_measured():
    from bench.harness.report import render_machine

    payload = {"machine": {}, "started_at": "t", "mode": "full", "wall_s": 73.0, "argv": ["--only", "scripts"]}
    assert "| measured | t (full run of --only scripts, 73 s in all) |" in render_machine(payload)
    payload["argv"] = []
    assert "| measured | t (full run, 73 s in all) |" in render_machine(payload)
