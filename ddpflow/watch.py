"""Watching a data source for new data: what a look at it saw, and whether that changed (no Prefect here).

    sighting = look_at_source(config)                 # a listing only: no file is opened
    change = compare_sightings(previous, sighting)    # FIRST, UNCHANGED or CHANGED

A sighting is the fingerprint prepare would give the data now
(``training/prepare/dataset.py: fingerprint_from_listing``: the source's identity, i.e. its
files' names, sizes and modification times or ETags, plus the data settings), with
a file count and byte total for people. So "changed" means exactly "prepare would
build a new dataset": an appended row, a new or edited file, another data setting.

flows/watch_data.py keeps the last sighting per config in a Prefect Variable
(``variable_name``) and emits the event ``ddpflow.data.changed`` (``event_resource``,
``event_payload``) when it changed. The first sighting of a config has nothing to
differ from: it is recorded and nothing is emitted.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from training.core.config import PipelineConfig
from training.core.digest import json_digest
from training.prepare.dataset import fingerprint_from_listing

EVENT = "ddpflow.data.changed"
VARIABLE_PREFIX = "ddpflow-watch-"
FIRST, UNCHANGED, CHANGED = "first", "unchanged", "changed"


@dataclass(frozen=True)
class Sighting:
    """One look at a source: the fingerprint prepare would give it, and its size for people."""

    fingerprint: str
    source: str
    files: int | None  # None for a synthetic source
    bytes: int | None
    seen_at: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def look_at_source(config: PipelineConfig) -> Sighting:
    identity, fingerprint = fingerprint_from_listing(config.data)
    files = identity.get("files")
    return Sighting(
        fingerprint=fingerprint,
        source=config.data.source,
        files=len(files) if files is not None else None,
        bytes=sum(int(size) for _, size, _ in files) if files is not None else None,
        seen_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def compare_sightings(previous: dict[str, Any] | None, current: Sighting) -> str:
    """FIRST (nothing recorded for this config), UNCHANGED (same fingerprint) or CHANGED."""
    if not previous or "fingerprint" not in previous:
        return FIRST
    return UNCHANGED if previous["fingerprint"] == current.fingerprint else CHANGED


def config_key(config_file: str | None, overrides: list[str] | None) -> str:
    """What identifies a watched config: the parameters a training run will be given."""
    return json_digest({"config_file": config_file, "overrides": list(overrides or [])}, compact=False)


def variable_name(config_file: str | None, overrides: list[str] | None) -> str:
    """``ddpflow-watch-<config file stem>-<hash of the parameters>``: letters, digits, '-' and '_' only."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(config_file).stem if config_file else "defaults").strip("-")
    return f"{VARIABLE_PREFIX}{stem[:64] or 'config'}-{config_key(config_file, overrides)}"


def event_resource(sighting: Sighting, config_file: str | None, overrides: list[str] | None) -> dict[str, str]:
    """The event's resource: the source, and the config that watches it (every value a string)."""
    source_id = hashlib.sha256(sighting.source.encode()).hexdigest()[:16]
    return {
        "prefect.resource.id": f"ddpflow.source.{source_id}",
        "prefect.resource.name": sighting.source,
        "ddpflow.source": sighting.source,
        "ddpflow.config": config_file or "",
        "ddpflow.config_key": config_key(config_file, overrides),
        "ddpflow.fingerprint": sighting.fingerprint,
    }


def event_payload(
    previous: dict[str, Any], current: Sighting, config_file: str | None, overrides: list[str] | None
) -> dict[str, Any]:
    """The old and new sighting, and the parameters a training run needs (the deployment trigger passes them on)."""
    return {
        "config_file": config_file,
        "overrides": list(overrides or []),
        "previous": previous,
        "current": current.to_dict(),
    }
