"""Developer tools for ddpflow's tests and benchmarks; not installed with the package.

Imported from the repository root (``python -m pytest``, ``python -m bench``; tests/conftest.py
puts the root on ``sys.path`` too). Nothing here is needed to run ddpflow.
"""
