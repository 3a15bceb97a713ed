"""ddpflow's plain-Python libraries: the layer between the Prefect tasks and the ranks.

    flows/     the Prefect flows and the ``ddpflow`` CLI (all argparse and printing)
    tasks/     Prefect task wrappers only: name a step, set retries and caching, log
    ddpflow/   plain Python, no Prefect: how ranks are launched (``launch``, Slurm in
               ``launch/slurm``), MLflow tracking and the registry gate (``tracking``),
               data drift's numbers (``drift``), the local servers (``services``:
               the stack, the Prefect server a command uses), run directories
               (``rundirs``), how a foreground command ends (``lifetime``), the
               source watch (``watch``). Testable without Prefect.
    training/  what every rank runs under torchrun (no Prefect, no MLflow at import)

Imports run one way: flows -> tasks -> ddpflow -> training
(tests/house/test_import_direction.py enforces it). No work at import time.
"""
