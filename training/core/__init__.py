"""The bottom layer: the run's contracts and small utilities that every other folder may import.

The configuration (``config.py``, ``job.py``, ``topology.py``), the prepared dataset's table of contents
(``manifest.py``) and the run directory's file names (``layout.py``), the one atomic write and the one fsynced
line append (``fileio.py``), the one hash of a JSON payload (``digest.py``), the log prefixes, the per-rank
seeds, errors and metric directions. Nothing here imports another folder of ``training/``, and nothing here
imports torch at module level.
"""
