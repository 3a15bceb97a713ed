"""What the house tests read in a Python file: the names it defines (``defined_names``) and its prose, the
comments and docstrings (``comments_and_docstrings``)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path


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
                    elif isinstance(member, ast.Assign):
                        names.update(f"{node.name}.{t.id}" for t in member.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):  # a rule re-exported under the name its users call it by
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def comments_and_docstrings(path: Path) -> str:
    """A Python file's comments and docstrings, one after another."""
    source = path.read_text()
    parts = [
        tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)
