"""Numeric embeddings for the tabular model's input stem: piecewise-linear encoding (PLE) on the train split's
quantile bins, each feature's encoding mapped to a vector of its own (Gorishniy et al., "On Embeddings for
Numerical Features in Tabular Deep Learning", NeurIPS 2022; ddpflow's own code).

The bins are fitted at prepare on the train split's whole column (training/kinds/tabular.py:
``NumericCodec.fit_train_column``) and reach the model scaled as its input is (``InputInfo.bins``), so the
model needs nothing but its inputs record.

PLE of a value ``x`` over the edges ``b_0 < ... < b_T`` (T bins) is T numbers: 1 for each bin wholly below
``x``, 0 for each bin wholly above, and ``(x - b_{t-1}) / (b_t - b_{t-1})`` for the bin holding it; the first
bin's share may go below 0 and the last one's above 1 (values beyond the train range keep a slope). A feature
with fewer bins than the widest pads with zeros; one without bins (a constant) encodes to zeros.

The embedding of feature ``f`` is ``x * w_f + c_f + PLE(x) @ W_f`` (``d`` numbers; ``W_f`` starts at zero, so
training starts from a linear embedding of each value and learns its steps and thresholds: the paper's
"version B" of piecewise-linear embeddings).

    embeddings = NumericEmbeddings([info.bins for info in numeric_inputs], dim=16)
    embeddings(x)                 # x: [B, F] scaled values -> [B, F * dim]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

DEFAULT_DIM = 16  # numbers per numeric input (the paper's and TabM's embeddings are 16 to 32 wide)


class PiecewiseLinearEncoding(nn.Module):
    """``[B, F]`` -> ``[B, F, T]``, T the most bins of any feature; ``bins[f]``: feature f's edges, increasing."""

    def __init__(self, bins: Sequence[Sequence[float] | None]):
        super().__init__()
        counts = [max(len(edges or ()) - 1, 0) for edges in bins]
        width = max([1, *counts])
        shape = (len(bins), width)
        # A padding bin is clamped to [0, 0], so it encodes to 0 without a mask.
        left, size, lower, upper = torch.zeros(shape), torch.ones(shape), torch.zeros(shape), torch.zeros(shape)
        for f, (edges, count) in enumerate(zip(bins, counts)):
            if not count:
                continue
            edges = torch.tensor(list(edges), dtype=torch.float32)
            steps = edges[1:] - edges[:-1]
            if not bool((steps > 0).all()):
                raise ValueError(f"numeric embeddings: feature {f}'s bin edges are not strictly increasing")
            left[f, :count], size[f, :count], upper[f, :count] = edges[:-1], steps, 1.0
            lower[f, 0], upper[f, count - 1] = -math.inf, math.inf  # the outer bins extrapolate
        self.n_bins = counts
        for name, value in (("left", left), ("size", size), ("lower", lower), ("upper", upper)):
            self.register_buffer(name, value, persistent=False)  # rebuilt from the spec: not in state dicts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.by_feature(x).transpose(0, 1)

    def by_feature(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, F]`` -> ``[F, B, T]``: the encoding laid out feature by feature, as ``NumericEmbeddings`` multiplies
        it with each feature's steps in one batched matmul (no copy to reorder it). One ``[F, B, T]`` tensor, each
        step in place on it: a second one for the clamp made the whole model's forward 8% slower on a CPU (1,024-row
        calls, 32 inputs of 48 bins); autograd keeps what the clamp's backward needs, the same gradients to the bit."""
        share = (x.t().unsqueeze(-1) - self.left.unsqueeze(1)).div_(self.size.unsqueeze(1))
        return share.clamp_(self.lower.unsqueeze(1), self.upper.unsqueeze(1))


class NumericEmbeddings(nn.Module):
    """``[B, F]`` scaled numeric inputs -> ``[B, F * dim]``: per feature, a linear embedding of the value plus a
    linear map of its piecewise-linear encoding (zero at the start)."""

    def __init__(self, bins: Sequence[Sequence[float] | None], dim: int = DEFAULT_DIM):
        super().__init__()
        if dim < 1:
            raise ValueError(f"numeric_embedding_dim must be at least 1, got {dim}")
        self.encoding = PiecewiseLinearEncoding(bins)
        features, width = self.encoding.left.shape
        bound = 1.0 / math.sqrt(dim)
        self.weight = nn.Parameter(torch.empty(features, dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(features, dim).uniform_(-bound, bound))
        self.steps = nn.Parameter(torch.zeros(features, width, dim))
        self.dim = dim

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] * self.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = x.unsqueeze(-1) * self.weight + self.bias  # [B, F, d]
        stepped = torch.bmm(self.encoding.by_feature(x), self.steps)  # [F, B, d]: each feature times its own steps
        return (linear + stepped.transpose(0, 1)).flatten(1)
