"""The built-in tabular model ``mlp`` and the blocks the other built-in models reuse for their tabular inputs:
an embedding per categorical or hashed input (``embedding_dim``), the numeric and vector inputs as one block
(``numeric_block``), and the blocks an MLP takes (``TABULAR_BLOCKS``: each kind's record says which block its
inputs feed, ``training/kinds/base.py: Codec.model_block``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from training.kinds.base import DENSE, EMBEDDING, SCALAR
from training.kinds.inputs import InputInfo, block_names
from training.kinds.registry import block_of, inputs_in


def embedding_dim(cardinality: int) -> int:
    """The embedding width of an input with ``cardinality`` rows: fastai's rule, min(64, round(1.6 * c^0.56))."""
    return max(1, min(64, round(1.6 * cardinality**0.56)))


class MLP(nn.Module):
    """Feed-forward net over every tabular input: Linear -> ReLU (-> Dropout) per hidden layer, then a head.

    Its input row is, in this order: the numeric inputs (manifest order) and the missing indicators of those
    whose train split held nulls (``block_names``), then each vector input, then an
    embedding per categorical and hashed input (``embedding_dim(cardinality)`` wide, or
    ``embedding_dims[name]``). With numeric inputs only it is exactly the earlier MLP: the same layers,
    created in the same order (so the same seed gives the same weights) and the same state dict keys.
    ``forward`` also takes the numeric block ``[B, F]`` as one tensor (benchmarks, older callers)."""

    def __init__(
        self,
        inputs: dict[str, InputInfo],
        n_outputs: int,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
        embedding_dims: dict[str, int] | None = None,
    ):
        super().__init__()
        self.numeric = block_names(inputs)  # the numeric inputs, then their missing indicators
        self.vectors = inputs_in(inputs, DENSE)
        embedded = {name: inputs[name] for name in inputs_in(inputs, EMBEDDING)}
        unknown = [f"{name} ({info.kind})" for name, info in inputs.items() if block_of(info) not in TABULAR_BLOCKS]
        if unknown:
            raise ValueError(f"train.model mlp takes numeric, categorical, hashed and vector inputs, not {unknown}")
        widths = {
            name: int((embedding_dims or {}).get(name, embedding_dim(info.cardinality)))
            for name, info in embedded.items()
        }
        width = len(self.numeric) + sum(inputs[name].shape[0] for name in self.vectors) + sum(widths.values())
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, int(size)), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(size)
        layers.append(nn.Linear(width, n_outputs))
        self.net = nn.Sequential(*layers)  # first: numeric-only models draw their weights as before
        if embedded:
            self.embeddings = nn.ModuleDict(
                {name: nn.Embedding(info.cardinality, widths[name]) for name, info in embedded.items()}
            )
        self.embedded = list(embedded)

    def forward(self, batch):
        if isinstance(batch, torch.Tensor):
            return self.net(batch)
        parts = [numeric_block(batch, self.numeric)] if self.numeric else []
        parts += [batch[name] for name in self.vectors]
        parts += [self.embeddings[name](batch[name]) for name in self.embedded]
        return self.net(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


TABULAR_BLOCKS = (SCALAR, DENSE, EMBEDDING)  # the blocks an MLP takes (and the other built-ins beside theirs)


def mlp(inputs: dict[str, InputInfo], n_outputs: int, **kwargs) -> MLP:
    return MLP(inputs, n_outputs, **kwargs)


def numeric_block(batch: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The numeric inputs ``names`` as one ``[B, F]`` matrix, in that order.

    The loader hands them over as column views of the one block it gathered (training/loading/batches.py); when
    they are exactly its columns, in order, that block IS the matrix and no copy is made. Otherwise (a
    dict built by hand, another order) they are stacked: the same values either way. A model built from a
    bare feature count (``ModelSpec`` without inputs: names x0, x1, ...) takes a dict of as many numeric
    entries, whatever their names, in the dict's order."""
    if names[0] not in batch and len(batch) == len(names) and all(name.startswith("x") for name in names):
        batch, names = dict(zip(names, batch.values())), list(names)
    first = batch[names[0]]
    block = first._base
    if (
        block is not None
        and block.dim() == 2
        and block.shape == (first.shape[0], len(names))
        and block.is_contiguous()
        and all(
            batch[name]._base is block and batch[name].storage_offset() == block.storage_offset() + j
            for j, name in enumerate(names)
        )
    ):
        return block
    return torch.stack([batch[name] for name in names], dim=1)
