"""Checkpoints: ``last.pt`` and model.pt written atomically by rank 0, the resume rule and warm start
(``files.py``), and step checkpoints: their schedule, background writer and pruning (``steps.py``).
"""
