"""Imports run one way, flows -> tasks -> ddpflow -> training; no work at import time.

A rank must start without Prefect, MLflow's client or the launcher; the plain
libraries in ddpflow/ must be usable (and testable) without Prefect; the CLI
is a leaf that nothing imports; and MLflow is called from ddpflow/tracking/ only
(training/ may import it lazily, for the logged pyfunc model).
"""

from __future__ import annotations

import ast
import pkgutil
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


def test_every_training_module_imports_without_prefect_tasks_flows_or_ddpflow():
    modules = modules_of(training)
    assert "training.train" in modules and "training.data.prepare" in modules
    leaked = leaked_after_importing(modules, ("prefect", "tasks", "flows", "ddpflow"))
    assert leaked == [], f"training/ pulled in: {leaked}"


def test_every_ddpflow_module_imports_without_prefect_tasks_or_flows():
    modules = modules_of(ddpflow)
    assert {"ddpflow.launch.supervisor", "ddpflow.launch.process_tree", "ddpflow.rundirs"} <= set(modules)
    leaked = leaked_after_importing(modules, ("prefect", "tasks", "flows"))
    assert leaked == [], f"ddpflow/ pulled in: {leaked}"


def test_the_rank_program_starts_without_pandas_mlflow_matplotlib_prefect_or_pillow():
    """Every rank (and the node cache builder) imports training.train: a package it pulls in costs start-up time
    in each of them on every launch. pandas is imported only where an id column is hashed (training/data/split.py);
    scikit-learn only where the evaluation fits its reference model (training/reference.py).
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


def test_the_installed_package_holds_no_test_or_bench_code_and_needs_none():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(str(REPO), include=find["include"])
    assert {"ddpflow.launch", "training.data", "flows", "tasks"} <= set(shipped)
    assert [name for name in shipped if name.split(".")[0] in ("devtools", "bench", "tests")] == []
    for path in python_files("flows", "tasks", "ddpflow", "training"):
        dev = sorted(name for name in imported_names(path) if name.split(".")[0] in ("devtools", "bench", "tests"))
        assert dev == [], f"{path.relative_to(REPO)} imports {dev}, which is not installed"
