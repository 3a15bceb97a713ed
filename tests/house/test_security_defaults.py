"""Security defaults that hold for the whole code base, checked on its source (docs/reliability.md).

Behaviour is tested where it happens (run dirs: test_rundirs.py; loopback servers:
tests/flows/test_deployments_e2e.py); these scans catch a new call that breaks a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from training.core.config import PipelineConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "ddpflow", "training")


def source_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


@pytest.fixture(scope="module")
def parsed() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in source_files()}


def test_every_torch_load_is_weights_only(parsed):
    loads = [(path, node) for path, tree in parsed.items() for node, name in calls(tree) if name.endswith("torch.load")]
    assert loads, "no torch.load found: the scan is broken"
    unsafe = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path, node in loads
        if not any(
            kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
            for kw in node.keywords
        )
    ]
    assert unsafe == [], f"torch.load without weights_only=True (unpickles code): {unsafe}"


def test_no_shell_strings_are_run(parsed):
    """Processes start from argument lists: a parameter can never become shell syntax."""
    offenders = []
    for path, tree in parsed.items():
        for node, name in calls(tree):
            shell = any(
                kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
                for kw in node.keywords
            )
            if shell or name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert offenders == []


def test_every_server_ddpflow_starts_is_told_to_bind_loopback_only(tmp_path):
    """The stack's two servers and `ddpflow run`'s temporary Prefect server. Their listening sockets
    are checked on the running processes too (test_deployments_e2e.py, test_prefect_server.py)."""
    from ddpflow.services import prefect_server, stack

    layout = stack.StackLayout.for_project(tmp_path)
    argvs = (
        stack.prefect_server_argv(4200),
        stack.mlflow_server_argv(layout, 5000),
        prefect_server.temporary_server_argv(8000),
    )
    for argv in argvs:
        assert argv[argv.index("--host") + 1] == "127.0.0.1", argv


def test_the_config_holds_no_secrets():
    """Credentials come from the environment (AWS_*, MLFLOW_TRACKING_*), never from a config file or a run's
    parameters."""
    names = PipelineConfig().flat().keys()
    assert [
        name
        for name in names
        if any(word in name.lower() for word in ("password", "secret", "token", "access_key", "credential"))
    ] == []
