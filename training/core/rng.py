"""A rank's random streams: the one per-rank seed rule, and the state a checkpoint carries."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

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
    torch.manual_seed(seed)
    random.seed(seed)


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams; plain tensors and tuples (no numpy) for weights_only loading."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
