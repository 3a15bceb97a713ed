"""The contract of an input kind: ``Codec`` (observed at prepare, fitted on the train split, then the ONE
encoding of raw columns into the tensors a model sees) and ``plain``, the one way a raw Arrow column is read.

The built-in kinds implement it beside this module (``tabular.py``, ``image.py``, ``text.py``); the registry
(``registry.py``) names them. A kind imports this module, never the registry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.core.errors import DataError
from training.kinds.inputs import InputInfo


def plain(array: pa.Array) -> pa.Array:
    """Dictionary columns as their values, string views as strings, chunked arrays as one array."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = pc.cast(array, array.type.value_type)
    if pa.types.is_string_view(array.type) or pa.types.is_large_string(array.type):
        array = pc.cast(array, pa.string())
    return array


class Codec:
    kind = ""
    dtype = "float32"  # the batch tensor's dtype
    # A ragged kind (text, images) sets the dtype of its stored values and implements ``encode_ragged`` and
    # ``collate`` instead of ``encode``: rows of any length in the node cache, a batch tensor per batch.
    ragged_dtype: str | None = None
    # Whether a batch of the kind is decoded per batch and worth DataLoader workers (``train.num_workers: auto``).
    decodes_in_workers = False
    # Whether prepare hands the kind the train split's whole column once, read back from its shards
    # (``fit_train_column``), for statistics a stream of batches cannot give exactly (quantiles).
    reads_train_column = False
    # Whether drift statistics need the train rows' values (``drift_update``) beyond what ``observe`` keeps.
    drift_reads_rows = False
    # The built-in model ``train.model: auto`` picks when an input is of this kind (None: the tabular ``mlp``);
    # with inputs of several such kinds, the lowest ``default_model_rank`` wins.
    default_model: str | None = None
    default_model_rank = 0
    # What the served model needs installed beyond torch, mlflow, pandas, numpy and pyarrow (pip names).
    serving_packages: tuple[str, ...] = ()
    # The source column types the kind takes (prepare's column check) and how an error says so.
    takes_what = ""

    @staticmethod
    def takes(kind: pa.DataType) -> bool:
        return False

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        self.name, self.options = name, dict(options or {})

    @classmethod
    def user_file_sha256(cls, options: dict[str, Any]) -> str | None:
        """The sha256 of a file of the user's that these options name and the prepared output depends on (the
        dataset fingerprint adds it: a new file's content is a new dataset); None when there is none."""
        return None

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        """The shard column's type: the validated raw values."""
        return source_type

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        """Which rows prepare may keep (bool per row)."""
        return np.ones(len(array), dtype=bool)

    def invalid_error(self, where: str, array: pa.Array, ok: np.ndarray) -> DataError | None:
        """The error naming the first invalid row, for a kind whose invalid rows need more than a count."""
        return None

    def stored_values(self, array: pa.Array) -> pa.Array:
        """The validated column as the shard stores it (an image struct's bytes); most kinds: as it is."""
        return array

    def observe(self, array: pa.Array) -> None:
        """Train rows only, batch by batch."""

    def fit_train_column(self, array: pa.Array) -> None:
        """The train split's whole stored column (only when ``reads_train_column``), after ``observe``."""

    def fit(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        """The fitted state back (``fit()``'s value)."""

    def shape(self) -> tuple[int, ...]:
        return ()

    def cardinality(self) -> int | None:
        return None

    def drift_update(self, array: pa.Array) -> None:
        """Train rows for the drift statistics (only when ``drift_reads_rows``)."""

    def drift_stats(self) -> dict[str, Any] | None:
        """What drift compares for this input (ddpflow/drift.py), from the train split; None: nothing beyond
        the numeric histograms. Written to the manifest's ``extra["drift_stats"]["inputs"]`` at prepare."""
        return None

    def info(self) -> InputInfo:
        return InputInfo(
            self.name, self.kind, self.dtype, self.shape(), self.cardinality(), self.options, self.ragged_dtype
        )

    def encode(self, array: pa.Array) -> np.ndarray:
        """A fixed-shape kind's rows as the batch tensor's values, ``[rows, *shape]`` of ``dtype``."""
        raise NotImplementedError

    def encode_ragged(self, array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """A ragged kind's rows as (values, flat, of ``ragged_dtype``; lengths, int64 [rows]): what the node cache
        stores (an image's original bytes, a text's token ids), computed once per dataset."""
        raise NotImplementedError

    def collate(self, values, offsets, context) -> dict[str, Any]:
        """A ragged kind's gathered rows (``values``, int64 ``offsets`` [B + 1]) -> its batch-dict entries
        (tensors ``[B, ...]``); ``context`` is a ``training.kinds.ragged.BatchContext``."""
        raise NotImplementedError
