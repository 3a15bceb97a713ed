"""A next_token language model past training: the test-split evaluation (each target token once, checked
against a computation by hand), the champion gate on test_loss (lower is better), the served pyfunc's per-row
scores (equal to the evaluation's), and the pipeline flow end to end.

The model.pt files are built in process as the Trainer builds them (``build_objective``, ``ModelSpec``,
``inference_checkpoint`` with the fitted encoders), on log lines prepared by the real prepare stage: the lines'
level is the dataset's label, which a language model does not use."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from training.config import load_config

MAX_LEN = 10
TINY_LM = {"d_model": 16, "n_heads": 2, "n_layers": 1}
WORDS = {
    "INFO": ["user", "login", "ok", "session", "started", "request", "served", "in", "ms"],
    "ERROR": ["disk", "full", "timeout", "connection", "refused", "retry", "failed", "on", "host"],
}


def log_lines(rows: int, seed: int = 3) -> pa.Table:
    """Log lines: a level and words of it; null, empty and one-word rows; some longer than MAX_LEN tokens."""
    rng = np.random.default_rng(seed)
    levels = rng.choice(sorted(WORDS), size=rows)
    lines = []
    for i, level in enumerate(levels):
        words = [level, *rng.choice(WORDS[level], size=rng.integers(0, 14))]
        lines.append(None if i % 17 == 0 else "" if i % 19 == 0 else " ".join(words))
    return pa.table({"line": pa.array(lines, pa.string()), "level": levels})


def prepare_lines(root: Path, rows: int = 240, seed: int = 3) -> Path:
    from training.data.prepare import prepare_dataset

    source = root / f"lines-{seed}.csv"
    pacsv.write_csv(log_lines(rows, seed), source)
    inputs = {"line": {"kind": "text", "max_len": MAX_LEN, "tokenizer": {"type": "bpe", "vocab_size": 60}}}
    settings = [f"data.source={source}", f"data.root={root / 'shards'}", "data.label=level"]
    settings += [f"data.inputs={json.dumps(inputs)}", "data.rows_per_shard=16"]
    return Path(prepare_dataset(load_config(None, settings).data).dataset_dir)


def language_model_file(dataset: Path, path: Path, steps: int = 40, seed: int = 0) -> Path:
    """A next_token model.pt as the Trainer writes it, after ``steps`` full-batch Adam steps on the train split."""
    from training.checkpoint import inference_checkpoint
    from training.data.manifest import read_manifest
    from training.models import ModelSpec, build_model
    from training.spec.codecs import read_encoders
    from training.spec.inputs import inputs_from_manifest
    from training.spec.objectives import build_objective
    from training.token_scoring import encode_texts, modelled_text

    manifest = read_manifest(dataset)
    train = load_config(None, ["train.objective=next_token", f"train.model_kwargs={json.dumps(TINY_LM)}"]).train
    objective = build_objective(train, manifest)
    torch.manual_seed(seed)
    spec = ModelSpec.for_inputs(
        "auto", inputs_from_manifest(manifest), objective.n_outputs(None), {**objective.model_kwargs(), **TINY_LM}
    )
    model = build_model(spec)
    encoders = read_encoders(dataset, manifest)
    meta = {"model_spec": spec.to_dict(), "features": manifest.features, "encoders": encoders}
    _, codec = modelled_text({**meta, "objective": objective.describe()})
    files = manifest.split_files(dataset, "train")
    lines = pa.concat_arrays([pq.read_table(f)["line"].combine_chunks() for f in files])
    batch = encode_texts(codec, lines)
    targets = objective.targets(batch, None)
    weights = objective.row_weights(targets)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (objective.per_row_loss(model(batch), targets) * weights).sum() / weights.sum()
        loss.backward()
        optimizer.step()
    model.eval()
    metrics = {"train_loss": float(loss.detach())}
    checkpoint = inference_checkpoint(model.state_dict(), spec, manifest, 1, metrics, encoders)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**checkpoint, "objective": objective.describe()}, path)
    return path


def by_hand(model_path: Path, dataset: Path, strings: list[str | None]) -> list[tuple[int, float, int]]:
    """Each row alone, tokenized with tokenizers' own Tokenizer from the dataset's tokenizer file: (target
    tokens, summed -log p of each next token, top-1 hits), from log_softmax over the model's logits."""
    from tokenizers import Tokenizer

    from training.evaluate import load_model_checkpoint

    model, _ = load_model_checkpoint(model_path)
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizers" / "line.json"))
    rows = []
    with torch.inference_mode():
        for text in strings:
            ids = tokenizer.encode(text or "", add_special_tokens=False).ids[:MAX_LEN]
            if len(ids) < 2:
                rows.append((0, 0.0, 0))
                continue
            tokens = torch.tensor([ids])
            logits = model({"line": tokens, "line_mask": torch.ones_like(tokens, dtype=torch.bool)})[0]
            log_p = torch.log_softmax(logits.double(), dim=-1)
            nxt = tokens[0, 1:]
            nll = -log_p[torch.arange(len(ids) - 1), nxt].sum()
            hits = int((logits[:-1].argmax(dim=-1) == nxt).sum())
            rows.append((len(ids) - 1, float(nll), hits))
    return rows


def split_strings(dataset: Path) -> list[str | None]:
    from training.data.manifest import read_manifest

    files = read_manifest(dataset).split_files(dataset, "test")
    return [value for f in files for value in pq.read_table(f)["line"].to_pylist()]


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """(dataset, model.pt) shared by the module's tests: preparing and training cost seconds."""
    root = tmp_path_factory.mktemp("next-token")
    dataset = prepare_lines(root)
    return dataset, language_model_file(dataset, root / "runs" / "lm" / "model.pt")


def test_the_evaluation_counts_each_target_token_once_and_its_loss_is_the_mean_per_target_token(lines):
    from training.data.manifest import read_manifest
    from training.evaluate import evaluate_split

    dataset, model_path = lines
    manifest = read_manifest(dataset)
    assert len(manifest.split_files(dataset, "test")) > 1, "the test split spans shards"
    # batch_size 7: batches cross row-group and shard boundaries, each padded to its own longest row.
    result = evaluate_split(model_path, dataset, "test", batch_size=7, return_predictions=True)
    strings = split_strings(dataset)
    hand = by_hand(model_path, dataset, strings)
    tokens = sum(t for t, _, _ in hand)
    assert any(t == 0 for t, _, _ in hand) and any(t == MAX_LEN - 1 for t, _, _ in hand)  # empty and cut rows
    assert result.task == "next_token" and result.samples == manifest.rows("test") == len(strings)
    metrics = result.metrics
    assert metrics["test_tokens"] == tokens
    assert metrics["test_scored_rows"] == sum(t > 0 for t, _, _ in hand)
    assert metrics["test_samples"] == len(strings)
    expected_loss = sum(nll for _, nll, _ in hand) / tokens
    assert metrics["test_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["test_perplexity"] == pytest.approx(math.exp(expected_loss), rel=1e-6)
    assert metrics["test_token_accuracy"] == pytest.approx(sum(h for _, _, h in hand) / tokens, abs=1e-12)
    assert 0 < metrics["test_token_accuracy"] < 1
    # Per row: the mean loss per target token (NaN without targets) and the tokens, in shard order.
    assert result.targets.tolist() == [t for t, _, _ in hand]
    per_row = [nll / t if t else math.nan for t, nll, _ in hand]
    np.testing.assert_allclose(result.predictions, per_row, rtol=1e-5, equal_nan=True)
    # Any batch size scores the same rows alike.
    whole = evaluate_split(model_path, dataset, "test", batch_size=10_000)
    assert whole.metrics["test_tokens"] == tokens
    assert whole.metrics["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-6)
    assert json.dumps(whole.to_dict())  # eval/metrics.json


def test_a_batch_of_logits_is_bounded_in_memory():
    from training.spec.inputs import InputInfo
    from training.token_scoring import rows_per_batch

    text = InputInfo("line", "text", "int64", (), 8000, {"max_len": 256})
    assert rows_per_batch(text, 8000, 65_536, 256 << 20) == (256 << 20) // (4 * 256 * 8000 * 3) == 10
    assert rows_per_batch(text, 50, 7, 256 << 20) == 7
    assert rows_per_batch(text, 10**9, 7, 256 << 20) == 1


def test_a_dataset_without_the_modelled_text_is_incompatible(lines, tmp_path):
    from model.conftest import make_dataset

    from training.evaluate import IncompatibleModelError, evaluate_split

    _, model_path = lines
    numeric = make_dataset(tmp_path)
    with pytest.raises(IncompatibleModelError, match="next_token model of the text input 'line'.*lacks it"):
        evaluate_split(model_path, numeric, "test")
