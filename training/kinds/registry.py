"""The registry of input kinds (``CODECS``, ``make_codec``), encoders.json, and the encoding of whole tables
(``encode_columns``). One codec per input kind (``base.py: Codec``): observed at prepare, fitted on the train
split, then the ONE encoding of raw columns into the tensors a model sees. The node cache build
(training/loading/batches.py), evaluation (training/inference/evaluate.py) and serving
(training/inference/predict.py) all call ``encode``, so they agree by construction.

    codec = make_codec("country", "categorical", {"min_count": 1})
    codec.observe(train_column)          # prepare, train rows only, batch by batch
    state = codec.fit()                  # JSON-able; saved in <dataset>/encoders.json (sha256 in the manifest)
    codec = codec_from_state("country", entry)
    codec.encode(pa_array) -> numpy      # [rows, *shape] of the input's dtype

What each kind guarantees (docs/data.md):
- numeric: float32; a null or NaN is the train split's center (the median; ``missing: impute``, the default),
  and an input whose train split held any adds a 0/1 missing indicator column to the numeric block
  (``block_names``); ``missing: error`` makes it invalid (data.on_invalid). Scaled by
  training/kinds/normalisation.py: robustly (train median/IQR, smooth clip) or ``scaling: standard``.
- categorical: int64 index; 0 = null, 1 = unknown (a value not in the vocabulary: unseen, or rarer than
  ``min_count``, or cut by ``max_size``), 2.. = the vocabulary, ordered by train count (descending), then value.
- hashed: int64 index; 0 = null, 1 + (a stable 64-bit hash of the value mod ``buckets``) otherwise. The hash is
  pandas' SipHash with a fixed key (training/kinds/hashing.py: ``hash_values``; integers as int64, floats as
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

from training.kinds.base import Codec
from training.kinds.image import ImageCodec
from training.kinds.inputs import InputInfo, block_names, numeric_names
from training.kinds.tabular import CategoricalCodec, HashedCodec, NumericCodec, VectorCodec
from training.kinds.text import TextCodec

ENCODERS_FILE = "encoders.json"


CODECS: dict[str, type[Codec]] = {
    codec.kind: codec for codec in (NumericCodec, CategoricalCodec, HashedCodec, VectorCodec, ImageCodec, TextCodec)
}


def make_codec(name: str, kind: str, options: dict[str, Any] | None = None) -> Codec:
    return CODECS[kind](name, options)


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

    numeric = numeric_names(inputs)
    names = block_names(inputs)  # the numeric inputs, then their missing indicators
    rows = len(next(iter(columns.values()))) if columns else 0
    block = np.empty((rows, len(names)), dtype=np.float32)
    for j, name in enumerate(numeric):
        block[:, j] = codecs[name].encode(columns[name])
    for k, name in enumerate([name for name in numeric if inputs[name].missing_indicator], len(numeric)):
        block[:, k] = codecs[name].missing(columns[name])
    features = normaliser.features_(torch.from_numpy(block))
    batch = {name: features[:, j] for j, name in enumerate(names)}
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
