"""The prefixes of a rank's log lines, and how a line writes a size, in one place.

Rank code prints through ``log_main``/``log_rank``; tests and bench/ match
lines by these constants, never by literals.
"""

from __future__ import annotations

TRAIN = "[train]"  # what the training program says (rank 0, or the rank a fault hit)
DATA = "[data]"  # how each rank got its splits (the node cache)


def log_rank(message: str, prefix: str = TRAIN) -> None:
    """A line from this rank, whichever rank it is."""
    print(f"{prefix} {message}", flush=True)


def log_main(is_main: bool, message: str, prefix: str = TRAIN) -> None:
    """A line from rank 0 only: what every rank would say alike."""
    if is_main:
        log_rank(message, prefix)


def byte_size(count: int) -> str:
    """A size in bytes as a log line writes it: kB below 1e6, MB below 1e9, else GB."""
    if count < 1e6:
        return f"{count / 1e3:,.1f} kB"
    return f"{count / 1e6:,.1f} MB" if count < 1e9 else f"{count / 1e9:,.2f} GB"
