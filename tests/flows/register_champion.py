"""The pipeline's register task (tasks/register.py: ``register_model``: the gate, the registration and the
``ddpflow.champion.moved`` event when @champion moves) in a flow of its own, against the Prefect server
PREFECT_API_URL names, for a run that trained and evaluated already. The deployment tests run it as a process.

    python tests/flows/register_champion.py '{"config": {...}, "run_id": ..., "model_path": ..., "dataset": ...,
                                              "metrics": {...}, "tracking_uri": ..., "other_model": "NAME"}'

``other_model``: first, the event a promotion of that model emits (a stand-in decision), which the project's
score-on-new-champion trigger must not follow. Prints the register task's decision as JSON.
"""

from __future__ import annotations

import json
import sys

from prefect import flow


@flow(name="register-champion")
def register_champion(request: dict) -> dict:
    from ddpflow.tracking.gate import GateDecision
    from tasks.register import announce_new_champion, register_model
    from training.core.config import PipelineConfig

    other = GateDecision("promoted", "stand-in", request["other_model"], "other-run", "test_accuracy", True, 0.9,
                         version="1")  # fmt: skip
    announce_new_champion(other)
    config = PipelineConfig.model_validate(request["config"])
    return register_model(config, request["run_id"], request["model_path"], request["dataset"], request["metrics"],
                          request["tracking_uri"])  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(register_champion(json.loads(sys.argv[1]))))
