"""The contract of an input kind: ``Codec`` (observed at prepare, fitted on the train split, then the ONE
encoding of raw columns into the tensors a model sees) and ``plain``, the one way a raw Arrow column is read.

The built-in kinds implement it beside this module (``tabular.py``, ``image.py``, ``text.py``); the registry
(``registry.py``) names them. A kind imports this module, never the registry.

A codec class is the kind's one record: every per-kind decision of the code around it is an attribute or a
method here (its options, the column it takes, the node cache section, the batch tensor, drift, serving, the
built-in model's block, how evaluation shows its wrong rows), so nothing outside asks for the kind by name
(tests/house/test_kind_dispatch.py). docs/models.md: "Adding an input kind".
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


# The blocks of the built-in models (training/models/) an input can feed: which one is the kind's
# ``model_block``. A new kind whose batch tensor is one of these shapes feeds the built-in models unchanged.
SCALAR = "scalar"  # a column of the float32 numeric block (normalised; the MLP's first block)
EMBEDDING = "embedding"  # int64 indices [B] into an embedding of ``cardinality`` rows
DENSE = "dense"  # float32 [B, D], concatenated as it is
PIXELS = "pixels"  # float32 [B, C, H, W]: the image model's CNN trunk
TOKENS = "tokens"  # int64 token ids [B, L] and a mask: the transformer's encoder (and next_token's input)
MODEL_BLOCKS = (SCALAR, EMBEDDING, DENSE, PIXELS, TOKENS)

# How scikit-learn's reference model takes an input (``Codec.reference_column``).
NUMBER = "number"  # its raw values (``raw``: a null is NaN, boosting takes missing values natively)
CATEGORY = "category"  # ``encode``'s index, a category
NUMBERS = "numbers"  # several numbers per row (``reference_values``, ``reference_width`` columns; a null NaN)

# How evaluation shows a classifier's wrong rows of an input (``Codec.shown_as``, ``Codec.shown_values``).
PICTURES = "pictures"  # the first misclassified rows' bytes, drawn as a grid (ddpflow/tracking/plots.py)
TABLE = "table"  # a column of the most confidently wrong rows' table (training/inference/wrong_rows.py)


class Codec:
    kind = ""
    # data.inputs.<name>'s options this kind takes (``options_from`` checks them and fills the defaults).
    option_names: tuple[str, ...] = ()
    # The built-in model block the input feeds (one of MODEL_BLOCKS; None: no built-in model takes it).
    model_block: str | None = None
    # How the drift report compares the kind's ``drift_stats`` (ddpflow/drift/report.py: DRIFT_MEASURES);
    # None: nothing beyond the numeric histograms.
    drift_measure: str | None = None
    # How scikit-learn's reference model takes the input (training/inference/reference.py): NUMBER, CATEGORY or
    # NUMBERS; None: not a table column, no reference.
    reference_column: str | None = None
    # How evaluation shows a classifier's wrong rows of this input (PICTURES, TABLE; None: not shown).
    shown_as: str | None = None
    # Whether the split's row hash reads the encoded values (``encode``) rather than the raw ones.
    hashes_encoded = False
    # Whether a fitted state is stored for it in encoders.json (a numeric input's may be missing: before
    # PREPARE_VERSION 5).
    needs_state = True
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
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``data.inputs.<name>``'s options (those given, not None) checked, with the defaults filled in: what
        the codec is built from and the dataset fingerprint hashes. ValueError for an option the kind does not
        take or a value it refuses (``check_inputs`` names the input)."""
        unknown = sorted(set(given) - set(cls.option_names))
        if unknown:
            raise ValueError(f"kind {cls.kind!r} takes no option {unknown}")
        return dict(given)

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

    def orders_the_split(self) -> None:
        """Prepare's word, before ``fit_train_column``, that a time split is by this input's column
        (``data.split: {by: time}``): its val and test rows, and the rows served after training, come after every
        train row's time."""

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
        """What drift compares for this input (ddpflow/drift/), from the train split; None: nothing beyond
        the numeric histograms. Written to the manifest's ``extra["drift_stats"]["inputs"]`` at prepare."""
        return None

    # ------------------------------------------------------------------ drift of a scored table

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any] | None:
        """The drift statistics of rows a batch scoring scored (on the model's fitted codec), in a form that
        ``merge_drift_stats`` merges over a rank's batches and parts and ``reported_drift_stats`` turns into what
        prepare writes for a train split (``drift_stats``; a numeric input: its mean, std and histogram), so a
        scored table is compared with the model's training data by the same measure. None: nothing to compare
        (a hashed id; a kind without a measure)."""
        return None

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """Two ``scored_drift_stats`` over parts of the rows as one over all of them."""
        raise NotImplementedError(f"kind {cls.kind!r} keeps no drift statistics of scored rows")

    @classmethod
    def reported_drift_stats(cls, stats: dict[str, Any]) -> dict[str, Any]:
        """Merged ``scored_drift_stats`` as the drift report reads them (most kinds: as they are)."""
        return stats

    def info(self) -> InputInfo:
        return InputInfo(
            self.name, self.kind, self.dtype, self.shape(), self.cardinality(), self.options, self.ragged_dtype
        )

    @classmethod
    def shown_values(cls, array: pa.Array, name: str) -> list[Any]:
        """Input ``name``'s rows as evaluation shows them (``shown_as``): encoded bytes for pictures, text for a
        table."""
        return plain(array).to_pylist()

    @classmethod
    def serving_example(cls, values, source_type: str | None):
        """A pandas Series of the input's values as a served model's example row holds them (its signature is
        inferred from it); ``source_type``: the column's Arrow type in the source (``model.pt``'s
        ``source_types``). Most kinds: as they are."""
        return values

    @classmethod
    def declared_any(cls, source_type: str | None, info: InputInfo) -> bool:
        """Whether the served signature declares the input ``any`` instead of the type MLflow infers from its
        example (``serving_example``): where MLflow's own type would refuse values the model takes. Most kinds:
        no."""
        return False

    def reference_values(self, array: pa.Array) -> np.ndarray:
        """A NUMBERS kind's rows as the reference takes them: float64 ``[rows, reference_width()]``, a null NaN."""
        raise NotImplementedError

    def reference_width(self) -> int:
        """How many columns ``reference_values`` gives (a NUMBERS kind)."""
        raise NotImplementedError

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
