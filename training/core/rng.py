"""A rank's random streams: the one per-rank seed rule, one row's seed, and the seeding of a process. The state
of the streams that a checkpoint carries is training/checkpoint/files.py's (``capture_rng``, ``RankStreams``)."""

from __future__ import annotations

import hashlib
import random

RANK_STRIDE = 1000  # rank r's seeds start at seed + 1000 * (r + 1): apart from the shared seed and each other


def rank_seed(seed: int, rank: int, epoch: int = 0) -> int:
    """The seed of ``rank``'s own streams (dropout masks, ...) from ``epoch`` on: different per rank, reproducible."""
    return seed + RANK_STRIDE * (rank + 1) + epoch


def row_seed(seed: int, epoch: int, row: int) -> int:
    """The seed of one row's random draws in one epoch (an image's crop and flip): a function of the three
    alone, not of the rank, world size or worker that draws them, so a row gets the same view everywhere."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch.Generator takes a non-negative 63-bit seed


def seed_process(seed: int) -> None:
    """Seed the streams a rank draws from: torch's and Python's."""
    import torch  # here, not at the top: nothing in training/core/ imports torch at module level

    torch.manual_seed(seed)
    random.seed(seed)
