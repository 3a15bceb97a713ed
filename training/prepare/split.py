"""Deterministic train/val/test assignment by a hash of each row.

A row's split depends only on the row itself (its key, or its content when
there is no key) and the two fractions, never on its position, the file it
came from or the rows around it. So appending rows never moves an old row to
another split, and a row in test can never land in train on a later run.

A value's hash is ``training/kinds/hashing.py: hash_values`` (stable across
processes, runs and machines, unlike Python's ``hash``); this module combines
them into row hashes and assigns the splits.
"""

from __future__ import annotations

import numpy as np

TRAIN, VAL, TEST = 0, 1, 2
_TOP_53_BITS = np.float64(2.0**-53)


def hash_rows(features: np.ndarray, label_hash: np.ndarray) -> np.ndarray:
    """One stable uint64 per row of a float64 feature matrix plus the label's hashes."""
    # -0.0 and 0.0 are the same value: hash them alike.
    features = features + 0.0
    import pandas as pd

    frame = pd.DataFrame(features, copy=False)
    frame["__label__"] = label_hash
    return pd.util.hash_pandas_object(frame, index=False, categorize=False).to_numpy()


def combine_hashes(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """One stable uint64 per row from two per-row hashes (order matters)."""
    import pandas as pd

    frame = pd.DataFrame({"a": first, "b": second}, copy=False)
    return pd.util.hash_pandas_object(frame, index=False, categorize=False).to_numpy()


def assign_splits(hashes: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    """TRAIN/VAL/TEST code per row: the hash's top 53 bits as a uniform number in [0, 1)."""
    uniform = (hashes >> np.uint64(11)).astype(np.float64) * _TOP_53_BITS
    codes = np.full(hashes.shape, TRAIN, dtype=np.int8)
    codes[uniform < test_fraction + val_fraction] = VAL
    codes[uniform < test_fraction] = TEST
    return codes
