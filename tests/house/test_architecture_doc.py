"""docs/architecture.md stays true: every product path it names exists, and every ``path: name`` it names is
defined there (a function, class, constant or ``Class.method``), so the "where each rule lives" table and the
layer picture move with the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
ROOTS = ("flows", "tasks", "ddpflow", "training", "tests", "bench", "devtools")
NAMED = re.compile(r"`((?:" + "|".join(ROOTS) + r")/[\w/.]*)(?::\s*([\w.]+))?")


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes, assigned and imported names, and ``Class.member`` for each class's members."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(f"{node.name}.{member.target.id}")
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):  # a rule re-exported under the name its users call it by
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def test_every_path_and_name_the_architecture_doc_gives_resolves():
    text = DOC.read_text()
    named = NAMED.findall(text)
    assert len(named) > 50, "the scan found almost nothing: has the doc's format changed?"
    missing = sorted({path for path, _ in named if not (REPO / path.rstrip("/.")).exists()})
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"
    undefined = sorted(
        f"{path}: {name}"
        for path, name in named
        if name and path.endswith(".py") and name not in defined_names(REPO / path)
    )
    assert undefined == [], f"docs/architecture.md names what these files do not define: {undefined}"
