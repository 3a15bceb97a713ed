"""The text kind at prepare and in its codec (training/kinds/text.py): the tokenizer fitted on the train split
only and deterministically, or a user's tokenizer.json (its content in the fingerprint); token ids cut to
max_len; null and empty text; a column that is not text."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import ConfigError, load_config
from training.kinds.registry import ENCODERS_FILE, make_codec, read_encoders
from training.kinds.text import PAD, SPECIAL_TOKENS, UNK, fit_tokenizer
from training.prepare.dataset import DataError, prepare_dataset

WORDS = {
    "python": ["def", "return", "import", "lambda", "self", "print", "None", "class"],
    "sql": ["SELECT", "FROM", "WHERE", "JOIN", "GROUP", "ORDER", "BY", "INSERT"],
    "shell": ["echo", "grep", "sudo", "chmod", "export", "cd", "ls", "cat"],
}


def snippets(rows: int, seed: int = 0) -> pa.Table:
    """Short "code" snippets of three languages; some rows null or empty; an int column."""
    rng = np.random.default_rng(seed)
    languages = rng.choice(sorted(WORDS), size=rows)
    text = [
        " ".join(rng.choice(WORDS[lang], size=rng.integers(2, 9))) + f" x{i % 7}" for i, lang in enumerate(languages)
    ]
    text = np.array(text, dtype=object)
    text[::17] = None
    text[5::19] = ""
    return pa.table(
        {
            "snippet": pa.array(text, type=pa.string()),
            "stars": rng.integers(0, 100, size=rows),
            "language": languages,
        }
    )


def prepared(table_file, make_config, inputs, rows=300, **fields):
    path = table_file(snippets(rows))
    return prepare_dataset(make_config(path, label="language", inputs=inputs, **fields))


def test_fitted_on_train_only_written_beside_the_manifest_and_hashed(table_file, make_config):
    result = prepared(
        table_file, make_config, {"snippet": {"kind": "text", "max_len": 6, "tokenizer": {"vocab_size": 120}}}
    )
    info = result.manifest.inputs[0]
    assert (info["kind"], info["dtype"], info["options"]["max_len"]) == ("text", "int64", 6)
    assert info["options"]["tokenizer"] == {"type": "bpe", "vocab_size": 120}
    state = read_encoders(result.dataset_dir, result.manifest)["snippet"]["state"]
    # The file beside the manifest is the state's tokenizer, byte for byte; the manifest's sha256 covers it.
    written = (result.dataset_dir / "tokenizers" / "snippet.json").read_text()
    assert written == state["tokenizer"]
    assert info["cardinality"] == state["vocab_size"] <= 120
    # Fitted on the train split's strings alone: fitting again on them gives the same bytes.
    train = pa.concat_arrays(
        [
            pq.read_table(result.dataset_dir / shard.file)["snippet"].combine_chunks()
            for shard in result.manifest.splits["train"].shards
        ]
    )
    assert fit_tokenizer("bpe", 120, [train.drop_null()]) == state["tokenizer"]
    everything = snippets(300)["snippet"].combine_chunks().drop_null()
    assert fit_tokenizer("bpe", 120, [everything]) != state["tokenizer"]
    assert (state["pad_id"], state["unk_id"]) == (0, 1)
    assert SPECIAL_TOKENS == (PAD, UNK)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_the_same_strings_fit_the_same_bytes(kind):
    strings = snippets(200)["snippet"].combine_chunks().drop_null()
    fits = {fit_tokenizer(kind, 80, [strings]) for _ in range(3)}
    assert len(fits) == 1


def test_wordpiece_fits_and_encodes_with_the_special_ids():
    strings = snippets(200)["snippet"].combine_chunks().drop_null()
    codec = make_codec("snippet", "text", {"max_len": 8, "tokenizer": {"type": "wordpiece", "vocab_size": 80}})
    codec.observe(strings)
    state = codec.fit()
    assert (state["pad_id"], state["unk_id"]) == (0, 1)
    values, lengths = codec.encode_ragged(pa.array(["SELECT x1 FROM"]))
    assert lengths.tolist() == [len(values)] and 1 not in values.tolist()


def codec_for(strings, max_len=5, vocab=60):
    codec = make_codec("snippet", "text", {"max_len": max_len, "tokenizer": {"type": "bpe", "vocab_size": vocab}})
    codec.observe(pa.array(strings))
    codec.fit()
    return codec


def test_token_ids_cut_to_max_len_null_and_empty_rows_have_none_and_collate_pads_to_the_longest():
    codec = codec_for(["def return print", "SELECT FROM WHERE JOIN"] * 10, max_len=3)
    values, lengths = codec.encode_ragged(pa.array(["def return print def return", None, "", "SELECT", "Ω"]))
    assert values.dtype == np.int32 and lengths.dtype == np.int64
    assert lengths.tolist()[:4] == [3, 0, 0, 1]
    assert lengths[4] == 1 and values[-1] == codec.unk_id  # a character never seen in train: unknown
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(lengths).cumsum(0)
    batch = codec.collate(torch.from_numpy(values), offsets)
    ids, mask = batch["snippet"], batch["snippet_mask"]
    assert ids.dtype == torch.int64 and ids.shape == (5, 3) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [3, 0, 0, 1, 1]
    assert ids[mask].tolist() == values.tolist() and (ids[~mask] == codec.pad_id).all()
    # Only empty rows: still one (masked) position, never a [B, 0] tensor.
    empty = codec.collate(torch.zeros(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    assert empty["snippet"].shape == (2, 1) and not empty["snippet_mask"].any()


def test_a_user_tokenizer_json_is_used_as_is_and_its_content_is_in_the_fingerprint(tmp_path, table_file, make_config):
    strings = snippets(100, seed=3)["snippet"].combine_chunks().drop_null()
    user = tmp_path / "user_tokenizer.json"
    user.write_text(fit_tokenizer("unigram", 50, [strings]))
    path = table_file(snippets(300))

    def prepare(tokenizer):
        return prepare_dataset(
            make_config(path, label="language", inputs={"snippet": {"kind": "text", "tokenizer": tokenizer}})
        )

    first = prepare(str(user))
    state = read_encoders(first.dataset_dir, first.manifest)["snippet"]["state"]
    assert state["tokenizer"] == user.read_text()
    assert first.manifest.inputs[0]["options"] == {"max_len": 256, "tokenizer": {"file": str(user)}}
    assert prepare(str(user)).cache_hit
    user.write_text(fit_tokenizer("bpe", 70, [strings]))  # same path, other content: another dataset
    second = prepare(str(user))
    assert not second.cache_hit and second.fingerprint != first.fingerprint
    with pytest.raises(DataError, match="tokenizer file .*missing.json.* not found"):
        prepare(str(tmp_path / "missing.json"))


def test_text_mixed_with_categoricals_keeps_null_and_empty_rows(table_file, make_config):
    result = prepared(table_file, make_config, {"snippet": "text", "stars": "categorical"})
    assert [entry["kind"] for entry in result.manifest.inputs] == ["text", "categorical"]
    assert result.manifest.dropped_rows == 0  # null and empty text are rows of zero tokens, not invalid
    states = json.loads((result.dataset_dir / ENCODERS_FILE).read_text())
    assert states["snippet"]["options"] == {"max_len": 256, "tokenizer": {"type": "bpe", "vocab_size": 8000}}


def test_a_column_that_is_not_text_is_named(table_file, make_config):
    with pytest.raises(DataError, match=r"input column 'stars' has type int64; data.inputs.stars is text"):
        prepared(table_file, make_config, {"snippet": "text", "stars": "text"})


def test_config_forms_and_wrong_options(tmp_path):
    from training.kinds.registry import check_inputs

    def load(inputs):
        """The config as the flow checks it: loaded, then each input's options checked by its kind's record."""
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({"data": {"label": "language", "inputs": inputs}}))
        config = load_config(path)
        return {name: options for name, (_kind, options) in check_inputs(config.data).items()}

    options = load({"snippet": {"kind": "text", "max_len": 64, "tokenizer": {"type": "unigram", "vocab_size": 500}}})
    assert options["snippet"] == {"max_len": 64, "tokenizer": {"type": "unigram", "vocab_size": 500}}
    assert load({"snippet": {"kind": "text", "tokenizer": "tok.json"}})["snippet"]["tokenizer"] == {"file": "tok.json"}
    with pytest.raises(ConfigError, match="kind 'categorical' takes no option \\['max_len'\\]"):
        load({"snippet": {"kind": "categorical", "max_len": 4}})
    with pytest.raises(ConfigError, match="kind 'text' takes no option \\['buckets'\\]"):
        load({"snippet": {"kind": "text", "buckets": 4}})
    with pytest.raises(ConfigError, match="data.inputs.snippet.tokenizer.*should be .bpe., .wordpiece. or .unigram."):
        load({"snippet": {"kind": "text", "tokenizer": {"type": "sentencepiece"}}})


def test_drift_of_token_lengths_words_and_unknown_tokens(tmp_path, table_file, make_config):
    from ddpflow.drift.report import compare

    strings = snippets(200)["snippet"].combine_chunks().drop_null()
    user = tmp_path / "tok.json"
    user.write_text(fit_tokenizer("bpe", 80, [strings]))
    inputs = {"snippet": {"kind": "text", "max_len": 16, "tokenizer": str(user)}}
    same = snippets(300)
    drifted = snippets(300, seed=1).to_pydict()
    # Longer rows, and words (with a character) the reference never had.
    drifted["snippet"] = [None if t is None else f"{t} {t} Ωmega zeta{i % 5}" for i, t in enumerate(drifted["snippet"])]
    datasets = []
    for name, table in (("a.parquet", same), ("b.parquet", same), ("c.parquet", pa.table(drifted))):
        path = table_file(table, name=name)
        datasets.append(prepare_dataset(make_config(path, label="language", inputs=inputs)).manifest)
    stats = datasets[0].extra["drift_stats"]["inputs"]["snippet"]
    assert sum(stats["lengths"]) == datasets[0].rows("train") and len(stats["lengths"]) == 17
    unchanged = {d.feature: d for d in compare(datasets[0], datasets[1]).features}
    assert set(unchanged) == {"snippet:length", "snippet:words", "snippet:unknown_tokens"}
    assert all(d.psi == 0 and d.mean_shift == 0 for d in unchanged.values())
    report = compare(datasets[0], datasets[2])
    moved = {d.feature: d for d in report.features}
    assert moved["snippet:length"].psi > 0.25 and moved["snippet:length"].mean_shift > 0.5
    assert moved["snippet:words"].current_mean > 0.1 > moved["snippet:words"].reference_mean
    assert moved["snippet:unknown_tokens"].current_mean > moved["snippet:unknown_tokens"].reference_mean
    assert report.max_psi >= moved["snippet:length"].psi
