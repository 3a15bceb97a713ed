"""The built-in tabular model ``mlp`` and the blocks the other built-in models reuse for their tabular inputs:
an embedding per categorical or hashed input (``embedding_dim``), the numeric and vector inputs as one block
(``numeric_block``), and the blocks an MLP takes (``TABULAR_BLOCKS``: each kind's record says which block its
inputs feed, ``training/kinds/base.py: Codec.model_block``)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
from torch import nn

from training.core.config import DEFAULT_LR
from training.kinds.base import DENSE, EMBEDDING, SCALAR
from training.kinds.inputs import InputInfo, block_names, numeric_names
from training.kinds.registry import block_of, inputs_in
from training.models.numeric_embeddings import DEFAULT_DIM, NumericEmbeddings

NUMERIC_EMBEDDINGS = ("ple", "none")  # model_kwargs numeric_embeddings: the input stem's choice
# model_kwargs activation: the hidden layers' nonlinearity. relu (the default) scores best on the real tables; a
# smooth one (silu, gelu) keeps the weights of 1 rank x 2b and W ranks x b within 1e-4 under Adam, where relu's kink
# lets float rounding put a unit on one side for one world size and on the other for another (docs/training.md,
# "What the exact update promises").
ACTIVATIONS = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}

# The built-in mlp's defaults for a run (training/resolve.py fills them into train.model_kwargs; docs/models.md says
# where each comes from). The class's own defaults stay those of the model.pt files written before, which rebuild
# from their recorded model_kwargs.
MLP_DEFAULTS: dict = {"hidden": [256, 256], "scale_embeddings": True}
# ensemble: TabM's k members on a small train split, where their time is the launch's, one member above it.
SMALL_TABLE_ROWS = 10_000
SMALL_TABLE_ENSEMBLE = 8
# train.lr auto for a regression target: DEFAULT_LR at this many rows per optimizer step and above (RealMLP's and
# TabM's batch), below it the square-root scaling rule for Adam (Malladi et al., NeurIPS 2022).
LR_REFERENCE_ROWS = 256


def default_lr(rows_per_step: int, task: str) -> float:
    """A run's ``train.lr`` when it is ``auto``: for a regression target DEFAULT_LR x sqrt(rows per optimizer step /
    LR_REFERENCE_ROWS), at most DEFAULT_LR; for classes DEFAULT_LR. ``batch_size: auto`` gives a small table small
    steps (8 rows on a 222-row train split over 2 ranks). A squared error's gradient grows with the residual, so on
    a skewed target (salaries, counts) one far row moves a step of 8 rows, and Adam's step does not shrink with that
    noise as SGD's does; the rate comes down with the square root of the rows. A class label's gradient is bounded
    (p - y); the rule was measured on regression targets only (docs/benchmarks.md)."""
    if task != "regression":
        return DEFAULT_LR
    return DEFAULT_LR * min(1.0, math.sqrt(max(1, rows_per_step) / LR_REFERENCE_ROWS))


def default_ensemble(train_rows: int) -> int:
    """A run's ``ensemble`` when ``model_kwargs`` leave it out: SMALL_TABLE_ENSEMBLE members for a train split of
    at most SMALL_TABLE_ROWS rows (one seed's model varies most there, and k members cost seconds), else 1."""
    return SMALL_TABLE_ENSEMBLE if train_rows <= SMALL_TABLE_ROWS else 1


def run_defaults(train_rows: int) -> dict:
    """The mlp's defaults for a run on a train split of ``train_rows`` rows: MLP_DEFAULTS and its ensemble."""
    return {**MLP_DEFAULTS, "ensemble": default_ensemble(train_rows)}


def defaults_to_record(train_rows: int) -> dict:
    """The ``run_defaults`` the class's own defaults do not already give: what a run must record in its
    ``train.model_kwargs`` to rebuild its model."""
    own = {name: param.default for name, param in inspect.signature(MLP.__init__).parameters.items()}
    return {name: value for name, value in run_defaults(train_rows).items() if _plain(own.get(name)) != _plain(value)}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def embedding_dim(cardinality: int) -> int:
    """The embedding width of an input with ``cardinality`` rows: fastai's rule, min(64, round(1.6 * c^0.56))."""
    return max(1, min(64, round(1.6 * cardinality**0.56)))


class MLP(nn.Module):
    """Feed-forward net over every tabular input: Linear -> activation (-> Dropout) per hidden layer, then a head;
    the activation is ``ACTIVATIONS[activation]``: ReLU by default, SiLU or GELU where a run's weights must agree
    across world sizes to 1e-4 (docs/training.md).

    Its input row is, in this order: the numeric inputs (manifest order; each as its numeric embedding,
    ``numeric_embeddings.py``, unless ``numeric_embeddings: none`` or its dataset has no bins), the embedding of
    each dense input's binned column (``binned_columns``: a datetime input's time since the start), the missing
    indicators of the numeric inputs whose train split held nulls (``block_names``), then each vector and
    datetime input (without its embedded column), then an
    embedding per categorical and hashed input (``embedding_dim(cardinality)`` wide, or
    ``embedding_dims[name]``), multiplied by 1/sqrt(its width) with ``scale_embeddings`` (a run's default,
    ``MLP_DEFAULTS``): an embedding then enters the first layer with unit variance at initialisation, as one
    scaled numeric input does, whatever its width; unscaled, an id's 64 N(0, 1) numbers outweigh every other input
    and the first layer can memorise the ids by their random codes (docs/models.md). Its layers (``net``) are
    created first, in order, so with numeric inputs only and no numeric embeddings it is a plain MLP: the same
    seed gives it the same weights, and its state dict holds ``net``'s keys alone.
    ``forward`` also takes the numeric block ``[B, F]`` as one tensor (benchmarks, a caller without a batch dict)."""

    def __init__(
        self,
        inputs: dict[str, InputInfo],
        n_outputs: int,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
        embedding_dims: dict[str, int] | None = None,
        numeric_embeddings: str = "ple",
        numeric_embedding_dim: int = DEFAULT_DIM,
        ensemble: int = 1,
        scale_embeddings: bool = False,
        activation: str = "relu",
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"train.model_kwargs.activation must be one of {tuple(ACTIVATIONS)}, not {activation!r}")
        self.numeric = block_names(inputs)  # the numeric inputs, then their missing indicators
        stem = numeric_stem(inputs, numeric_embeddings, numeric_embedding_dim)
        self.vectors = inputs_in(inputs, DENSE)
        self.binned = binned_columns(inputs) if stem is not None else {}  # dense columns the stem takes
        embedded = {name: inputs[name] for name in inputs_in(inputs, EMBEDDING)}
        unknown = [f"{name} ({info.kind})" for name, info in inputs.items() if block_of(info) not in TABULAR_BLOCKS]
        if unknown:
            raise ValueError(
                f"train.model mlp takes numeric, categorical, hashed, vector and datetime inputs, not {unknown}"
            )
        widths = {
            name: int((embedding_dims or {}).get(name, embedding_dim(info.cardinality)))
            for name, info in embedded.items()
        }
        width = len(self.numeric) + sum(inputs[name].shape[0] for name in self.vectors) + sum(widths.values())
        if stem is not None:  # each numeric input (and binned column) becomes its embedding; the rest stays
            width += stem.out_features - stem.weight.shape[0]
        row_width, layers = width, list[nn.Module]()
        for size in hidden:
            layers += [nn.Linear(width, int(size)), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = int(size)
        layers.append(nn.Linear(width, n_outputs) if ensemble == 1 else EnsembleHead(width, n_outputs, ensemble))
        self.net = nn.Sequential(*layers)  # first: a numeric-only model draws its weights before anything else
        self.output_members = int(ensemble)  # k > 1: outputs [B, k, n_outputs] (training/objectives/base.py)
        self.adapter = EnsembleAdapter(row_width, ensemble) if ensemble > 1 else None
        if embedded:
            self.embeddings = nn.ModuleDict(
                {name: nn.Embedding(info.cardinality, widths[name]) for name, info in embedded.items()}
            )
        self.embedded = list(embedded)
        self.scale_embeddings = scale_embeddings  # off: the class's default, so a model.pt without it loads as trained
        if stem is not None:
            self.numeric_embeddings = stem

    def forward(self, batch):
        if isinstance(batch, torch.Tensor):
            return self.body(torch.cat(self._stem(batch, []), dim=1))
        block = numeric_block(batch, self.numeric) if self.numeric else None
        parts = self._stem(block, [batch[name][:, column : column + 1] for name, column in self.binned.items()])
        parts += [self._vector(name, batch[name]) for name in self.vectors]
        parts += [self._embedded(name, batch[name]) for name in self.embedded]
        return self.body(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))

    def _vector(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """A dense input as the first layer takes it: without its binned column, which the stem embeds."""
        if name not in self.binned:
            return values
        column = self.binned[name]
        return torch.cat([values[:, :column], values[:, column + 1 :]], dim=1)

    def _embedded(self, name: str, index: torch.Tensor) -> torch.Tensor:
        vectors = self.embeddings[name](index)
        return vectors * vectors.shape[-1] ** -0.5 if self.scale_embeddings else vectors

    def body(self, row: torch.Tensor) -> torch.Tensor:
        """The input row ``[B, D]`` -> ``[B, n_outputs]``; an ensemble runs its members on ``[B, k, D]`` and
        returns every member's output, ``[B, k, n_outputs]``: the objective trains each member on its own loss and
        makes one prediction of them (``Objective.member_loss``, ``combine_members``)."""
        return self.net(row if self.adapter is None else self.adapter(row))

    def _stem(self, block: torch.Tensor | None, binned: list[torch.Tensor]) -> list[torch.Tensor]:
        """The numeric block ``[B, F]`` (None: no numeric input) and the dense inputs' binned columns (``[B, 1]``
        each) as the first layer takes them: with numeric embeddings, the embedding of each numeric input and of
        each binned column, then the missing indicators; without, the block as it is."""
        stem = getattr(self, "numeric_embeddings", None)
        if stem is None:
            return [block] if block is not None else []
        count = stem.weight.shape[0] - len(binned)  # the numeric inputs
        columns = ([block[:, :count]] if block is not None else []) + binned
        features = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
        indicators = [block[:, count:]] if block is not None and block.shape[1] > count else []
        return [stem(features), *indicators]


class EnsembleAdapter(nn.Module):
    """TabM-mini's one non-shared part before the body: member i sees the input row scaled by its own ``r_i``
    (``[B, D]`` -> ``[B, k, D]``), ``r`` initialised to random signs (Gorishniy et al., ICLR 2025), so the k
    members start apart and the shared layers after it train them all at once."""

    def __init__(self, width: int, members: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randint(0, 2, (members, width)).float() * 2 - 1)

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        return row.unsqueeze(1) * self.scale


class EnsembleHead(nn.Module):
    """k linear heads, one per member (``[B, k, H]`` -> ``[B, k, O]``): each member's own output, which the
    objective trains on its own loss and averages as predictions, never as logits (TabM; training/objectives/base.py:
    ``member_loss``, ``combine_members``). Each head is initialised as ``nn.Linear`` is (uniform in +-1/sqrt(H))."""

    def __init__(self, width: int, n_outputs: int, members: int):
        super().__init__()
        bound = 1 / math.sqrt(width)
        self.weight = nn.Parameter(torch.empty(members, width, n_outputs).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(members, n_outputs).uniform_(-bound, bound))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bkh,kho->bko", hidden, self.weight) + self.bias


def binned_columns(inputs: dict[str, InputInfo]) -> dict[str, int]:
    """The dense inputs with bins (a datetime input's time since the start), each with its binned column
    (``InputInfo.bins_column``): the numeric embeddings take that column after the numeric inputs."""
    return {name: inputs[name].bins_column for name in inputs_in(inputs, DENSE) if inputs[name].bins is not None}


def numeric_stem(inputs: dict[str, InputInfo], choice: str, dim: int) -> NumericEmbeddings | None:
    """The numeric embeddings of the inputs' numeric columns and binned dense columns (``binned_columns``), in
    that order (``numeric_embeddings: ple``, the default), or None: ``none``, no such column, or a dataset
    prepared before the bins (no input has ``InputInfo.bins``)."""
    if choice not in NUMERIC_EMBEDDINGS:
        raise ValueError(f"train.model_kwargs.numeric_embeddings must be one of {NUMERIC_EMBEDDINGS}, not {choice!r}")
    binned = [inputs[name] for name in (*numeric_names(inputs), *binned_columns(inputs))]
    if choice == "none" or not any(info.bins is not None for info in binned):
        return None
    return NumericEmbeddings([info.bins for info in binned], int(dim))


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
