"""One module per benchmark family, named as ``python -m bench --only NAME`` names it; each has
``run(ctx) -> list[Result]``. A family imports the harness, the workloads and bench/ddpflow_api.py, never
another family."""
