"""ddpflow's plain-Python libraries, and the API a user's own training script imports.

    import ddpflow                       # in a training script (train.script, docs/scripts.md): milliseconds
    ddpflow.report({"test_accuracy": acc}); ddpflow.log_model(model, input_example=x)
    ddpflow.should_stop(); ddpflow.checkpoint_dir(); ddpflow.dataset("train"); ddpflow.params()

The layers around it:

    flows/     the Prefect flows and the ``ddpflow`` CLI (all argparse and printing)
    tasks/     Prefect task wrappers only: name a step, set retries and caching, log
    ddpflow/   plain Python, no Prefect: how ranks are launched (``launch``, Slurm in
               ``launch/slurm``), MLflow tracking and the registry gate (``tracking``),
               data drift's numbers (``drift``), the local servers (``services``:
               the stack, the Prefect server a command uses), run directories
               (``rundirs``), how a foreground command ends (``lifetime``), the
               source watch (``watch``), a training script's API (``script``). Testable without Prefect.
    training/  what every rank runs under torchrun (no Prefect, no MLflow at import)

Imports run one way: flows -> tasks -> ddpflow -> training
(tests/house/test_import_direction.py enforces it). No work at import time: the script API's
functions are imported when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

# The training script's API (ddpflow/script/): name -> the module that defines it.
SCRIPT_API = {
    "report": "ddpflow.script.reporting",
    "log_model": "ddpflow.script.export",
    "should_stop": "ddpflow.script.stopping",
    "checkpoint_dir": "ddpflow.script.run",
    "params": "ddpflow.script.run",
    "dataset": "ddpflow.script.data",
}
__all__ = list(SCRIPT_API)


def __getattr__(name: str) -> Any:
    if name in SCRIPT_API:
        return getattr(importlib.import_module(SCRIPT_API[name]), name)
    raise AttributeError(f"module 'ddpflow' has no attribute {name!r}")
