"""Waiting for an event in tests and dev tools: poll for the condition, never sleep a fixed time and hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """``condition()``'s first truthy value; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(interval_s)
