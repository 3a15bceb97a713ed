"""Every file and name the text points to exists: README.md, docs/*.md, and the comments and docstrings of every
Python file in flows/, tasks/, ddpflow/, training/, bench/, devtools/ and tests/. A reference is a path from the
repository's root (``ddpflow/launch/stage.py``, ``docs/launch.md``, ``training/loop/``), optionally followed by a
name it defines (``training/core/fileio.py: atomic_write``, a list ``path.py: a, b``) or a test in it
(``tests/<file>.py::test_name``). The path must exist; a name must be a function, class, constant, imported name or
``Class.member`` of that file.

What is not read as a reference, and why (the only exceptions):
- a placeholder: a path with ``*``, ``<``, ``{``, ``...`` or an upper-case segment (``bench/families/NAME.py``);
- an output a run writes: a path .gitignore covers (``bench/results-quick.json``);
- a file the same text's own commands write (``cat > configs/churn.yaml``);
- after ``path.py:`` a plain lower-case word is prose ("tasks/train.py: the task that ..."); a name is code-like:
  it has ``_``, ``.`` or a capital letter, or the reference sits in a code span.
Dotted module names (``ddpflow.report``) are not read: the same spelling names MLflow tags, events and the script
API, which are not modules."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from source_text import comments_and_docstrings, defined_names

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("flows", "tasks", "ddpflow", "training", "tests", "bench", "devtools", "docs", "configs", "examples")
CODE_ROOTS = ("flows", "tasks", "ddpflow", "training", "bench", "devtools", "tests")
NAME = r"[A-Za-z_][\w.]*"
REFERENCE = re.compile(
    r"(?<![\w/.-])(`?)((?:" + "|".join(ROOTS) + r")/[\w/.*<>{}-]*)"  # the path
    r"(?:(::)(" + NAME + r"(?:::" + NAME + r")?)|:[ \t]*(" + NAME + r"(?:,[ \t]*" + NAME + r")*))?"  # a test, names
)
WRITTEN = re.compile(r">\s*((?:" + "|".join(ROOTS) + r")/[\w/.-]+)")


def texts() -> dict[str, str]:
    """Each text that names files: the docs whole, the code's comments and docstrings."""
    found = {
        str(path.relative_to(REPO)): path.read_text() for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    }
    for root in CODE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            found[str(path.relative_to(REPO))] = comments_and_docstrings(path)
    return found


def ignored_outputs() -> list[str]:
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def placeholder(path: str) -> bool:
    return (
        any(mark in path for mark in "*<>{")
        or "..." in path
        or any(part.split(".")[0].isupper() for part in path.split("/"))
    )


def code_like(name: str, in_code_span: bool) -> bool:
    return in_code_span or "_" in name or "." in name or name != name.lower()


def dead_references(text: str) -> list[str]:
    """Each reference in ``text`` whose file does not exist, or whose file does not define the name given."""
    written = set(WRITTEN.findall(text))
    outputs = ignored_outputs()
    dead = []
    for match in REFERENCE.finditer(text):
        tick, path, colons, test, names = match.groups()
        path = path.rstrip(".,")
        if placeholder(path) or path in written:
            continue
        if any(fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") for pattern in outputs):
            continue
        target = REPO / path
        if not target.exists():
            dead.append(path)
            continue
        if target.suffix != ".py" or not target.is_file():
            continue
        wanted = [test.replace("::", ".")] if colons else [n.strip().rstrip(".") for n in (names or "").split(",")]
        defined = defined_names(target)
        dead.extend(
            f"{path}: {name}" for name in wanted if name and code_like(name, bool(tick)) and name not in defined
        )
    return dead


def test_every_path_and_name_the_docs_and_comments_give_resolves():
    everything = texts()
    dead = {where: found for where, text in everything.items() if (found := dead_references(text))}
    listing = "\n".join(f"{where}: {reference}" for where, found in sorted(dead.items()) for reference in found)
    assert dead == {}, f"{sum(map(len, dead.values()))} references to what does not exist:\n{listing}"


def test_the_architecture_doc_is_read_with_its_many_references():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert len(REFERENCE.findall(text)) > 50, "the scan found almost nothing: has the doc's format changed?"


def test_the_check_catches_what_it_is_for_and_passes_the_stated_exceptions():
    dead = dead_references(
        "the drift report (ddpflow/drift.py) and `bench/ddp_rank.py`; "
        "`training/core/fileio.py: no_such_writer`; tests/house/test_references_resolve.py::test_gone"
    )
    assert dead == [
        "ddpflow/drift.py",
        "bench/ddp_rank.py",
        "training/core/fileio.py: no_such_writer",
        "tests/house/test_references_resolve.py: test_gone",
    ]
    fine = (
        "training/core/fileio.py: atomic_write; training/loop/: the loop; tasks/train.py: the task; "
        "bench/families/NAME.py and configs/*.yaml; bench/results-quick.json; cat > configs/mine.yaml; "
        "configs/mine.yaml; tests/house/test_references_resolve.py::test_the_architecture_doc_is_read_with_its_many_"
        "references; training/core/fileio.py: atomic_write, defined_names_nowhere"
    )
    assert dead_references(fine) == ["training/core/fileio.py: defined_names_nowhere"]
