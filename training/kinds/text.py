"""The text input kind: a string column -> token ids, through a Hugging Face ``tokenizers`` tokenizer.

    data.inputs:
      snippet: text                                                 # max_len 256, a bpe of 8000 fitted on train
      title: {kind: text, max_len: 64, tokenizer: {type: unigram, vocab_size: 2000}}
      body: {kind: text, tokenizer: path/to/tokenizer.json}         # a user's own tokenizer file

The tokenizer is never hand-written: prepare fits one on the TRAIN split's strings (bpe, wordpiece or unigram,
with ``[PAD]`` = id 0 and ``[UNK]`` = id 1, NFKC normalisation, split on whitespace and punctuation), or loads
the user's tokenizer.json as it is. Its JSON is part of the codec's state (encoders.json, whose sha256 the
manifest holds, and model.pt's "encoders": so it ships with every registered model), and prepare writes it
beside the manifest as ``tokenizers/<input>.json`` too, loadable with ``Tokenizer.from_file``. A user file's
sha256 enters the dataset fingerprint (training/prepare/fingerprint.py): another file is another dataset.

The rules of the kind (docs/data.md, Text):
- a row is its tokens WITHOUT special tokens (no [CLS]/[SEP]/BOS), cut to the first ``max_len``, in training,
  evaluation and serving alike (one ``encode_ragged``);
- null and empty text are a row of zero tokens: its mask is all false and the model's masked mean pooling gives
  it a zero vector (never a crash, never a NaN); such rows are kept, not dropped;
- a batch is padded to its longest row (at least 1): ``<name>`` int64 [B, L] (the pad id past each row's end),
  ``<name>_mask`` bool [B, L], true for real tokens (``collate``);
- fitting is deterministic: the same train strings give the same tokenizer.json bytes. bpe is, as the library
  trains it; unigram after ``_canonical`` (its EM sums in hash order: scores differ in the 16th digit, so they
  are rounded to 9 and the pieces put in one order). wordpiece is NOT in tokenizers 0.23.3: its trainer breaks
  ties between equally frequent merges in hash order, so two fits can keep different tokens; prepare fits it
  once per dataset fingerprint, so one dataset keeps one tokenizer, but a rebuild may differ.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from training.core.errors import DataError
from training.kinds.arrow_types import is_text
from training.kinds.base import TABLE, TOKENS, Codec, plain
from training.kinds.stats import merge_frequencies

PAD, UNK = "[PAD]", "[UNK]"
SPECIAL_TOKENS = (PAD, UNK)  # ids 0 and 1 of a fitted tokenizer
TOKENIZERS_DIR = "tokenizers"  # <dataset>/tokenizers/<input>.json
UNIGRAM_SCORE_DIGITS = 9
TEXT_DEFAULT_MAX_LEN = 256
TEXT_DEFAULT_TOKENIZER = {"type": "bpe", "vocab_size": 8000}


class TokenizerSpec(BaseModel):
    """``data.inputs.<text>.tokenizer`` in the long form: the tokenizer prepare fits on the train split."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["bpe", "wordpiece", "unigram"] = "bpe"
    vocab_size: int = Field(8000, ge=8, description="At most this many tokens, the special ones included.")


class TextOptions(BaseModel):
    """A text input's options in ``data.inputs`` (``TextCodec.options_from`` checks them; None: not given)."""

    model_config = ConfigDict(extra="forbid")

    max_len: int | None = Field(None, ge=1, description="text: tokens kept per row (default 256; the rest cut).")
    tokenizer: TokenizerSpec | str | None = Field(
        None,
        description="text: {type: bpe|wordpiece|unigram, vocab_size: N} fitted on train, or a tokenizer.json path.",
    )


TEXT_OPTIONS = tuple(TextOptions.model_fields)


def text_options(max_len: int | None, tokenizer: TokenizerSpec | str | None) -> dict[str, Any]:
    """A text input's codec options with the defaults filled in: ``max_len`` and the tokenizer, either
    ``{"type", "vocab_size"}`` (fitted) or ``{"file": path}`` (the user's)."""
    if tokenizer is None:
        spec = dict(TEXT_DEFAULT_TOKENIZER)
    elif isinstance(tokenizer, str):
        spec = {"file": tokenizer}
    else:
        spec = {"type": tokenizer.type, "vocab_size": int(tokenizer.vocab_size)}
    return {"max_len": int(max_len or TEXT_DEFAULT_MAX_LEN), "tokenizer": spec}


def tokenizer_file_sha256(options: dict[str, Any]) -> str | None:
    """The sha256 of a user tokenizer.json a text input names (what the fingerprint adds); None when fitted."""
    path = (options.get("tokenizer") or {}).get("file")
    if path is None:
        return None
    return hashlib.sha256(_user_file(path).read_bytes()).hexdigest()


def _user_file(path: str) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise DataError(f"tokenizer file {path!r} (data.inputs.<text>.tokenizer) not found")
    return resolved


def is_string_type(kind: pa.DataType) -> bool:
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


class TextCodec(Codec):
    kind = "text"
    option_names = TEXT_OPTIONS
    model_block = TOKENS  # the transformer's encoder; next_token's input
    drift_measure = "words"  # lengths, word frequencies, unknown tokens (``text_drift_stats``)
    shown_as = TABLE  # the most confidently wrong rows' table
    dtype = "int64"  # the batch's token ids; the node cache holds them as int32 (ragged)
    ragged_dtype = "int32"
    default_model, default_model_rank = "transformer", 1  # training/models/text.py
    serving_packages = ("tokenizers",)
    takes = staticmethod(is_text)
    takes_what = "strings (string or large_string)"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        options = dict(options or {})
        super().__init__(name, {**text_options(None, None), **options})
        self.max_len = int(self.options["max_len"])
        self._observed: list[pa.Array] = []
        self._state: dict[str, Any] | None = None
        self.tokenizer = None

    @classmethod
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``max_len`` and the tokenizer checked (``TextOptions``: pydantic's ValidationError), the defaults
        filled in."""
        typed = TextOptions.model_validate(super().options_from(given))
        return text_options(typed.max_len, typed.tokenizer)

    @classmethod
    def user_file_sha256(cls, options: dict[str, Any]) -> str | None:
        return tokenizer_file_sha256(options)

    # ------------------------------------------------------------------ prepare

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.string()

    def observe(self, array: pa.Array) -> None:
        self._observed.append(self._strings(array))  # nulls kept: drift counts them as rows of 0 tokens

    def fit(self) -> dict[str, Any]:
        if self._state is None:
            spec = self.options["tokenizer"]
            if "file" in spec:
                text = _user_file(spec["file"]).read_text()
            else:
                text = fit_tokenizer(spec["type"], int(spec["vocab_size"]), self._observed)
            self.load({"tokenizer": text})
            self._drift = text_drift_stats(self, self._observed)
            self._observed = []
        return dict(self._state)

    def drift_stats(self) -> dict[str, Any] | None:
        """What drift compares (ddpflow/drift/text.py), over the train split: ``text_drift_stats``; None unfitted."""
        return getattr(self, "_drift", None)

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """``text_drift_stats`` of the rows, under the model's tokenizer, keeping more words (``SCORED_WORDS``)."""
        return text_drift_stats(self, [self._strings(array)], SCORED_WORDS)

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        merged = merge_frequencies(first, second, SCORED_WORDS)
        lengths = np.asarray(first["lengths"], dtype=np.int64) + np.asarray(second["lengths"], dtype=np.int64)
        sums = {key: int(first[key]) + int(second[key]) for key in ("tokens", "unknown")}
        return {**merged, **sums, "lengths": lengths.tolist()}

    @classmethod
    def reported_drift_stats(cls, stats: dict[str, Any]) -> dict[str, Any]:
        """The ``DRIFT_TOP_WORDS`` most frequent words, the rest as ``other``: what ``text_drift_stats`` keeps."""
        return merge_frequencies(stats, {"counts": {}, "other": 0}, DRIFT_TOP_WORDS)

    def files(self) -> dict[str, str]:
        """The files prepare writes beside the manifest: the tokenizer, loadable with ``Tokenizer.from_file``."""
        return {f"{TOKENIZERS_DIR}/{self.name}.json": self.fit()["tokenizer"]}

    def load(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        text = state["tokenizer"]
        tokenizer = Tokenizer.from_str(text)
        tokenizer.no_padding()  # a batch pads itself (collate); the ids are the tokens alone
        tokenizer.enable_truncation(self.max_len)
        self.tokenizer = tokenizer
        self._state = {
            "tokenizer": text,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            "pad_id": _pad_id(tokenizer),
            "unk_id": unknown_id(text, tokenizer),
        }

    def cardinality(self) -> int:
        return int(self._state["vocab_size"])

    @property
    def pad_id(self) -> int:
        return int(self._state["pad_id"])

    @property
    def unk_id(self) -> int | None:
        return self._state["unk_id"]

    # ------------------------------------------------------------------ rows -> token ids -> batches

    def encode(self, array: pa.Array) -> np.ndarray:
        raise TypeError(f"text input {self.name!r} is ragged: use encode_ragged and collate")

    def encode_ragged(self, array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32, flat; tokens per row int64 [rows]): each row's first ``max_len`` tokens, without
        special tokens; a null row has none."""
        strings = pc.fill_null(self._strings(array), "").to_pylist()
        encodings = self.tokenizer.encode_batch_fast(strings, add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return values, lengths

    def collate(self, values, offsets, context=None) -> dict[str, Any]:
        """The gathered rows (row i: ``values[offsets[i]:offsets[i + 1]]``) padded to the longest (at least 1):
        ``{name: int64 [B, L], name_mask: bool [B, L]}``; the same for training, evaluation and serving."""
        import torch

        lengths = offsets[1:] - offsets[:-1]
        width = max(1, int(lengths.max())) if len(lengths) else 1
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        ids = torch.full((len(lengths), width), self.pad_id, dtype=torch.int64)
        ids[mask] = values.to(torch.int64)  # row-major order of the mask = the packed order of the values
        return {self.name: ids, f"{self.name}_mask": mask}

    def _strings(self, array: pa.Array) -> pa.Array:
        array = plain(array)
        if pa.types.is_null(array.type):
            return pa.nulls(len(array), pa.string())
        if not is_string_type(array.type):
            raise ValueError(f"text input {self.name!r} holds {array.type} values; a text input takes strings")
        return array


def _pad_id(tokenizer) -> int:
    """The id padded positions hold (masked out, so any valid id): the tokenizer's own pad, [PAD], or 0."""
    for token in (PAD, "<pad>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def unknown_id(text: str, tokenizer) -> int | None:
    """The tokenizer's unknown token's id (what the unknown-token rate counts); None when it has none."""
    model = json.loads(text).get("model") or {}
    if model.get("unk_id") is not None:  # unigram
        return int(model["unk_id"])
    token = model.get("unk_token")
    found = tokenizer.token_to_id(token) if token else None
    return int(found) if found is not None else None


# ---------------------------------------------------------------------- drift statistics

DRIFT_TOP_WORDS = 2000  # per text input: the train split's most frequent words, with counts
SCORED_WORDS = 4 * DRIFT_TOP_WORDS  # a scoring's part keeps more, so that the merged parts' most frequent are exact


def text_drift_stats(codec: TextCodec, chunks: list[pa.Array], top: int = DRIFT_TOP_WORDS) -> dict[str, Any]:
    """A text input's train-split statistics for drift: tokens per row (``lengths[n]``: rows of n tokens after
    the cut to max_len), tokens and unknown tokens under its tokenizer (with its sha256: the rates compare only
    under one tokenizer), and the most frequent whitespace-separated words (the rest counted as ``other``),
    against which a later dataset's out-of-vocabulary rate is measured. Null rows are rows of 0 tokens."""
    lengths = np.zeros(codec.max_len + 1, dtype=np.int64)
    tokens = unknown = 0
    words: list[pa.Table] = []
    for chunk in chunks:
        values, row_lengths = codec.encode_ragged(chunk)
        lengths += np.bincount(row_lengths, minlength=len(lengths))
        tokens += len(values)
        unknown += int((values == codec.unk_id).sum()) if codec.unk_id is not None else 0
        counts = pc.value_counts(pc.list_flatten(pc.utf8_split_whitespace(chunk))).flatten()
        words.append(pa.table({"word": counts[0], "count": counts[1]}))
    if words:
        merged = pa.concat_tables(words).group_by("word").aggregate([("count", "sum")])
        merged = merged.rename_columns(["word", "count"]).sort_by([("count", "descending"), ("word", "ascending")])
    else:
        merged = pa.table({"word": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
    kept = merged.slice(0, top)
    return {
        "kind": "text",
        "lengths": lengths.tolist(),
        "tokens": int(tokens),
        "unknown": int(unknown),
        "tokenizer_sha256": codec.fit()["sha256"],
        "counts": dict(zip(kept["word"].to_pylist(), kept["count"].to_pylist())),
        "other": int(pc.sum(merged["count"]).as_py() or 0) - int(pc.sum(kept["count"]).as_py() or 0),
    }


# ---------------------------------------------------------------------- fitting


def fit_tokenizer(kind: str, vocab_size: int, chunks: list[pa.Array]) -> str:
    """A ``kind`` tokenizer of at most ``vocab_size`` tokens trained on the strings of ``chunks``: its JSON."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    common = {"vocab_size": vocab_size, "special_tokens": list(SPECIAL_TOKENS), "show_progress": False}
    if kind == "bpe":
        tokenizer, trainer = Tokenizer(models.BPE(unk_token=UNK)), trainers.BpeTrainer(**common)
    elif kind == "wordpiece":
        tokenizer, trainer = Tokenizer(models.WordPiece(unk_token=UNK)), trainers.WordPieceTrainer(**common)
    elif kind == "unigram":
        tokenizer, trainer = Tokenizer(models.Unigram()), trainers.UnigramTrainer(unk_token=UNK, **common)
    else:
        raise ValueError(f"tokenizer type {kind!r}: one of bpe, wordpiece, unigram")
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    rows = sum(len(chunk) - chunk.null_count for chunk in chunks)
    tokenizer.train_from_iterator(_strings_of(chunks), trainer=trainer, length=rows)
    return _canonical(tokenizer.to_str(), kind)


def _strings_of(chunks: list[pa.Array]):
    for chunk in chunks:
        yield from chunk.drop_null().to_pylist()


def _canonical(text: str, kind: str) -> str:
    """Unigram's pieces in one order (the specials first, then by score, then piece) with scores rounded:
    its EM sums in hash order, so two fits on the same strings differ only there."""
    if kind != "unigram":
        return text
    raw = json.loads(text)
    model = raw["model"]
    pieces = [(piece, round(score, UNIGRAM_SCORE_DIGITS)) for piece, score in model["vocab"]]
    specials = sorted((p for p in pieces if p[0] in SPECIAL_TOKENS), key=lambda p: SPECIAL_TOKENS.index(p[0]))
    rest = sorted((p for p in pieces if p[0] not in SPECIAL_TOKENS), key=lambda p: (-p[1], p[0]))
    model["vocab"] = [list(piece) for piece in specials + rest]
    model["unk_id"] = SPECIAL_TOKENS.index(UNK)
    for added in raw.get("added_tokens") or []:
        if added["content"] in SPECIAL_TOKENS:
            added["id"] = SPECIAL_TOKENS.index(added["content"])
    return json.dumps(raw, ensure_ascii=False)
