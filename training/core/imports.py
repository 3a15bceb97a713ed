"""Importing a user's ``package.module:factory`` (train.model, train.objective): the one rule and its errors."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_factory(name: str, field: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``name`` points at; ``error`` naming ``field`` when it does not import or is not callable."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as problem:
        raise error(f"{field}: cannot import module {module_name!r} ({problem})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise error(f"{field}: {module_name!r} has no callable {attr!r}")
    return factory
