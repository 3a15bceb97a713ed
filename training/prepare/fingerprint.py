"""The prepared dataset's fingerprint: what the source is and how it is prepared.

    sha256(json({"prepare_version", "source": identity, "prep": the data fields that change the output}))[:16]

The source identity is its files' paths, sizes and modification times (or
fsspec ETags), or the synthetic spec; so editing, adding or removing a file
gives a new fingerprint. ``data.root`` (where the output goes),
``data.read_batch_rows`` (how fast it is read), ``data.cache_dir`` (where
ranks keep their node cache) and ``data.stream``, ``stream_cache_limit`` and
``shuffle_window`` (how ranks read the shards) do not change the output and are left out, so the
same data prepared under another root or batch size hashes alike.
"""

from __future__ import annotations

from typing import Any

from training.core.config import DataConfig
from training.core.digest import json_digest
from training.kinds.registry import hashed_inputs, input_options, kind_record

# Bump when prepare's output changes for the same input (layout, dtypes, split rule, manifest statistics).
# 2: regression manifests carry label_mean/label_std (target standardisation).
# 3: manifests carry feature_histograms (data drift).
# 4: typed inputs (data.inputs, data.weight): raw columns in the shards, encoders.json, Manifest.inputs.
# 5: nulls are values: a numeric input's nulls are kept (imputed in the encoding, fitted on the train split),
#    a missing indicator per numeric input with train nulls, null counts in the histograms (data.inputs.*.missing).
# 6: robust scaling (median/IQR, smooth clip) and the numeric embeddings' quantile bins, fitted on the train
#    split's whole column: encoders.json's numeric states, Manifest.feature_center/scale/clip, InputInfo.bins.
# (data.split by time and the datetime kind add fields only to the datasets that use them: no bump.)
# 7: the datetime kind's time since the start carries the numeric embeddings' bins (encoders.json's datetime
#    edges, InputInfo.bins and bins_column).
PREPARE_VERSION = 7
# DataConfig fields that do not change the prepared output.
# How ranks read the shards (data.stream, its cache and window) is not the dataset either.
_NOT_OUTPUT_FIELDS = frozenset(
    {"root", "read_batch_rows", "source", "cache_dir", "stream", "stream_cache_limit", "shuffle_window"}
)


def tokenizer_files(data: DataConfig) -> dict[str, str]:
    """Each input's user file (a text input's tokenizer.json) -> its sha256: a new file's content is a new
    dataset. Its kind says which file (``Codec.user_file_sha256``)."""
    specs = data.input_specs() or {}
    options = {name: input_options(name, spec) for name, spec in specs.items()}  # ConfigError naming the input
    found = {name: kind_record(specs[name].kind).user_file_sha256(given) for name, given in options.items()}
    return {name: sha for name, sha in found.items() if sha is not None}


def prep_fields(data: DataConfig) -> dict[str, Any]:
    """The data config minus what does not change the output (the source enters via its identity). ``data.split``
    only when it splits by time: unset and ``{by: hash}`` are the one hash split, so a hash-split dataset keeps
    the fingerprint it had before ``data.split`` existed."""
    fields = {name: value for name, value in data.model_dump(mode="json").items() if name not in _NOT_OUTPUT_FIELDS}
    fields["inputs"] = hashed_inputs(data)
    if fields.get("split") is None or fields["split"]["by"] == "hash":
        fields.pop("split", None)
    return fields


def dataset_fingerprint(source_identity: dict[str, Any], data: DataConfig) -> str:
    payload = {"prepare_version": PREPARE_VERSION, "source": source_identity, "prep": prep_fields(data)}
    files = tokenizer_files(data)
    if files:  # only with a user's tokenizer.json: every other dataset keeps its fingerprint
        payload["tokenizer_files"] = files
    return json_digest(payload)
