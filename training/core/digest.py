"""The one hash of a JSON payload: what names a dataset, a training, a watched config, a sweep's study, a scored
source and a node cache's manifest (``json_digest``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def json_digest(payload: Any, length: int = 16, *, compact: bool = True) -> str:
    """The first ``length`` hex digits of the sha256 of ``payload`` as JSON with sorted keys (a value JSON cannot
    hold written as its ``str``). ``compact=False`` writes JSON's default separators (", ", ": "): the spelling
    watched configs' keys, sweep studies' names and scored sources' fingerprints are stored under, so each
    keeps its value."""
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(payload, sort_keys=True, separators=separators, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
