"""One codec per input kind: observed at prepare, fitted on the train split, then the ONE encoding of raw
columns into the tensors a model sees. The node cache build (training/loading/batches.py), evaluation
(training/inference/evaluate.py) and serving (training/inference/predict.py) all call ``encode``, so they agree
by construction.

    codec = make_codec("country", "categorical", {"min_count": 1})
    codec.observe(train_column)          # prepare, train rows only, batch by batch
    state = codec.fit()                  # JSON-able; saved in <dataset>/encoders.json (sha256 in the manifest)
    codec = codec_from_state("country", entry)
    codec.encode(pa_array) -> numpy      # [rows, *shape] of the input's dtype

What each kind guarantees (docs/data.md):
- numeric: float32, null -> NaN (prepare drops or refuses it); normalised by training/kinds/normalisation.py.
- categorical: int64 index; 0 = null, 1 = unknown (a value not in the vocabulary: unseen, or rarer than
  ``min_count``, or cut by ``max_size``), 2.. = the vocabulary, ordered by train count (descending), then value.
- hashed: int64 index; 0 = null, 1 + (a stable 64-bit hash of the value mod ``buckets``) otherwise. The hash is
  pandas' SipHash with a fixed key (training/prepare/split.py: ``hash_values``; integers as int64, floats as
  float64, strings as UTF-8): the same value gets the same bucket in every process and on every machine.
- vector: float32 ``[rows, D]``, D the length of the source's first non-null row; any other length, a null
  row or a non-finite element is invalid (data.on_invalid). Vectors are not normalised.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.core.errors import DataError
from training.kinds.inputs import InputInfo
from training.prepare.split import hash_values

ENCODERS_FILE = "encoders.json"
NULL_INDEX, UNKNOWN_INDEX = 0, 1  # categorical; hashed uses 0 for null only
# A categorical column with more distinct train values than this share of its rows looks like an id.
ID_LIKE_SHARE = 0.9
ID_LIKE_MIN_ROWS = 50  # below this many rows the share says nothing


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

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        self.name, self.options = name, dict(options or {})

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

    def fit(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        """The fitted state back (``fit()``'s value)."""

    def shape(self) -> tuple[int, ...]:
        return ()

    def cardinality(self) -> int | None:
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


class NumericCodec(Codec):
    kind = "numeric"

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.float32()

    def encode(self, array: pa.Array) -> np.ndarray:
        """float32; null -> NaN, beyond float32 -> inf (both invalid to prepare)."""
        array = plain(array)
        if not pa.types.is_floating(array.type) or array.null_count:
            array = pc.fill_null(pc.cast(array, pa.float64()), np.nan)
        with np.errstate(over="ignore", invalid="ignore"):
            return array.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        return np.isfinite(self.encode(array))


class CategoricalCodec(Codec):
    kind = "categorical"
    dtype = "int64"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, {"min_count": 1, **(options or {})})
        self._counts: list[pa.Table] = []
        self.observed_rows = 0
        self.vocabulary: pa.Array | None = None

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return plain(pa.array([], type=source_type)).type

    def observe(self, array: pa.Array) -> None:
        array = plain(array)
        self.observed_rows += len(array) - array.null_count
        counts = pc.value_counts(array.drop_null()).flatten()
        self._counts.append(pa.table({"value": counts[0], "count": counts[1]}))
        if len(self._counts) > 32:  # keep the pending tables few however many batches
            self._counts = [self._merged()]

    def _merged(self) -> pa.Table:
        if not self._counts:
            return pa.table({"value": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
        table = pa.concat_tables(self._counts)
        return table.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])

    def fit(self) -> dict[str, Any]:
        counts = self._merged()
        if self.observed_rows >= ID_LIKE_MIN_ROWS and counts.num_rows > ID_LIKE_SHARE * self.observed_rows:
            raise DataError(
                f"categorical input {self.name!r}: {counts.num_rows} distinct values in {self.observed_rows} "
                "train rows; "
                f"it looks like an id: use {{kind: hashed, buckets: N}} for data.inputs.{self.name}"
            )
        ordered = counts.sort_by([("count", "descending"), ("value", "ascending")])
        ordered = ordered.filter(pc.greater_equal(ordered["count"], self.options["min_count"]))
        if self.options.get("max_size"):
            ordered = ordered.slice(0, self.options["max_size"])
        self.vocabulary = ordered["value"].combine_chunks()
        return {
            "value_type": str(self.vocabulary.type),
            "values": self.vocabulary.to_pylist(),
            "counts": ordered["count"].to_pylist(),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.vocabulary = pa.array(state["values"], type=_arrow_type(state["value_type"]))

    def cardinality(self) -> int:
        return len(self.vocabulary) + 2  # + null + unknown

    def encode(self, array: pa.Array) -> np.ndarray:
        array = plain(array)
        if array.type != self.vocabulary.type:
            try:
                array = pc.cast(array, self.vocabulary.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise ValueError(
                    f"input column {self.name!r} holds {array.type} values; its vocabulary holds "
                    f"{self.vocabulary.type} ({error})"
                ) from None
        found = pc.index_in(array, value_set=self.vocabulary)
        index = pc.fill_null(pc.add(found, 2), UNKNOWN_INDEX).to_numpy(zero_copy_only=False).astype(np.int64)
        index[pc.is_null(array).to_numpy(zero_copy_only=False)] = NULL_INDEX
        return index


class HashedCodec(Codec):
    kind = "hashed"
    dtype = "int64"

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return plain(pa.array([], type=source_type)).type

    def cardinality(self) -> int:
        return int(self.options["buckets"]) + 1  # + null

    def encode(self, array: pa.Array) -> np.ndarray:
        array = plain(array)
        nulls = pc.is_null(array).to_numpy(zero_copy_only=False)
        if nulls.any():
            filler = "" if pa.types.is_string(array.type) or pa.types.is_binary(array.type) else 0
            array = pc.fill_null(array, pa.scalar(filler, type=array.type))
        buckets = np.uint64(self.options["buckets"])
        index = (hash_values(array) % buckets).astype(np.int64) + 1
        index[nulls] = NULL_INDEX
        return index


class VectorCodec(Codec):
    kind = "vector"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, options)
        self.dim: int | None = None

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.list_(pa.float32())

    def _lengths(self, array: pa.Array) -> np.ndarray:
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            array = pc.cast(array, pa.list_(pa.float32())) if pa.types.is_fixed_size_list(array.type) else array
        if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
            raise ValueError(f"vector input {self.name!r} has type {array.type}; a vector is a list of numbers")
        return pc.fill_null(pc.list_value_length(array), -1).to_numpy(zero_copy_only=False)

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        """Non-null rows of the first row's length, every element finite; the length is learnt here."""
        lengths = self._lengths(array)
        if self.dim is None and (lengths >= 0).any():
            self.dim = int(lengths[lengths >= 0][0])
            if self.dim == 0:
                raise DataError(f"{where}: vector column {self.name!r}: its first row is empty")
        ok = lengths == self.dim
        if ok.any():
            values = pc.list_flatten(pc.filter(_as_list(array), pa.array(ok)))
            finite = np.isfinite(NumericCodec(self.name).encode(values)).reshape(-1, self.dim).all(axis=1)
            ok[np.flatnonzero(ok)[~finite]] = False
        return ok

    def bad_lengths(self, array: pa.Array) -> list[int]:
        """The row lengths other than ``dim`` in ``array`` (null rows excluded), distinct, sorted."""
        lengths = self._lengths(array)
        return sorted({int(n) for n in lengths if n >= 0 and n != self.dim})

    def fit(self) -> dict[str, Any]:
        return {"dim": self.dim}

    def load(self, state: dict[str, Any]) -> None:
        self.dim = int(state["dim"])

    def shape(self) -> tuple[int, ...]:
        return (int(self.dim),)

    def encode(self, array: pa.Array) -> np.ndarray:
        array = _as_list(plain(array))
        lengths = self._lengths(array)
        wrong = np.flatnonzero(lengths != self.dim)
        if len(wrong):
            raise ValueError(
                f"vector input {self.name!r}: row {int(wrong[0])} has length {int(lengths[wrong[0]])} "
                f"(null: -1); the model takes vectors of length {self.dim}"
            )
        values = NumericCodec(self.name).encode(pc.list_flatten(array))
        return values.reshape(len(array), self.dim)


CODECS: dict[str, type[Codec]] = {
    codec.kind: codec for codec in (NumericCodec, CategoricalCodec, HashedCodec, VectorCodec)
}


def _register_kinds() -> None:
    """The kinds with modules of their own (they import this one, so they register after it)."""
    from training.kinds.image import ImageCodec
    from training.kinds.text import TextCodec

    CODECS.setdefault(ImageCodec.kind, ImageCodec)
    CODECS.setdefault(TextCodec.kind, TextCodec)


def make_codec(name: str, kind: str, options: dict[str, Any] | None = None) -> Codec:
    _register_kinds()
    return CODECS[kind](name, options)


def _as_list(array: pa.Array) -> pa.Array:
    if pa.types.is_fixed_size_list(array.type):
        return pc.cast(array, pa.list_(array.type.value_type))
    return array


def _arrow_type(name: str) -> pa.DataType:
    return pa.string() if name in ("string", "large_string", "string_view") else pa.type_for_alias(name)


# --------------------------------------------------------------------------- encoders.json


def encoder_states(codecs: dict[str, Codec]) -> dict[str, Any]:
    """Every input's kind, options and fitted state, in input order: what encoders.json holds."""
    return {
        name: {"kind": codec.kind, "options": codec.options, "state": codec.fit()} for name, codec in codecs.items()
    }


def encoders_text(states: dict[str, Any]) -> str:
    return json.dumps(states, sort_keys=False, separators=(",", ":"))


def encoders_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def codecs_from_states(states: dict[str, Any]) -> dict[str, Codec]:
    codecs = {}
    for name, entry in states.items():
        codec = make_codec(name, entry["kind"], entry.get("options"))
        codec.load(entry.get("state") or {})
        codecs[name] = codec
    return codecs


def read_encoders(dataset_dir: str | Path, manifest) -> dict[str, Any]:
    """encoders.json's states, checked against the manifest's sha256; {} for a dataset from before them."""
    expected = (manifest.encoders or {}).get("sha256")
    if expected is None:
        return {}
    path = Path(dataset_dir) / ENCODERS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the encoders the manifest lists are missing") from None
    if encoders_sha256(text) != expected:
        raise ValueError(f"{path}: sha256 does not match the manifest's {expected}: the dataset was altered")
    return json.loads(text)


def codecs_for(inputs: dict[str, InputInfo], states: dict[str, Any]) -> dict[str, Codec]:
    """A codec per input: fitted from ``states`` where one is stored, numeric ones need none."""
    known = codecs_from_states({name: states[name] for name in inputs if name in states})
    for name, info in inputs.items():
        if name not in known:
            if info.kind != "numeric":
                raise ValueError(f"input {name!r} ({info.kind}) has no stored encoder state")
            known[name] = NumericCodec(name)
    return {name: known[name] for name in inputs}


# --------------------------------------------------------------------------- raw columns -> the batch dict


def encode_columns(
    columns: dict[str, pa.Array], inputs: dict[str, InputInfo], codecs: dict[str, Codec], normaliser
) -> dict[str, Any]:
    """Raw columns (a shard's record batch, a served DataFrame's) -> the model's batch dict of tensors.

    The numeric inputs are encoded into one float32 block, normalised in place (``normaliser``:
    training/kinds/normalisation.py), and handed over as views of its columns, as the loader does."""
    import torch

    numeric = [name for name, info in inputs.items() if info.kind == "numeric"]
    rows = len(next(iter(columns.values()))) if columns else 0
    block = np.empty((rows, len(numeric)), dtype=np.float32)
    for j, name in enumerate(numeric):
        block[:, j] = codecs[name].encode(columns[name])
    features = normaliser.features_(torch.from_numpy(block))
    batch = {name: features[:, j] for j, name in enumerate(numeric)}
    for name, info in inputs.items():
        if info.kind == "numeric":
            continue
        codec = codecs[name]
        if codec.ragged_dtype is None:
            # An owned, writable copy where ``encode`` returned a read-only view of Arrow's memory (a null-free
            # float32 vector column does): a tensor on that view would alias the caller's table, so a model that
            # writes its input in place would write into it (torch warns of exactly this).
            encoded = np.require(codec.encode(columns[name]), requirements=("C_CONTIGUOUS", "WRITEABLE"))
            batch[name] = torch.from_numpy(encoded)
        else:  # the same values the node cache holds, collated as validation collates them
            batch.update(collate_encoded(codec, *codec.encode_ragged(columns[name])))
    return batch


def collate_encoded(codec: Codec, values: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
    """``encode_ragged``'s output collated with the evaluation transform (no augmentation)."""
    import torch

    from training.kinds.ragged import evaluation_context

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    context = evaluation_context(torch.arange(len(lengths)))
    return codec.collate(torch.from_numpy(np.ascontiguousarray(values)), torch.from_numpy(offsets), context)
