"""The built-in tabular model ``mlp`` and the blocks the other built-in models reuse for their tabular inputs:
an embedding per categorical or hashed input (``embedding_dim``), the numeric and vector inputs as one block
(``numeric_block``), and the kinds an MLP takes (``TABULAR_KINDS``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from training.kinds.inputs import EMBEDDED_KINDS, InputInfo, block_names, numeric_names
from training.models.numeric_embeddings import DEFAULT_DIM, NumericEmbeddings

NUMERIC_EMBEDDINGS = ("ple", "none")  # model_kwargs numeric_embeddings: the input stem's choice


def embedding_dim(cardinality: int) -> int:
    """The embedding width of an input with ``cardinality`` rows: fastai's rule, min(64, round(1.6 * c^0.56))."""
    return max(1, min(64, round(1.6 * cardinality**0.56)))


class MLP(nn.Module):
    """Feed-forward net over every tabular input: Linear -> ReLU (-> Dropout) per hidden layer, then a head.

    Its input row is, in this order: the numeric inputs (manifest order; each as its numeric embedding,
    ``numeric_embeddings.py``, unless ``numeric_embeddings: none`` or its dataset has no bins) and the missing
    indicators of those whose train split held nulls (``block_names``), then each vector input, then an
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
        numeric_embeddings: str = "ple",
        numeric_embedding_dim: int = DEFAULT_DIM,
    ):
        super().__init__()
        self.numeric = block_names(inputs)  # the numeric inputs, then their missing indicators
        stem = numeric_stem(inputs, numeric_embeddings, numeric_embedding_dim)
        self.vectors = [name for name, info in inputs.items() if info.kind == "vector"]
        embedded = {name: info for name, info in inputs.items() if info.kind in EMBEDDED_KINDS}
        unknown = [f"{name} ({info.kind})" for name, info in inputs.items() if info.kind not in TABULAR_KINDS]
        if unknown:
            raise ValueError(f"train.model mlp takes numeric, categorical, hashed and vector inputs, not {unknown}")
        widths = {
            name: int((embedding_dims or {}).get(name, embedding_dim(info.cardinality)))
            for name, info in embedded.items()
        }
        width = len(self.numeric) + sum(inputs[name].shape[0] for name in self.vectors) + sum(widths.values())
        if stem is not None:  # each numeric input becomes its embedding; the missing indicators stay as they are
            width += stem.out_features - stem.weight.shape[0]
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
        if stem is not None:
            self.numeric_embeddings = stem

    def forward(self, batch):
        if isinstance(batch, torch.Tensor):
            return self.net(self._stem(batch))
        parts = [self._stem(numeric_block(batch, self.numeric))] if self.numeric else []
        parts += [batch[name] for name in self.vectors]
        parts += [self.embeddings[name](batch[name]) for name in self.embedded]
        return self.net(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))

    def _stem(self, block: torch.Tensor) -> torch.Tensor:
        """The numeric block ``[B, F]`` as the first layer takes it: with numeric embeddings, each numeric
        input's embedding, then the missing indicators."""
        stem = getattr(self, "numeric_embeddings", None)
        if stem is None:
            return block
        count = stem.weight.shape[0]
        return torch.cat([stem(block[:, :count]), block[:, count:]], dim=1)


def numeric_stem(inputs: dict[str, InputInfo], choice: str, dim: int) -> NumericEmbeddings | None:
    """The numeric embeddings of the inputs' numeric columns (``numeric_embeddings: ple``, the default), or None:
    ``none``, no numeric input, or a dataset prepared before the bins (no input has ``InputInfo.bins``)."""
    if choice not in NUMERIC_EMBEDDINGS:
        raise ValueError(f"train.model_kwargs.numeric_embeddings must be one of {NUMERIC_EMBEDDINGS}, not {choice!r}")
    numeric = [inputs[name] for name in numeric_names(inputs)]
    if choice == "none" or not any(info.bins is not None for info in numeric):
        return None
    return NumericEmbeddings([info.bins for info in numeric], int(dim))


TABULAR_KINDS = ("numeric", "vector", *EMBEDDED_KINDS)


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
