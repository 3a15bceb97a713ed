"""``train.objective: next_token``: a language model on a text input (training/kinds/text.py).

    train:
      objective: next_token
      objective_kwargs: {input: snippet}      # optional with one text input
      model: auto                              # the transformer, causal, with a token head (training/models/text.py)

Each row's targets are its own tokens shifted by one: position t predicts token t + 1, so a row of n tokens
(after the cut to max_len) has n - 1 target tokens and a row of 0 or 1 tokens has none. The loss contract
(training/objectives/registry.py) holds with

    ℓ_i = the mean cross entropy over row i's target tokens,   w_i = row i's number of target tokens,

so L = Σ w_i ℓ_i / Σ w_i is the mean over every target token of the global step, and its denominator (the
step's target tokens on all ranks) is ``TrainBatches.global_weight``: computed on every rank from the shared
permutation and each row's token count, known from the node cache's offsets (``split_row_weights``), with no
collective at all. A row without targets weighs 0. val_loss is the mean per target token of the val split,
val_perplexity its exp.

The model's output is per position, ``[B, L, vocab]``; the label column of the dataset is not used.
``row_scores`` is each row's (target tokens, summed cross entropy, top-1 hits): the test-split evaluation sums
them (test_loss per target token, test_perplexity, test_token_accuracy) and the served model divides them per
row (loss, perplexity; NaN for a row without targets), one computation for both (training/inference/token_scoring.py).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from training.core.config import ConfigError
from training.kinds.base import TOKENS as TOKEN_IDS
from training.kinds.registry import kind_record
from training.objectives.base import TOKEN_SCORER, Evaluation, Objective
from training.objectives.metrics import MeanTally

TOKENS = "tokens"  # the label kind: [B, L] target ids per position, IGNORE where there is none
IGNORE = -100


LANGUAGE_MODEL = "next_token"  # the objective's name, and what its evaluation is (EvalResult.task)
MAX_LOG_PERPLEXITY = 700.0  # exp(700) ~ 1e304: a perplexity stays a finite float (the gate rejects inf)
# Scored per target token, whatever the dataset's task (training/inference/token_scoring.py); judged on test_loss,
# lower is better; shown as its rows by their loss per target token (they have no label to be wrong about).
EVALUATION = Evaluation(
    scored_as=LANGUAGE_MODEL,
    gate_metric="test_loss",
    headline=("test_loss", "test_perplexity", "test_token_accuracy"),
    scorer=TOKEN_SCORER,
    keeps_predictions=True,
    figure="row_loss",
    note="{test_tokens:.0f} target tokens of {samples} test rows scored, per target token; the confusion matrix, "
    "per-class metrics and most confidently wrong rows need a label per row and are not made for a language "
    "model (eval/row_loss.png instead)",
)


def perplexity(loss: float) -> float:
    """exp(the mean cross entropy per target token), capped at exp(MAX_LOG_PERPLEXITY); NaN stays NaN."""
    return math.exp(min(loss, MAX_LOG_PERPLEXITY)) if not math.isnan(loss) else math.nan


class RowScores(NamedTuple):
    """Per row: ``tokens`` (int64, target tokens scored), ``loss_sum`` (float64, their summed cross entropy),
    ``correct`` (int64, targets that are the top-1 next token)."""

    tokens: torch.Tensor
    loss_sum: torch.Tensor
    correct: torch.Tensor

    def mean_loss(self) -> torch.Tensor:
        """Each row's mean cross entropy per target token (float64); NaN for a row without targets."""
        return torch.where(self.tokens > 0, self.loss_sum / self.tokens.clamp(min=1), torch.nan)


class NextToken(Objective):
    name, label_kind = LANGUAGE_MODEL, TOKENS
    uses_label = False  # its targets are the text's own tokens: the dataset's label is not read

    @classmethod
    def evaluation(cls, task: str) -> Evaluation:
        return EVALUATION

    def __init__(self, n_classes: int | None = None, input: str | None = None, vocab_size: int | None = None):
        super().__init__(n_classes, input=input, vocab_size=vocab_size)
        self.input, self.vocab_size = input, vocab_size

    def n_outputs(self, n_classes: int | None) -> int:
        return int(self.vocab_size)

    def model_kwargs(self) -> dict[str, Any]:
        return {"language_model": self.input}

    def targets(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        ids, mask = inputs[self.input], inputs[f"{self.input}_mask"]
        target = torch.full_like(ids, IGNORE)
        target[:, :-1] = torch.where(mask[:, 1:], ids[:, 1:], IGNORE)
        return target

    def per_row_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(outputs.float().transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
        return per_token.sum(dim=1) / (labels != IGNORE).sum(dim=1).clamp(min=1)

    def row_weights(self, labels: torch.Tensor) -> torch.Tensor:
        """Each row's target tokens (``labels`` are ``targets``)."""
        return (labels != IGNORE).sum(dim=1).float()

    def split_row_weights(self, split) -> torch.Tensor:
        """Each train row's target tokens, from the text input's ragged lengths: n - 1, at least 0."""
        return (split.inputs[self.input].lengths() - 1).clamp(min=0).float()

    def row_scores(self, outputs: torch.Tensor, targets: torch.Tensor) -> RowScores:
        """Each row's target tokens, their summed cross entropy (per token in fp32, as ``per_row_loss``; summed
        in float64) and top-1 hits: what the evaluation and the served model read (``targets`` are ``targets``)."""
        scored = targets != IGNORE
        logits = outputs.float()
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        hits = (logits.argmax(dim=-1) == targets) & scored
        return RowScores(scored.sum(dim=1), per_token.double().sum(dim=1), hits.sum(dim=1))

    def decode(self, outputs: torch.Tensor):
        return outputs.argmax(dim=-1), None

    def tally(self, n_classes: int | None):
        return TokenTally(self.per_row_loss, self.row_metrics, self.metric_names())


class TokenTally(MeanTally):
    def metrics(self, sums: torch.Tensor, prefix: str, target_std: float = 1.0) -> dict[str, float]:
        metrics = super().metrics(sums, prefix, target_std)
        if f"{prefix}_loss" in metrics:
            metrics[f"{prefix}_perplexity"] = perplexity(metrics[f"{prefix}_loss"])
        return metrics


def next_token_kwargs(kwargs: dict[str, Any], manifest) -> dict[str, Any]:
    """``objective_kwargs`` with the text input (the only one, when not named) and its vocabulary size."""
    inputs = manifest.inputs or []
    texts = {entry["name"]: entry for entry in inputs if kind_record(entry["kind"]).model_block == TOKEN_IDS}
    name = kwargs.get("input")
    if name is None and len(texts) == 1:
        name = next(iter(texts))
    if name not in texts:
        raise ConfigError(
            f"train.objective: next_token needs a text input (train.objective_kwargs.input): the text inputs are "
            f"{sorted(texts) or 'none'}, given {name!r}"
        )
    return {**kwargs, "input": name, "vocab_size": int(texts[name]["cardinality"])}
