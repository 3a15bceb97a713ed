"""The built-in model for text inputs: ``train.model: transformer`` (what ``auto`` picks when an input is text).

Each text input (training/kinds/text.py: ``<name>`` int64 token ids [B, L], ``<name>_mask`` bool [B, L]) goes
through its own small encoder: token embedding + learned position embedding (``max_len`` positions), torch's
``nn.TransformerEncoder`` (pre-norm, GELU), masked mean pooling over the real tokens -> [B, d_model]. The pooled
vectors join the other inputs (numeric, categorical, hashed, vector) in the ``MLP`` head (training/models/registry.py),
as vector inputs of width ``d_model``: text mixes with a table in one model. With ``language_model: <text>``
(what ``train.objective: next_token`` sets, training/objectives/next_token.py) it is a causal language model of that
text instead: the encoder under a causal mask, a linear head per position -> [B, L, vocab].

Padding never changes a row's output: padded keys are masked out of attention and out of the pooling, so a row
scores the same alone and in a batch padded to a longer row (to float rounding, ~1e-7), which is what keeps
the exact update exact across world sizes (a row's batch-mates differ). A row of zero tokens (null or empty
text) pools to a zero vector: its attention may look at its first (pad) position, so softmax never sees a row
with every key masked (that would be NaN), and the pooling ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from training.kinds.base import TOKENS
from training.kinds.inputs import InputInfo
from training.kinds.registry import inputs_in
from training.kinds.tabular import VectorCodec
from training.models.tabular import MLP


class TextEncoder(nn.Module):
    """One text input's ids [B, L] and mask [B, L] -> token states [B, L, d] (``forward``) -> pooled [B, d]."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int, n_heads: int, n_layers: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # No nested tensors: their fast path drops padded positions, ours only masks them (the same outputs).
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        states = self.tokens(ids) + self.positions(positions).unsqueeze(0)
        ignored = ~mask
        ignored[:, 0] &= mask.any(dim=1)  # a row of no tokens attends to its first position (never all masked)
        length = ids.shape[1]
        causal_mask = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1) if causal else None
        return self.encoder(states, mask=causal_mask, src_key_padding_mask=ignored, is_causal=causal)

    def pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states = self(ids, mask)
        kept = torch.where(mask.unsqueeze(-1), states, torch.zeros((), dtype=states.dtype, device=states.device))
        return kept.sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1).to(states.dtype)


class TextTransformer(nn.Module):
    """A ``TextEncoder`` per text input, pooled, then the ``MLP`` head over them and every other input."""

    def __init__(
        self,
        inputs: dict[str, InputInfo],
        n_outputs: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        dropout: float = 0.0,
        hidden: Sequence[int] = (64,),
        embedding_dims: dict[str, int] | None = None,
        language_model: str | None = None,
    ):
        super().__init__()
        self.texts = inputs_in(inputs, TOKENS)
        if not self.texts:
            raise ValueError("train.model transformer needs at least one text input (data.inputs: {name: text})")
        if language_model is not None and language_model not in self.texts:
            raise ValueError(f"language_model: {language_model!r} is not a text input ({self.texts})")
        self.language_model = language_model
        if language_model is not None:  # next_token: that text alone, causal, a token head per position
            self.texts = [language_model]
        self.encoders = nn.ModuleDict(
            {
                name: TextEncoder(
                    inputs[name].cardinality, int(inputs[name].options["max_len"]), d_model, n_heads, n_layers, dropout
                )
                for name in self.texts
            }
        )
        # Each pooled text is a vector input of the head, in the inputs' order.
        head_inputs = {
            name: InputInfo(name, VectorCodec.kind, "float32", (d_model,)) if name in self.encoders else info
            for name, info in inputs.items()
        }
        if language_model is not None:
            self.head = nn.Linear(d_model, n_outputs)
        else:
            self.head = MLP(head_inputs, n_outputs, hidden=hidden, dropout=dropout, embedding_dims=embedding_dims)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.language_model is not None:  # [B, L, vocab]: position t's logits for token t + 1
            name = self.language_model
            return self.head(self.encoders[name](batch[name], batch[f"{name}_mask"], causal=True))
        pooled = {name: self.encoders[name].pooled(batch[name], batch[f"{name}_mask"]) for name in self.texts}
        return self.head({**batch, **pooled})


def transformer(inputs: dict[str, InputInfo], n_outputs: int, **kwargs) -> TextTransformer:
    return TextTransformer(inputs, n_outputs, **kwargs)
