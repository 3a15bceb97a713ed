"""The local servers a project runs beside its runs (plain Python, no Prefect import).

    stack.py            ``ddpflow stack up/down/status``: the Prefect and MLflow servers, the work pool,
                        deployments and worker, recorded in .ddpflow/stack.json
    prefect_server.py   which Prefect server a CLI command talks to (an explicit URL, the stack's, or a
                        temporary one it starts and stops)
    scoring_server.py   ``ddpflow serve``: MLflow's scoring server for a registered model, owned until it stops

How the foreground command itself ends (signals, the parent's death) is ddpflow/lifetime.py.
"""
