"""Fixtures for tests/code: one Prefect harness per session (it costs ~10 s to start)."""

from __future__ import annotations

import sys
from pathlib import Path

# Stand-in ranks and their helpers live in tests/code/ranks (tests are not a package).
sys.path.insert(0, str(Path(__file__).parent / "ranks"))
