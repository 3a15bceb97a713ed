"""Two registrations of one model at once (the `manual` and `nightly` deployments) gate one at a time.

Real components: the session's Prefect test server (its global concurrency limit
is the lock tasks/register.py holds), one real SQLite MLflow store, real models.
The two registrations run on two threads. Each one, right after reading
@champion under the lock, waits (a few seconds at most) for the other to read it
too: without the lock both would read the same champion and the later alias
write would win; with it, the second can only read after the first moved its
aliases, so the wait times out and the order is strict.
"""

from __future__ import annotations

import contextvars
import os
import threading

from mlflow import MlflowClient
from prefect.client.orchestration import get_client

import tests.ddpflow.tracking.test_gate as gate_tests  # its evaluated_run: what the pipeline has before registering
from ddpflow.tracking.gate import GateDecision
from ddpflow.tracking.registration import GateHooks, register_candidate
from ddpflow.tracking.registry import find_alias
from tasks.register import gate_lock, gate_lock_name
from training.core.config import PipelineConfig

MODEL = "raced-model"
WAIT_FOR_THE_OTHER_S = 5.0  # how long a registration holding the lock waits for the other to read @champion


def test_two_registrations_at_once_end_with_the_better_model_as_champion(
    prefect_harness, mlflow_store, dataset_factory, model_factory
):
    uri, artifacts = mlflow_store
    config = PipelineConfig.model_validate(
        {"mlflow": {"tracking_uri": uri, "artifact_location": artifacts}, "registry": {"model_name": MODEL}}
    )
    dataset = dataset_factory()
    paths = {name: model_factory(dataset, name, steps=steps) for name, steps in (("weak", 3), ("medium", 15))}
    paths["strong"] = model_factory(dataset, "strong", steps=80)
    weak_run, weak_metrics = gate_tests.evaluated_run(config, dataset, paths["weak"], "weak")
    champion = register_candidate(config, weak_run, str(paths["weak"]), str(dataset), weak_metrics, uri)
    runs = {name: gate_tests.evaluated_run(config, dataset, paths[name], name) for name in ("medium", "strong")}
    accuracy = {name: metrics["test_accuracy"] for name, (_, metrics) in runs.items()}
    assert champion.candidate_value < accuracy["medium"] < accuracy["strong"], (champion, accuracy)

    events: list[tuple[str, str, str | None]] = []
    both_read = threading.Barrier(2)
    decisions: dict[str, GateDecision] = {}
    errors: list[BaseException] = []

    def registration(name: str) -> None:
        def champion_read(version: str | None) -> None:
            events.append(("read", name, version))
            try:
                both_read.wait(timeout=WAIT_FOR_THE_OTHER_S)
            except threading.BrokenBarrierError:
                pass  # the other is waiting for the lock: the gate is serialised

        hooks = GateHooks(champion_read=champion_read, before_aliases=lambda d: events.append(("move", name, None)))
        run_id, metrics = runs[name]
        try:
            decisions[name] = register_candidate(
                config, run_id, str(paths[name]), str(dataset), metrics, uri, gate_lock=gate_lock, hooks=hooks
            )
        except BaseException as error:
            errors.append(error)

    # Each thread runs in a copy of this context: it holds the Prefect test server's settings.
    uri_before = os.environ.get("MLFLOW_TRACKING_URI")
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(registration, name))
        for name in ("medium", "strong")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    # Overlapping registrations leave the process's tracking URI as they found it (later runs log elsewhere).
    assert os.environ.get("MLFLOW_TRACKING_URI") == uri_before

    # One at a time: each read of @champion is followed by that registration's own alias move.
    kinds = [(kind, name) for kind, name, _ in events]
    first, second = kinds[0][1], kinds[2][1]
    assert kinds == [("read", first), ("move", first), ("read", second), ("move", second)], events
    # The second read the champion the first left behind.
    after_first = decisions[first].version if decisions[first].decision == "promoted" else champion.version
    assert events[2][2] == after_first

    client = MlflowClient(uri)
    strong = decisions["strong"]
    assert strong.decision == "promoted"
    assert str(find_alias(client, MODEL, "champion").version) == strong.version
    # @previous-champion is the champion the winner replaced: medium if medium went first, else the weak one.
    replaced = decisions["medium"].version if first == "medium" else champion.version
    assert strong.champion_version == replaced
    assert str(find_alias(client, MODEL, "previous-champion").version) == replaced
    assert decisions["medium"].decision == ("promoted" if first == "medium" else "challenger")

    with get_client(sync_client=True) as prefect:
        limit = prefect.read_global_concurrency_limit_by_name(gate_lock_name(MODEL))
    assert limit.limit == 1 and limit.active and limit.active_slots == 0  # created on first use, released
