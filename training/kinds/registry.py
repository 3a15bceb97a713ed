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
- datetime: float32 ``[rows, D]``: the time of day (not for dates), day of week, day of year and month as
  sin/cos pairs, the time since the train split's earliest value (the train span is 1), a missing indicator when
  the train split held a null; read as wall-clock times in the train column's zone (training/kinds/times.py).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import ValidationError

from training.core.config import ConfigError, DataConfig, InputSpec, format_validation_error
from training.core.location import join, read_text
from training.kinds.base import Codec
from training.kinds.image import ImageCodec, ImageOptions
from training.kinds.inputs import KINDS, InputInfo, block_names, numeric_names
from training.kinds.tabular import CategoricalCodec, HashedCodec, NumericCodec, VectorCodec
from training.kinds.text import TextCodec, TextOptions
from training.kinds.times import DatetimeCodec

ENCODERS_FILE = "encoders.json"


CODECS: dict[str, type[Codec]] = {
    codec.kind: codec
    for codec in (NumericCodec, CategoricalCodec, HashedCodec, VectorCodec, DatetimeCodec, ImageCodec, TextCodec)
}

# Kinds of a user's own (docs/models.md, "Adding an input kind"): modules that call ``register_kind`` when
# imported, named in this environment variable (comma-separated; the ranks, prepare and the served model
# inherit it) or by an installed package's entry point in this group. Imported on the first lookup of a kind
# the registry does not hold.
PLUGINS_ENV = "DDPFLOW_PLUGINS"
PLUGINS_ENTRY_POINTS = "ddpflow.kinds"


def register_kind(codec: type[Codec]) -> type[Codec]:
    """Add a kind of a user's own (a ``Codec`` subclass with its ``kind`` name); usable as a class decorator.
    A built-in kind's name is refused; registering the same class again is a no-op."""
    if not (isinstance(codec, type) and issubclass(codec, Codec)) or not codec.kind:
        raise TypeError(f"register_kind takes a Codec subclass with a kind name, not {codec!r}")
    known = CODECS.get(codec.kind)
    if known is not None and known is not codec:
        raise ValueError(f"input kind {codec.kind!r} is registered already ({known.__module__}.{known.__name__})")
    CODECS[codec.kind] = codec
    return codec


def plugin_modules() -> list[str]:
    """The modules named by ``DDPFLOW_PLUGINS`` and the ``ddpflow.kinds`` entry points, in that order."""
    named = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    return named + [point.value.partition(":")[0] for point in entry_points(group=PLUGINS_ENTRY_POINTS)]


def load_plugins() -> None:
    """Import every plugin module (each registers its kinds); ConfigError naming a module that does not
    import and where it was named."""
    for module in plugin_modules():
        try:
            importlib.import_module(module)
        except ImportError as problem:
            raise ConfigError(f"{PLUGINS_ENV} / {PLUGINS_ENTRY_POINTS}: cannot import {module!r} ({problem})") from None


def kind_record(kind: str) -> type[Codec]:
    """The record (``Codec`` class) of input kind ``kind``: a built-in, else a plugin's (imported now)."""
    if kind not in CODECS:
        load_plugins()
    try:
        return CODECS[kind]
    except KeyError:
        raise ValueError(
            f"unknown input kind {kind!r} (known: {', '.join(known_kinds())}; a kind of your own: "
            f"{PLUGINS_ENV}, docs/models.md)"
        ) from None


def known_kinds() -> list[str]:
    """The built-in kinds in config.INPUT_KINDS' order, then the registered plugins'."""
    return [*KINDS, *(kind for kind in CODECS if kind not in KINDS)]


def block_of(info: InputInfo) -> str | None:
    """The built-in model block the input feeds (its record's ``model_block``)."""
    return kind_record(info.kind).model_block


def inputs_in(inputs: dict[str, InputInfo], *blocks: str) -> list[str]:
    """The inputs, in order, that feed one of ``blocks``."""
    return [name for name, info in inputs.items() if block_of(info) in blocks]


def make_codec(name: str, kind: str, options: dict[str, Any] | None = None) -> Codec:
    return kind_record(kind)(name, options)


# --------------------------------------------------------------------------- data.inputs: kinds and options


def input_options(name: str, spec: InputSpec) -> dict[str, Any]:
    """``data.inputs.<name>``'s options checked by its kind's record, with the defaults filled in; ConfigError
    naming the input."""
    try:
        record = kind_record(spec.kind)
    except ValueError as problem:
        raise ConfigError(f"data.inputs.{name}.kind: {problem}") from None
    try:
        return record.options_from(spec.given_options())
    except ValidationError as error:  # a built-in kind's options model: pydantic's words, the field's whole path
        raise ConfigError(format_validation_error(error, ("data", "inputs", name))) from None
    except ValueError as problem:
        raise ConfigError(f"data.inputs.{name}: {problem}") from None


# The image and text options, typed by their kinds' models, in every input's JSON form that a hash reads.
HASHED_OPTION_MODELS = (ImageOptions, TextOptions)


def hashed_inputs(data: DataConfig) -> dict[str, dict[str, Any]] | None:
    """``data.inputs`` in the JSON form that the dataset fingerprint and a sweep's study name hash: each input's
    fields, with every image and text option typed by its kind's model and present (None where not given): one
    form for a config whichever module declares the options, so its dataset fingerprint and its study name
    depend on what it says alone. ConfigError naming a value the model refuses."""
    if data.inputs is None:
        return None
    found = {}
    for name, spec in data.inputs.items():
        dump = spec.model_dump(mode="json")
        for model in HASHED_OPTION_MODELS:
            given = {key: dump.pop(key) for key in model.model_fields if key in dump}
            try:
                dump |= model.model_validate(given).model_dump(mode="json")
            except ValidationError as error:
                raise ConfigError(format_validation_error(error, ("data", "inputs", name))) from None
        found[name] = dump
    return found


def check_inputs(data: DataConfig) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every configured input's (kind, options), each checked by its record: what prepare builds codecs from.
    {} when ``data.inputs``/``data.features`` leave the inputs to the source's columns."""
    return {name: (spec.kind, input_options(name, spec)) for name, spec in (data.input_specs() or {}).items()}


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
    """encoders.json's states, checked against the manifest's sha256; {} for a dataset without them (before
    PREPARE_VERSION 4)."""
    expected = (manifest.encoders or {}).get("sha256")
    if expected is None:
        return {}
    path = join(dataset_dir, ENCODERS_FILE)  # a local directory or a URL (training/core/location.py)
    try:
        text = read_text(path)
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
            if kind_record(info.kind).needs_state:
                raise ValueError(f"input {name!r} ({info.kind}) has no stored encoder state")
            known[name] = make_codec(name, info.kind)
    return {name: known[name] for name in inputs}


# --------------------------------------------------------------------------- raw columns -> the batch dict


class NonFiniteInputs(ValueError):
    """Numeric input columns whose encoded values are not all finite (``columns``): an inf, or a null or NaN where
    the input takes none (``missing: error``, or a model without imputation)."""

    def __init__(self, columns: list[str]):
        super().__init__(
            f"input columns {columns} hold infinite values, or null/NaN where the model takes none (missing: error)"
        )
        self.columns = columns


def encode_columns(
    columns: dict[str, pa.Array], inputs: dict[str, InputInfo], codecs: dict[str, Codec], normaliser
) -> dict[str, Any]:
    """Raw columns (a shard's record batch, a served DataFrame's) -> the model's batch dict of tensors.

    The numeric inputs are encoded into one float32 block, each column once, checked (``NonFiniteInputs`` names
    the columns with a value that is not finite), normalised in place (``normaliser``:
    training/kinds/normalisation.py), and handed over as views of its columns, as the loader does."""
    import torch

    numeric = numeric_names(inputs)
    names = block_names(inputs)  # the numeric inputs, then their missing indicators
    rows = len(next(iter(columns.values()))) if columns else 0
    block = np.empty((rows, len(names)), dtype=np.float32)
    for j, name in enumerate(numeric):
        block[:, j] = codecs[name].encode(columns[name])
    finite = np.isfinite(block[:, : len(numeric)]).all(axis=0)
    if not finite.all():
        raise NonFiniteInputs([name for name, ok in zip(numeric, finite, strict=True) if not ok])
    for k, name in enumerate([name for name in numeric if inputs[name].missing_indicator], len(numeric)):
        block[:, k] = codecs[name].missing(columns[name])
    features = normaliser.features_(torch.from_numpy(block))
    batch = {name: features[:, j] for j, name in enumerate(names)}
    for name in inputs:
        if name in numeric:
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
