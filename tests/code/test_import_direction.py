"""Imports run one way, flows -> tasks -> training: a rank must start without Prefect."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import training

REPO = Path(__file__).resolve().parents[2]


def training_modules() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(training.__path__, "training."))


def test_every_training_module_imports_without_prefect_tasks_or_flows():
    modules = training_modules()
    assert "training.train" in modules and "training.data.prepare" in modules
    probe = (
        f"import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'tasks', 'flows'))\n"
        f"print(leaked)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"training/ pulled in: {result.stdout}"


def test_tasks_never_import_flows():
    for path in (REPO / "tasks").glob("*.py"):
        text = path.read_text()
        assert "from flows" not in text and "import flows" not in text, f"{path.name} imports flows/"
