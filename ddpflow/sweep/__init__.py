"""Hyperparameter sweeps: one prepared dataset, each trial a real DDP run, Optuna for sampling and
pruning, the best trial alone through the test split and the gate (plain Python, no Prefect; docs/sweeps.md).

    space.py    the ``sweep:`` section and every check that refuses it before anything starts
    study.py    the Optuna study: SQLite storage in the sweep's directory, sampler, pruner, resume
    pruning.py  rank 0's per-epoch line -> the pruner -> a verdict every rank obeys at the epoch boundary
    trials.py   one trial: its config, run directory, MLflow child run, launch, and what Optuna is told
"""
