"""The ``watch-data`` flow: notice new data in a config's source and tell Prefect, cheaply and often.

Deployed as ``watch-data/every-10-minutes`` (prefect.yaml). Each run lists the
source (``ddpflow/watch.py``: the fingerprint prepare would give it, from file names,
sizes and modification times or ETags; no file is opened), compares it with what
the last run saw for the same parameters (a Prefect Variable,
``ddpflow-watch-<config>-<hash>``), and when it differs emits the event
``ddpflow.data.changed``; the deployment ``train-pipeline/on-new-data`` has a trigger
on that event and trains with the same ``config_file`` and ``overrides``.

The first run for a config only records what it saw: "changed" needs something to
differ from (the nightly, or a manual run, trains the data that is already there).
The Variable is written only after the event is emitted, so a run that fails in
between emits again next time rather than never.

Parameters: ``config_file`` and ``overrides``, as ``train-pipeline`` takes them.
Returns ``{"change": "first" | "unchanged" | "changed", "variable", "previous", "current"}``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.events import emit_event
from prefect.variables import Variable

from ddpflow.watch import (
    CHANGED,
    EVENT,
    UNCHANGED,
    compare_sightings,
    event_payload,
    event_resource,
    look_at_source,
    variable_name,
)
from flows.params import resolve_config


class EventNotSent(RuntimeError):
    """Prefect did not take the event (events are off for this client); the change stays unrecorded."""


@flow(name="watch-data", log_prints=True)
def watch_data(config_file: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Emit ``ddpflow.data.changed`` when the config's source differs from the last look at it."""
    logger = get_run_logger()
    config = resolve_config(None, config_file, overrides)
    sighting = look_at_source(config)
    name = variable_name(config_file, overrides)
    previous = Variable.get(name, default=None)
    change = compare_sightings(previous, sighting)
    if change == CHANGED:
        resource = event_resource(sighting, config_file, overrides)
        payload = event_payload(previous, sighting, config_file, overrides)
        if emit_event(event=EVENT, resource=resource, payload=payload) is None:
            raise EventNotSent(f"{EVENT} for {sighting.source} was not emitted: Prefect events are disabled here")
        logger.info(
            "%s changed: fingerprint %s -> %s (%s files, %s bytes); emitted %s",
            sighting.source,
            previous.get("fingerprint"),
            sighting.fingerprint,
            sighting.files,
            sighting.bytes,
            EVENT,
        )
    elif change == UNCHANGED:
        logger.info(
            "%s unchanged since %s (fingerprint %s)", sighting.source, previous.get("seen_at"), sighting.fingerprint
        )
    else:
        logger.info(
            "%s seen for the first time by %s: fingerprint %s recorded", sighting.source, name, sighting.fingerprint
        )
    if change != UNCHANGED:
        Variable.set(name, sighting.to_dict(), tags=["ddpflow", "watch-data"], overwrite=True)
    return {"change": change, "variable": name, "previous": previous, "current": sighting.to_dict()}
