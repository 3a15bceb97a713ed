"""Each input kind's name is dispatched on in at most ``MAX_MODULES`` modules (one record per kind).

What a kind does is asked of its record (``training/kinds/base.py: Codec``, registered in
``training/kinds/registry.py``), not decided by comparing its name. The rule this test counts, per built-in
kind name (``training.core.config.INPUT_KINDS``), over the product's modules (flows, tasks, ddpflow,
training): a module dispatches on a kind's name when the name, as a string literal,

- is compared (an operand of ``==``, ``!=``, ``in``, ``not in``, ``is``, directly or as an element of a
  tuple, list or set operand: ``kind == "image"``, ``kind in ("text", "image")``);
- is a key of a dict literal (``{"text": ...}``: a table by kind) or a subscript (``table["text"]``), or the
  key looked up with ``.get``/``.pop``/``.setdefault``;
- is a ``match`` case (``case "text":``);
- is an element of a tuple, list or set literal kept under a name or in a ``Literal[...]`` (a hand-kept list
  of kinds: ``EMBEDDED = ("categorical", "hashed")``), or assigned alone to a name other than a record's own
  ``kind`` (an alias: ``TEXT = "text"``).

Not counted: docstrings, log and error text (f-strings included), a call's arguments (constructing a record
by name: ``make_codec(name, "numeric")``, ``InputInfo(kind="numeric")``) and the record's own
``kind = "numeric"``. A module that only names a kind in words is free to; one that branches on it is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

from training.core.config import INPUT_KINDS

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "ddpflow", "training")
MAX_MODULES = 3
LOOKUP_METHODS = {"get", "pop", "setdefault"}


def _literals(node: ast.AST) -> list[str]:
    """The string constants of ``node`` itself or, for a tuple/list/set, of its elements."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [elt.value for elt in node.elts if isinstance(elt, ast.Constant) and isinstance(elt.value, str)]
    return []


def dispatched_names(source: str, filename: str = "<source>") -> set[str]:
    """Every string that ``source`` dispatches on, by the rule in this module's docstring."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found.update(_literals(operand))
        elif isinstance(node, ast.Dict):
            found.update(value for key in node.keys if key is not None for value in _literals(key))
        elif isinstance(node, ast.Subscript):
            found.update(_literals(node.slice))
        elif isinstance(node, ast.MatchValue):
            found.update(_literals(node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in LOOKUP_METHODS:
                found.update(_literals(node.args[0]))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node.value, (ast.Tuple, ast.List, ast.Set)) or not all(
                isinstance(t, ast.Name) and t.id == "kind" for t in targets
            ):
                found.update(_literals(node.value))
    return found


def dispatch_modules() -> dict[str, list[str]]:
    """kind name -> the product modules (paths from the repository root) that dispatch on it."""
    modules: dict[str, list[str]] = {kind: [] for kind in INPUT_KINDS}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            names = dispatched_names(path.read_text(), str(path))
            for kind in INPUT_KINDS:
                if kind in names:
                    modules[kind].append(str(path.relative_to(REPO)))
    return modules


def test_each_kind_name_is_dispatched_on_in_at_most_three_modules():
    over = {kind: paths for kind, paths in dispatch_modules().items() if len(paths) > MAX_MODULES}
    assert not over, (
        f"a kind's name is dispatched on in more than {MAX_MODULES} modules; ask its record "
        f"(training/kinds/base.py: Codec) instead: {over}"
    )


def test_the_rule_counts_dispatch_and_not_words():
    counted = """
if info.kind == "image": pass
if kind in ("text", "vector"): pass
table = {"numeric": 1}
x = table["categorical"]
y = options.get("hashed")
match kind:
    case "audio": pass
EMBEDDED = ("emb1", "emb2")
ALIAS = "alias"
"""
    assert dispatched_names(counted) == {
        "image", "text", "vector", "numeric", "categorical", "hashed", "audio", "emb1", "emb2", "alias"
    }  # fmt: skip
    ignored = '''
"""The text kind: docstring."""
class TextCodec:
    """A docstring naming image and text."""
    kind = "text"
log.info(f"{n} text inputs")
codec = make_codec(name, "numeric")
info = InputInfo(name, kind="vector", dtype="float32")
raise ValueError("kind 'hashed' needs buckets")
'''
    assert dispatched_names(ignored) == set()


def test_the_image_and_text_kinds_own_their_options():
    """Their options, types, defaults and checks are in their own modules (``ImageOptions``, ``TextOptions``);
    training/core/config.py keeps an input's kind and the options it does not know as given."""
    from training.core.config import InputSpec
    from training.kinds.image import IMAGE_OPTIONS, ImageCodec
    from training.kinds.text import TEXT_OPTIONS, TextCodec

    assert ImageCodec.option_names == IMAGE_OPTIONS == ("size", "channels", "mean", "std", "augment")
    assert TextCodec.option_names == TEXT_OPTIONS == ("max_len", "tokenizer")
    declared = set(InputSpec.model_fields) & {*IMAGE_OPTIONS, *TEXT_OPTIONS}
    assert declared == set(), f"training/core/config.py declares the image and text kinds' options {declared}"
    source = (REPO / "training" / "core" / "config.py").read_text()
    assert "TokenizerSpec" not in source and "crop_flip" not in source
