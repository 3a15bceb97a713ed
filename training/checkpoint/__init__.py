"""Checkpoints: what last.pt and a step checkpoint hold (``TrainState``, the RNG streams among them) and how rank 0
writes them and model.pt (atomic; step checkpoints in the background, pruned), reads the one a run continues and
a warm start (``files.py``); the resume rule, which training a run is (``identity.py: training_identity``).
"""
