"""Prefect task: register the candidate behind the champion gate.

The work, its order and its guarantees are in ddpflow/tracking/registration.py
(plain Python). This wrapper adds what only Prefect can give:
- the gate lock: a Prefect global concurrency limit ``ddpflow-gate-<model>``
  (limit 1, created on first use), so two flow runs registering the same model
  (the ``manual`` and ``nightly`` deployments, on any worker) gate one at a time.
  The limit is read first and created only when absent: a create that collides
  with an existing name makes the Prefect server log a ~140-line
  ``IntegrityError`` traceback (its 409 handler logs every conflict) on
  every repeat run;
- retries (3) of transient MLflow errors only, and the run logger.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.concurrency.sync import concurrency
from prefect.events import emit_event
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from ddpflow.tracking.gate import PROMOTED
from ddpflow.tracking.registration import register_candidate
from ddpflow.tracking.registry import is_transient
from training.core.config import PipelineConfig

GATE_LOCK_PREFIX = "ddpflow-gate-"
# Waiting longer than this for another registration of the same model fails the attempt (TimeoutError is
# retried). A holder that died frees the slot when its lease (5 min, renewed while it lives) runs out.
GATE_LOCK_TIMEOUT_S = 1800.0


def gate_lock_name(model_name: str) -> str:
    """``ddpflow-gate-<model>``; characters Prefect refuses in names ('/', '%', '&', '<', '>') become '-'."""
    return GATE_LOCK_PREFIX + re.sub(r"[/%&<>]", "-", model_name)


@contextmanager
def gate_lock(model_name: str) -> Iterator[None]:
    """Hold the model's gate lock: one slot of a Prefect global concurrency limit, across processes and workers."""
    name = gate_lock_name(model_name)
    _ensure_limit(name)
    # strict: a limit that vanished raises instead of silently running unserialised.
    with concurrency(name, occupy=1, timeout_seconds=GATE_LOCK_TIMEOUT_S, strict=True):
        yield


def _ensure_limit(name: str) -> None:
    """Reuse the limit, or create it (1 slot) when absent; put back one that someone disabled or widened.

    Read before create: Prefect has no atomic upsert, and its server logs a traceback for every create that
    hits the name's unique constraint. Only two first registrations of one model at the same moment can
    still race to create it; the loser's create then fails with ObjectAlreadyExists and it reads the winner's.
    """
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                return
            except ObjectAlreadyExists:  # created a moment ago by a concurrent first registration
                existing = client.read_global_concurrency_limit_by_name(name)
        if existing.limit != 1 or not existing.active:
            logging.getLogger(__name__).warning(
                "concurrency limit %s had limit=%s active=%s; the gate needs 1 slot: reset",
                name,
                existing.limit,
                existing.active,
            )
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=1, active=True))


def retry_on_transient_error(task_, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry MLflow hiccups, not deterministic errors."""
    try:
        error = state.result(raise_on_failure=False)
    except BaseException as raised:
        error = raised
    return is_transient(error if isinstance(error, BaseException) else None)


# NO_CACHE: a side effect, never to be skipped by a cache hit; retries are safe because the step is idempotent.
@task(
    name="register-model",
    task_run_name="register-{run_id}",
    retries=3,
    retry_delay_seconds=[2, 5, 15],
    retry_condition_fn=retry_on_transient_error,
    cache_policy=NO_CACHE,
)
def register_model(
    config: PipelineConfig, run_id: str, model_path: str, dataset_dir: str, metrics: dict[str, float], tracking_uri: str
) -> dict[str, Any]:
    """Register the candidate and apply the champion gate; returns the decision as a dict (``GateDecision``)."""
    decision = register_candidate(
        config,
        run_id,
        model_path,
        dataset_dir,
        metrics,
        tracking_uri,
        logger=get_run_logger(),
        gate_lock=gate_lock,
    )
    if decision.decision == PROMOTED:  # a retry that finds it done emits again: re-scoring a complete output is a no-op
        announce_new_champion(decision)
    return decision.to_dict()


CHAMPION_MOVED = "ddpflow.champion.moved"  # score-pipeline/score-on-new-champion has a trigger on it (prefect.yaml)


def announce_new_champion(decision) -> None:
    """Emit ``ddpflow.champion.moved`` (resource ``ddpflow.model.<name>``): @champion now names this version."""
    event = emit_event(
        event=CHAMPION_MOVED,
        resource={"prefect.resource.id": f"ddpflow.model.{decision.model_name}", "ddpflow.model": decision.model_name},
        payload={"model": decision.model_name, "version": decision.version, "previous": decision.champion_version,
                 "run_id": decision.run_id},
    )  # fmt: skip
    log = get_run_logger()
    if event is None:
        log.warning(
            "%s was not emitted (Prefect events are off here): no scoring follows the new champion", CHAMPION_MOVED
        )
    else:
        log.info("emitted %s: %s v%s", CHAMPION_MOVED, decision.model_name, decision.version)
