"""One stable 64-bit hash per value: the hashed kind's buckets and the row split (``prepare/split.py``) alike.

The hash is pandas' ``hash_array`` (SipHash with a fixed key for strings, a fixed integer mix for numbers):
stable across processes, runs and machines, unlike Python's ``hash``. Numbers are widened first (ints to int64,
floats to float64) so that ``3`` read from CSV and ``3`` read from Parquet as int32 hash alike.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# pandas is imported where a hash is taken, not here: every rank imports this module through the codecs, and
# pandas would add about 0.4 s of start-up to each rank of a run that has no id column.


def hash_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One stable uint64 per value of a key or label column."""
    if pa.types.is_dictionary(array.type):
        array = pc.cast(array, array.type.value_type)
    if pa.types.is_integer(array.type) or pa.types.is_boolean(array.type):
        values = pc.cast(array, pa.int64()).to_numpy(zero_copy_only=False)
    elif pa.types.is_floating(array.type) or pa.types.is_decimal(array.type):
        values = pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False)
    else:
        values = np.asarray(array.to_numpy(zero_copy_only=False), dtype=object)
    import pandas as pd

    return pd.util.hash_array(values, categorize=False)
