"""Imports run one way, flows -> tasks -> ddpflow -> training; no work at import time.

A rank must start without Prefect, MLflow's client or the launcher; the plain
libraries in ddpflow/ must be usable (and testable) without Prefect; the CLI
is a leaf that nothing imports; and MLflow is called from ddpflow/tracking/ only
(training/ may import it lazily, for the logged pyfunc model).

Inside the product, no first-party module imports itself back through others (no import circle, counting the
imports inside functions: a circle hidden in a function is still a circle), and training/'s folders are layers
(``TRAINING_LAYERS``, drawn in docs/architecture.md): a folder imports its own layer and the ones below, never
one above.
"""

from __future__ import annotations

import ast
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ddpflow
import training

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("flows", "tasks", "ddpflow", "training", "bench")


def modules_of(package) -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."))


def leaked_after_importing(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """Top-level packages from ``forbidden`` that importing ``modules`` (in a fresh interpreter) pulled in."""
    probe = (
        f"import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())  # a printed list of module names


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, at any depth (deferred imports inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def python_files(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (REPO / package).rglob("*.py"))


# --- the first-party module graph, from the source of every file (imports inside functions included) ---------


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_graph() -> dict[str, dict[str, int]]:
    """module -> {first-party module it imports: the line of the first such import}, over PRODUCT_PACKAGES.

    ``from package import name`` counts as an import of ``package.name`` when that is a module, else of the
    package; relative imports are resolved; ``if TYPE_CHECKING:`` blocks and function bodies count too."""
    paths = {module_name(path): path for path in python_files(*PRODUCT_PACKAGES)}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [known(f"{base}.{alias.name}") or known(base) for alias in node.names]
            for target in targets:
                if target and target != module:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as the path ``a -> b -> ... -> a`` with lines."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group, member = set(), None
            while member != module:
                member = stack.pop()
                group.add(member)
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [circle_through(graph, group) for group in groups]


def circle_through(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, each step with the importing line."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                step = f"{module}:{graph[module][target]} -> {target}"
                if target == start:
                    return [*paths[module][1:], step]
                if target in group and target not in paths:
                    paths[target] = [*paths[module], step]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {sorted(group)}")  # a strongly connected group always has one


def circles_touching(*packages: str) -> list[list[str]]:
    return [
        circle
        for circle in import_circles(first_party_graph())
        if any(step.split(".")[0] in packages for step in circle)
    ]


def test_every_training_module_imports_without_prefect_tasks_flows_or_ddpflow():
    modules = modules_of(training)
    assert "training.train" in modules and "training.prepare.dataset" in modules
    leaked = leaked_after_importing(modules, ("prefect", "tasks", "flows", "ddpflow", "optuna"))
    assert leaked == [], f"training/ pulled in: {leaked}"


def test_every_ddpflow_module_imports_without_prefect_tasks_or_flows():
    modules = modules_of(ddpflow)
    assert {"ddpflow.launch.supervisor", "ddpflow.launch.process_tree", "ddpflow.rundirs"} <= set(modules)
    leaked = leaked_after_importing(modules, ("prefect", "tasks", "flows"))
    assert leaked == [], f"ddpflow/ pulled in: {leaked}"


def test_the_rank_program_starts_without_pandas_mlflow_matplotlib_prefect_or_pillow():
    """Every rank (and the node cache builder) imports training.train: a package it pulls in costs start-up time
    in each of them on every launch. pandas is imported only where an id column is hashed (training/prepare/split.py);
    scikit-learn only where the evaluation fits its reference model (training/inference/reference.py).
    """
    forbidden = ("pandas", "mlflow", "matplotlib", "prefect", "PIL", "sklearn")
    leaked = leaked_after_importing(["training.train"], forbidden)
    assert leaked == [], f"training.train pulled in: {leaked}"


def test_tasks_never_import_flows():
    for path in python_files("tasks"):
        flows = sorted(name for name in imported_names(path) if name.split(".")[0] == "flows")
        assert flows == [], f"{path.relative_to(REPO)} imports {flows}"


def test_no_module_imports_the_cli():
    for path in python_files(*PRODUCT_PACKAGES):
        if path == REPO / "flows" / "cli.py":
            continue
        cli = sorted(name for name in imported_names(path) if name in ("flows.cli", "flows.cli.main"))
        assert cli == [], f"{path.relative_to(REPO)} imports the CLI ({cli}); the CLI calls plain functions, not back"


def test_mlflow_is_imported_only_in_the_tracking_layer_and_the_rank_side_serving_model():
    allowed = (REPO / "ddpflow" / "tracking", REPO / "training")
    offenders = {}
    for path in python_files(*PRODUCT_PACKAGES):
        if any(path.is_relative_to(folder) for folder in allowed):
            continue
        mlflow = sorted(name for name in imported_names(path) if name.split(".")[0] == "mlflow")
        if mlflow:
            offenders[str(path.relative_to(REPO))] = mlflow
    assert offenders == {}, f"call ddpflow/tracking/ instead of MLflow: {offenders}"


def test_optuna_is_imported_only_by_the_sweep_package():
    """The sweep's sampler, pruner and study live in ddpflow/sweep/; the ranks only read a verdict file."""
    offenders = {}
    for path in python_files(*PRODUCT_PACKAGES):
        if path.is_relative_to(REPO / "ddpflow" / "sweep"):
            continue
        optuna = sorted(name for name in imported_names(path) if name.split(".")[0] == "optuna")
        if optuna:
            offenders[str(path.relative_to(REPO))] = optuna
    assert offenders == {}, f"call ddpflow/sweep/ instead of Optuna: {offenders}"


def test_the_installed_package_holds_no_test_or_bench_code_and_needs_none():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(str(REPO), include=find["include"])
    assert {"ddpflow.launch", "training.prepare", "flows", "tasks"} <= set(shipped)
    assert [name for name in shipped if name.split(".")[0] in ("devtools", "bench", "tests")] == []
    for path in python_files("flows", "tasks", "ddpflow", "training"):
        dev = sorted(name for name in imported_names(path) if name.split(".")[0] in ("devtools", "bench", "tests"))
        assert dev == [], f"{path.relative_to(REPO)} imports {dev}, which is not installed"


# --- no import circle, and training/'s layers ------------------------------------------------------------------

# Lowest first. A folder of training/ imports folders of its own layer and the layers below it, never above.
# The top-level modules of training/ (train.py, preflight.py) are the top layer.
TRAINING_LAYERS = (
    ("core",),  # the config, the manifest, the run directory's names, small utilities
    ("kinds", "objectives", "distributed"),  # extension points (contract < built-ins < registry) and processes
    ("models", "loading", "prepare"),
    ("loop", "checkpoint", "inference"),
)
MAX_TOP_LEVEL_MODULES = 12


def training_folder(module: str) -> str:
    """The folder of training/ a module sits in; "" for a module at training/'s top (its top layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (REPO / "training" / parts[1]).is_dir()) else ""


def layer_of(folder: str) -> int:
    if folder == "":
        return len(TRAINING_LAYERS)
    return next(layer for layer, folders in enumerate(TRAINING_LAYERS) if folder in folders)


def test_no_import_circle_in_the_product():
    circles = circles_touching(*PRODUCT_PACKAGES)
    assert circles == [], "import circles (module:line -> imported module):\n" + "\n".join(map(str, circles))


def test_the_circle_finder_finds_a_circle_hidden_in_a_function_and_names_its_lines():
    graph = {"a.x": {"a.y": 3}, "a.y": {"a.z": 7}, "a.z": {"a.x": 41}, "a.w": {"a.x": 1}}
    assert import_circles(graph) == [["a.x:3 -> a.y", "a.y:7 -> a.z", "a.z:41 -> a.x"]]
    built = first_party_graph()
    assert built["training.models.registry"]["training.models.image"] > 0  # a module-level import
    assert "training.kinds.ragged" in built["training.kinds.registry"]  # one inside a function counts too


def test_the_circle_search_covers_every_folder_of_ddpflow_and_bench():
    """ddpflow/ and bench/ have folders of their own (launch/, tracking/, drift/...; families/, harness/...): every
    module in them is in the graph the circle search walks, with the imports inside its functions."""
    built = first_party_graph()
    for package in ("ddpflow", "bench"):
        modules = {module_name(path) for path in (REPO / package).rglob("*.py")}
        folders = {module.split(".")[1] for module in modules if module.count(".") >= 2}
        assert len(folders) >= 3, f"{package}/ has almost no folders: has the layout changed?"
        assert sorted(modules - set(built)) == [], f"{package}/ modules outside the circle search"
    assert "ddpflow.tracking.plots" in built["ddpflow.tracking.runs"]  # imported inside log_evaluation
    assert "ddpflow.launch.stage" in built["bench.ddpflow_api"]  # imported inside launch_training


def layer_folder_problems(training_dir: Path) -> list[str]:
    """What is wrong with training/'s folders against TRAINING_LAYERS: a folder on disk not listed, a listed one
    missing, one without a docstring in its __init__.py saying what belongs there, one holding no module, and too
    many modules at the top."""
    listed = {folder for layer in TRAINING_LAYERS for folder in layer}
    on_disk = {path.name for path in training_dir.iterdir() if path.is_dir() and path.name != "__pycache__"}
    problems = [f"training/{folder}/ is not in TRAINING_LAYERS" for folder in sorted(on_disk - listed)]
    problems += [f"training/{folder}/ is listed in TRAINING_LAYERS but missing" for folder in sorted(listed - on_disk)]
    for folder in sorted(listed & on_disk):
        package = training_dir / folder / "__init__.py"
        if not (package.is_file() and ast.get_docstring(ast.parse(package.read_text()))):
            problems.append(f"training/{folder}/__init__.py must say in its docstring what belongs in the folder")
        if not [path for path in package.parent.glob("*.py") if path.name != "__init__.py"]:
            problems.append(f"training/{folder}/ holds no module")
    top = sorted(path.name for path in training_dir.glob("*.py") if path.name != "__init__.py")
    if len(top) > MAX_TOP_LEVEL_MODULES:
        problems.append(f"{len(top)} modules at training/'s top: {top}")
    return problems


def test_training_folders_are_the_listed_layers_each_holding_modules():
    assert layer_folder_problems(REPO / "training") == []


def test_the_layer_check_names_a_folder_that_is_missing_empty_undocumented_or_not_listed(tmp_path):
    for layer in TRAINING_LAYERS:
        for folder in layer:
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "__init__.py").write_text(f'"""What belongs in {folder}/."""\n')
            (tmp_path / folder / "module.py").write_text("")
    assert layer_folder_problems(tmp_path) == []
    missing, empty, undocumented = TRAINING_LAYERS[0][0], TRAINING_LAYERS[1][0], TRAINING_LAYERS[2][0]
    shutil.rmtree(tmp_path / missing)
    (tmp_path / empty / "module.py").unlink()
    (tmp_path / undocumented / "__init__.py").write_text("")
    (tmp_path / "unlisted").mkdir()
    assert layer_folder_problems(tmp_path) == [
        "training/unlisted/ is not in TRAINING_LAYERS",
        f"training/{missing}/ is listed in TRAINING_LAYERS but missing",
        *sorted(
            [
                f"training/{empty}/ holds no module",
                f"training/{undocumented}/__init__.py must say in its docstring what belongs in the folder",
            ],
            key=lambda problem: problem.split("/")[1],
        ),
    ]


def test_a_training_layer_never_imports_a_layer_above_it():
    upward = []
    for module, edges in first_party_graph().items():
        if not module.startswith("training."):
            continue
        layer = layer_of(training_folder(module))
        for target, line in edges.items():
            if target.startswith("training.") and layer_of(training_folder(target)) > layer:
                upward.append(f"{module}:{line} -> {target}")
    assert upward == [], "imports from a lower layer of training/ into a higher one:\n" + "\n".join(upward)


# --- what the folders' docstrings say about their imports ------------------------------------------------------


def imports_claimed(docstring: str) -> set[str] | None:
    """The folders of training/ a docstring's "Imports ``training.a`` and ``training.b``." sentence names (with
    or without "only"); None when it has no such sentence."""
    sentence = re.search(r"\bImports (?:only )?(``training\.\w+``(?:(?:,\s*|\s+and\s+)``training\.\w+``)*)", docstring)
    return None if sentence is None else set(re.findall(r"``training\.(\w+)``", sentence.group(1)))


def folder_imports() -> dict[str, set[str]]:
    """Each folder of training/ -> the other folders of training/ its modules import (inside functions too)."""
    found: dict[str, set[str]] = {}
    for module, edges in first_party_graph().items():
        folder = training_folder(module) if module.startswith("training.") else None
        if folder:
            others = {training_folder(target) for target in edges if target.startswith("training.")}
            found.setdefault(folder, set()).update(others - {folder})
    return found


def test_each_training_folder_imports_exactly_the_folders_its_docstring_names():
    actual = folder_imports()
    claims = {}
    for folder in sorted(actual):
        claimed = imports_claimed(
            ast.get_docstring(ast.parse((REPO / "training" / folder / "__init__.py").read_text()))
        )
        if claimed is not None:
            claims[folder] = claimed
    assert len(claims) >= 6, f"few folders say what they import: {sorted(claims)}"
    wrong = {
        folder: (sorted(claimed), sorted(actual[folder]))
        for folder, claimed in claims.items()
        if claimed != actual[folder]
    }
    assert wrong == {}, f"folder: (what its docstring says it imports, what it imports): {wrong}"
    assert imports_claimed("Imports only ``training.core``.") == {"core"}
    assert imports_claimed("Imports ``training.core``, ``training.kinds`` and ``training.distributed``.") == {
        "core",
        "kinds",
        "distributed",
    }


def test_the_training_ranks_never_import_the_prepare_folder():
    """training/prepare/__init__.py says so: what training.train imports, at any depth, never reaches it."""
    graph, reached, todo = first_party_graph(), set(), ["training.train"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, {}))
    assert len(reached) > 30, "the walk from training.train found almost nothing"
    assert sorted(module for module in reached if module.startswith("training.prepare")) == []


def listed_modules(docstring: str) -> list[str]:
    """The modules a package docstring lists one per line (``    name.py   what it holds``), in order."""
    return re.findall(r"^\s{4}(\w+)\.py\s", docstring, flags=re.MULTILINE)


def test_a_package_whose_docstring_says_imports_run_up_its_list_keeps_to_it():
    """ddpflow/drift/, ddpflow/launch/slurm/: each listed module imports only the ones listed above it."""
    graph, checked, wrong = first_party_graph(), [], []
    for init in python_files(*PRODUCT_PACKAGES):
        docstring = ast.get_docstring(ast.parse(init.read_text())) if init.name == "__init__.py" else None
        if not docstring or "Imports run up this list" not in docstring:
            continue
        package, order = module_name(init), listed_modules(docstring)
        checked.append(package)
        for place, name in enumerate(order):
            for target in graph[f"{package}.{name}"]:
                imported = target.removeprefix(f"{package}.")
                if imported in order and order.index(imported) > place:
                    wrong.append(f"{package}.{name} imports {imported}, listed below it")
    assert {"ddpflow.drift", "ddpflow.launch.slurm"} <= set(checked)
    assert wrong == []
