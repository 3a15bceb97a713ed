"""A next_token language model's scores (training/objectives/next_token.py): the test-split evaluation and the served
model, from one per-row computation.

    result = evaluate_split("runs/x/model.pt", dataset_dir)     # calls evaluate_tokens for a next_token model
    result.metrics["test_loss"], result.metrics["test_perplexity"]
    TokenScorer.from_checkpoint("runs/x/model.pt").score(frame)  # tokens, loss, perplexity per row

Each target token is counted exactly once, by the rule training uses: a row of n tokens (after the cut to
max_len, with the model's own tokenizer) has n - 1 targets, a row of 0 or 1 tokens none. The evaluation reports

    test_loss            Σ (cross entropy of every target token) / test_tokens   (what training minimises)
    test_perplexity      exp(test_loss)
    test_token_accuracy  target tokens that are the model's top-1 next token / test_tokens
    test_tokens          target tokens scored;  test_scored_rows: rows with at least one;  test_samples: rows read

(a split without any target token gives NaN metrics, which the gate rejects). The served model returns per row
``tokens``, ``loss`` (its mean cross entropy per target token: how surprising the row is to the model) and
``perplexity`` (its exp); a row without targets (null, empty, one token) gets tokens 0 and NaN loss and
perplexity. Only the modelled text column is read, through the model's shipped tokenizer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch import nn

from training.core.location import open_parquet
from training.core.manifest import Manifest
from training.inference.model_file import (
    EVAL_BATCH_BYTES,
    EvalResult,
    IncompatibleModelError,
    checkpoint_codecs,
    checkpoint_inputs,
    load_model_checkpoint,
)
from training.kinds.base import TOKENS
from training.kinds.inputs import InputInfo, inputs_from_manifest
from training.kinds.registry import block_of, collate_encoded
from training.objectives.next_token import LANGUAGE_MODEL, MAX_LOG_PERPLEXITY, NextToken, RowScores, perplexity
from training.objectives.registry import objective_from_checkpoint

# The logits [B, L, vocab] and cross entropy's two fp32 copies of them dominate a batch's memory.
LOGIT_COPIES = 3


def modelled_text(meta: dict[str, Any]) -> tuple[InputInfo, Any]:
    """The text input a next_token model.pt models and its shipped codec (tokenizer, max_len)."""
    name = meta["objective"]["kwargs"]["input"]
    return checkpoint_inputs(meta)[name], checkpoint_codecs(meta)[name]


def check_text_input(meta: dict[str, Any], manifest: Manifest, checkpoint: str | Path) -> None:
    """``IncompatibleModelError`` unless the dataset has the model's text input, as text."""
    name = meta["objective"]["kwargs"]["input"]
    present = inputs_from_manifest(manifest).get(name)
    if present is None or block_of(present) != TOKENS:
        found = "lacks it" if present is None else f"has it as {present.kind}"
        raise IncompatibleModelError(
            f"{checkpoint} is a next_token model of the text input {name!r}; dataset {manifest.fingerprint} {found}"
        )


def rows_per_batch(info: InputInfo, vocab_size: int, batch_size: int, budget_bytes: int) -> int:
    """At most ``batch_size`` rows, fewer when a batch's logits (max_len x vocab per row) would pass the budget."""
    row_bytes = 4 * int(info.options["max_len"]) * vocab_size * LOGIT_COPIES
    return max(1, min(batch_size, budget_bytes // row_bytes))


def encode_texts(codec, column: pa.Array) -> dict[str, torch.Tensor]:
    """Raw strings -> ``{name: ids [B, L], name_mask: [B, L]}``: the codec's own cut to max_len and collate."""
    return collate_encoded(codec, *codec.encode_ragged(column))


def score_batch(model: nn.Module, objective: NextToken, batch: dict[str, torch.Tensor]) -> RowScores:
    """One batch's ``RowScores``: the model's logits against the rows' own next tokens (``targets``)."""
    return objective.row_scores(model(batch), objective.targets(batch, None))


def evaluate_tokens(
    model: nn.Module,
    meta: dict[str, Any],
    objective: NextToken,
    manifest: Manifest,
    dataset_dir: str | Path,
    split: str,
    batch_size: int,
    *,
    return_predictions: bool = False,
    max_predictions: int | None = None,
    started: float | None = None,
):
    """Score every row of ``split`` once, shard by shard in batches (bounded memory); an ``EvalResult`` whose
    task is ``LANGUAGE_MODEL``. ``return_predictions``: each row's mean loss (NaN without targets) as
    ``predictions`` and its target tokens as ``targets``, in shard order (the first ``max_predictions``)."""
    started = time.perf_counter() if started is None else started
    info, codec = modelled_text(meta)
    rows_at_once = rows_per_batch(info, objective.vocab_size, batch_size, EVAL_BATCH_BYTES)
    tokens = loss = correct = 0.0
    samples = scored_rows = 0
    kept_losses, kept_tokens = [], []
    with torch.inference_mode():
        for shard in manifest.shard_locations(dataset_dir, split):
            for batch in open_parquet(shard).iter_batches(batch_size=rows_at_once, columns=[info.name]):
                scores = score_batch(model, objective, encode_texts(codec, batch.column(info.name)))
                tokens += float(scores.tokens.sum())
                loss += float(scores.loss_sum.sum())
                correct += float(scores.correct.sum())
                scored_rows += int((scores.tokens > 0).sum())
                samples += batch.num_rows
                kept = sum(map(len, kept_tokens))
                room = batch.num_rows if max_predictions is None else max(0, max_predictions - kept)
                if return_predictions and room:
                    kept_losses.append(scores.mean_loss()[:room].numpy())
                    kept_tokens.append(scores.tokens[:room].numpy())
    if samples != manifest.rows(split):
        raise RuntimeError(f"{dataset_dir}: read {samples} {split} rows but the manifest lists {manifest.rows(split)}")
    mean_loss = loss / tokens if tokens else float("nan")
    metrics = {
        f"{split}_loss": mean_loss,
        f"{split}_perplexity": perplexity(mean_loss),
        f"{split}_token_accuracy": correct / tokens if tokens else float("nan"),
        f"{split}_tokens": tokens,
        f"{split}_scored_rows": float(scored_rows),
        f"{split}_samples": float(samples),
    }
    result = EvalResult(task=LANGUAGE_MODEL, split=split, samples=samples, metrics=metrics, seconds=0.0)
    if return_predictions:
        result.predictions = np.concatenate(kept_losses) if kept_losses else np.empty(0)
        result.targets = np.concatenate(kept_tokens) if kept_tokens else np.empty(0, dtype=np.int64)
    result.seconds = time.perf_counter() - started
    return result


class TokenScorer:
    """The served next_token model: a DataFrame with the text column (raw strings; other columns ignored) -> per
    row ``tokens``, ``loss``, ``perplexity`` (module docstring), the evaluation's computation."""

    def __init__(self, model: nn.Module, meta: dict[str, Any], batch_size: int = 1024):
        self.model, self.meta = model.eval(), meta
        self.objective = objective_from_checkpoint(meta)
        self.info, self._codec = modelled_text(meta)
        self.inputs = {self.info.name: self.info}
        self.features = [self.info.name]  # the only column the served model needs
        self.task = LANGUAGE_MODEL
        self.batch_size = rows_per_batch(self.info, self.objective.vocab_size, batch_size, EVAL_BATCH_BYTES)

    @classmethod
    def from_checkpoint(cls, path: str | Path, batch_size: int = 1024) -> TokenScorer:
        return cls(*load_model_checkpoint(path), batch_size)

    def score(self, frame: pd.DataFrame) -> pd.DataFrame:
        name = self.info.name
        if name not in frame.columns:
            raise ValueError(f"input is missing the text column {name!r} the next_token model scores")
        try:
            column = pa.array(frame[name].tolist(), from_pandas=True)
            starts = range(0, len(column), self.batch_size)
            scores = [self._score_rows(column.slice(start, self.batch_size)) for start in starts]
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as error:
            raise ValueError(f"input column {name!r} cannot be scored as text: {error}") from None
        tokens = np.concatenate([s.tokens.numpy() for s in scores]) if scores else np.empty(0, dtype=np.int64)
        loss = np.concatenate([s.mean_loss().numpy() for s in scores]) if scores else np.empty(0)
        with np.errstate(over="ignore"):
            perplexities = np.exp(np.minimum(loss, MAX_LOG_PERPLEXITY))  # NaN stays NaN
        return pd.DataFrame({"tokens": tokens, "loss": loss, "perplexity": perplexities}, index=frame.index)

    predict = score  # what log_pyfunc_model infers the output signature from

    def _score_rows(self, column: pa.Array) -> RowScores:
        with torch.inference_mode():
            return score_batch(self.model, self.objective, encode_texts(self._codec, column))
