"""One record per objective: tasks/ and ddpflow/ ask the objective's record (training/objectives/base.py:
``Objective.uses_label``, ``has_baselines``, ``evaluation``) how its models are evaluated and judged, and never
name an objective themselves; a user's objective is read with the contract's defaults."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import pytest

from ddpflow.tracking.registration import gate_rules
from training.core.config import load_config
from training.objectives.base import ROW_SCORER, TOKEN_SCORER, Objective
from training.objectives.registry import BUILT_IN, evaluation_of, objective_record

REPO = Path(__file__).resolve().parents[2]
OBJECTIVE_MODULES = ("training.objectives.next_token", "training.objectives.builtin")
DATASET_TASKS = ("classification", "regression", "multilabel")  # a task's name is not an objective's


def code_strings(path: Path) -> list[str]:
    """Every string constant of a file that is not a docstring (f-strings' literal parts included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def objective_mentions(path: Path, root: Path = REPO) -> list[str]:
    """Where a file imports a built-in objective's module or names a built-in objective in its code."""
    found, where = [], path.relative_to(root)
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) else None
        names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        for name in [module or "", *names]:
            if name.startswith(OBJECTIVE_MODULES):
                found.append(f"{where}:{node.lineno} imports {name}")
    for text in code_strings(path):
        named = [
            name
            for name in BUILT_IN
            if name not in DATASET_TASKS and (text == name or ("_" in name and re.search(rf"\b{name}\b", text)))
        ]
        found += [f"{where} names the objective {name!r} in {text[:60]!r}" for name in named]
    return found


def test_tasks_and_ddpflow_never_name_an_objective():
    files = sorted(path for package in ("tasks", "ddpflow") for path in (REPO / package).rglob("*.py"))
    assert files
    assert [mention for path in files for mention in objective_mentions(path)] == []


def test_the_check_finds_a_named_objective(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Mentions next_token in prose only."""\n'
        "from training.objectives.next_token import LANGUAGE_MODEL\n"
        'language = objective == "next_token"\nloss = f"{x}: a next_token model"\nbinary = "binary file"\n'
        'task = "multilabel"\n'
    )
    found = objective_mentions(sample, tmp_path)
    assert len(found) == 3 and "imports training.objectives.next_token" in found[0]
    assert all("'next_token'" in line for line in found[1:])


@pytest.mark.parametrize(
    ("objective", "task", "n_classes", "gate_metric", "scored_as", "uses_label", "has_baselines"),
    [
        ("auto", "classification", 4, "test_accuracy", "classification", True, True),
        ("auto", "classification", 2, "test_roc_auc", "classification", True, True),  # two classes: the ranking
        ("auto", "classification", None, "test_accuracy", "classification", True, True),  # classes not known
        ("binary", "classification", 2, "test_roc_auc", "classification", True, True),
        ("auto", "regression", None, "test_rmse", "regression", True, True),
        ("huber", "regression", None, "test_rmse", "regression", True, True),
        ("multilabel", "multilabel", 2, "test_micro_f1", "multilabel", True, True),  # two labels: not two classes
        ("next_token", "classification", 2, "test_loss", "next_token", False, False),
    ],
)
def test_each_built_in_record_says_how_it_is_evaluated_and_judged(
    objective, task, n_classes, gate_metric, scored_as, uses_label, has_baselines
):
    train = load_config(None, [f"train.objective={objective}"]).train
    record = objective_record(train.objective, task)
    evaluation = evaluation_of(train, task, n_classes)
    assert (evaluation.gate_metric, evaluation.scored_as) == (gate_metric, scored_as)
    assert (record.uses_label, record.has_baselines) == (uses_label, has_baselines)
    assert evaluation.scorer == (TOKEN_SCORER if objective == "next_token" else ROW_SCORER)
    assert gate_metric in evaluation.headline
    config = load_config(None, [f"train.objective={objective}"])
    assert gate_rules(config, task, n_classes).metric == gate_metric  # what the gate judges: the same record
    assert (
        gate_rules(
            load_config(None, [f"train.objective={objective}", "registry.metric=test_f"]), task, n_classes
        ).metric
        == "test_f"
    )


USER_OBJECTIVES = """
from training.objectives.base import Evaluation, Objective


class Absolute(Objective):
    def per_row_loss(self, outputs, labels):
        return (outputs.reshape(labels.shape) - labels).abs()


class Ranked(Objective):
    has_baselines = True

    @classmethod
    def evaluation(cls, task):
        return Evaluation("regression", "test_spearman", ("test_spearman",))


def absolute(n_classes, **kwargs):
    return Absolute(n_classes)
"""


@pytest.fixture
def user_objectives(tmp_path, monkeypatch):
    (tmp_path / "record_objectives.py").write_text(textwrap.dedent(USER_OBJECTIVES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "record_objectives"
    sys.modules.pop("record_objectives", None)


def test_a_user_objective_is_read_with_the_defaults_or_declares_its_own(user_objectives):
    for factory in ("absolute", "Absolute"):  # a factory function, or the class itself
        record = objective_record(f"{user_objectives}:{factory}", "regression")
        assert record.uses_label and not record.has_baselines  # its outputs mean what its code says
        assert record.evaluation("regression").gate_metric == "test_rmse"  # as its task's built-ins
        assert record.evaluation("classification").gate_metric == "test_accuracy"
    assert objective_record(f"{user_objectives}:absolute", "regression") is Objective
    ranked = objective_record(f"{user_objectives}:Ranked", "regression")
    assert ranked.has_baselines and ranked.evaluation("regression").gate_metric == "test_spearman"
    config = load_config(None, [f"train.objective={user_objectives}:Ranked"])
    assert gate_rules(config, "regression").metric == "test_spearman"  # what the gate judges: the record's
    assert evaluation_of(config.train, "regression").headline == ("test_spearman",)
