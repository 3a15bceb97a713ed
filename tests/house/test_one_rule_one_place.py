"""A rule spelled once: a file is published whole by ``training/core/fileio.py`` alone, a JSON payload is hashed by
``training/core/digest.py: json_digest`` alone, and tasks/ holds Prefect tasks (each of its modules defines one;
what a flow or the command needs beside its tasks lives in flows/, what needs no Prefect in ddpflow/).

The one other ``os.replace``: the node cache's download (``training/loading/shard_cache.py``), whose temp name
(``<file>.part-<host>-<pid>``) is the cache's reservation that other processes read while it is filled."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("flows", "tasks", "ddpflow", "training")
ATOMIC_WRITE = Path("training/core/fileio.py")
OWN_RENAME = {Path("training/loading/shard_cache.py")}
JSON_DIGEST = Path("training/core/digest.py")


def product_files() -> list[Path]:
    return sorted(path.relative_to(REPO) for package in PRODUCT for path in (REPO / package).rglob("*.py"))


def calls(tree: ast.AST) -> set[str]:
    """``module.function`` of each attribute call in ``tree`` (``os.replace``, ``json.dumps``, ``hashlib.sha256``)."""
    return {
        f"{node.func.value.id}.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
    }


def functions(tree: ast.AST) -> list[ast.AST]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def hashes_a_json_dump(tree: ast.AST) -> list[str]:
    """The functions of ``tree`` that both dump JSON and hash."""
    return [
        function.name
        for function in functions(tree)
        if "json.dumps" in (found := calls(function)) and any(call.startswith("hashlib.") for call in found)
    ]


def defines_a_prefect_task(tree: ast.Module) -> bool:
    for function in functions(tree):
        for decorator in function.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if isinstance(target, ast.Name) and target.id == "task":
                return True
    return False


def test_a_file_is_published_whole_by_the_one_atomic_write():
    renames = {
        str(path)
        for path in product_files()
        if path not in OWN_RENAME | {ATOMIC_WRITE} and "os.replace" in calls(ast.parse((REPO / path).read_text()))
    }
    assert renames == set(), f"publish through training/core/fileio.py (atomic_write, atomic_path): {sorted(renames)}"


def test_a_json_payload_is_hashed_by_the_one_digest():
    spelled = {
        f"{path}: {name}"
        for path in product_files()
        if path != JSON_DIGEST
        for name in hashes_a_json_dump(ast.parse((REPO / path).read_text()))
    }
    assert spelled == set(), f"hash with training/core/digest.py: json_digest: {sorted(spelled)}"
    sample = "import hashlib, json\ndef key(p):\n    return hashlib.sha256(json.dumps(p).encode()).hexdigest()\n"
    assert hashes_a_json_dump(ast.parse(sample)) == ["key"]


def test_every_module_in_tasks_defines_a_prefect_task():
    modules = sorted(path for path in (REPO / "tasks").glob("*.py") if path.name != "__init__.py")
    assert len(modules) >= 6, "tasks/ holds almost nothing: has the layout changed?"
    without = [path.name for path in modules if not defines_a_prefect_task(ast.parse(path.read_text()))]
    assert without == [], f"tasks/ holds Prefect tasks only; these define none: {without}"
    assert not defines_a_prefect_task(ast.parse("def plain():\n    pass\n"))
