"""Checkpoints: ``last.pt`` and model.pt written atomically by rank 0, the resume rule and warm start
(``files.py``); what last.pt and a step checkpoint hold, built and restored (``state.py: TrainState``); and
step checkpoints: their schedule, background writer and pruning (``steps.py``).
"""
