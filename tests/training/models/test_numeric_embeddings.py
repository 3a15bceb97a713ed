"""The mlp's numeric embeddings (training/models/numeric_embeddings.py): piecewise-linear encoding on the bins
its inputs record carries, its shape and values by hand, and the model_kwargs switch that turns it off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.kinds.inputs import InputInfo
from training.models.numeric_embeddings import NumericEmbeddings, PiecewiseLinearEncoding
from training.models.registry import ModelSpec, build_model
from training.models.tabular import embedding_dim

BINS = [(0.0, 1.0, 3.0, 4.0), (-1.0, 1.0), None]  # 3 bins, 1 bin, none (a constant column)


def test_piecewise_linear_encoding_by_hand():
    """[B, F] -> [B, F, T], T the most bins: 1 for a bin wholly below the value, 0 above, the share within its
    own; the first bin extrapolates below, the last above; padding and a feature without bins are 0."""
    encoding = PiecewiseLinearEncoding(BINS)
    x = torch.tensor([[0.5, 0.0, 7.0], [2.0, 3.0, 7.0], [-2.0, -3.0, 7.0], [6.0, 1.0, 7.0], [3.0, 1.0, 7.0]])
    out = encoding(x)
    assert out.shape == (5, 3, 3)
    expected_first = [[0.5, 0, 0], [1, 0.5, 0], [-2, 0, 0], [1, 1, 3], [1, 1, 0]]
    torch.testing.assert_close(out[:, 0], torch.tensor(expected_first, dtype=torch.float32))
    # One bin is both first and last: the value's position on it, unclamped either way; padding stays 0.
    torch.testing.assert_close(out[:, 1, 0], torch.tensor([0.5, 2.0, -1.0, 1.0, 1.0]))
    assert not out[:, 1, 1:].any() and not out[:, 2].any()
    # Continuous at the edges: a value just either side of an edge encodes alike.
    near = encoding(torch.tensor([[3.0 - 1e-6, 0.0, 0.0], [3.0 + 1e-6, 0.0, 0.0]]))
    torch.testing.assert_close(near[0], near[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        PiecewiseLinearEncoding([(0.0, 0.0, 1.0)])


def test_the_encoding_makes_one_tensor_of_its_size_and_the_gradients_of_the_clamp():
    """The encoding ``[F, B, T]`` is one tensor, each step in place on it (a second one for the clamp cost the
    model's forward 8% on a CPU), with the gradients of the out-of-place clamp, to the bit."""
    from torch.profiler import ProfilerActivity, profile

    encoding = PiecewiseLinearEncoding(BINS)
    x = torch.randn(4096, 3) * 3
    size = 3 * 4096 * 3 * 4  # F x B x T float32
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        encoding.by_feature(x)
    allocating = [e.name for e in profiled.events() if e.name != "[memory]" and e.cpu_memory_usage >= size]
    assert allocating == ["aten::sub"], allocating
    steps = torch.randn(3, 3, 5)
    grads = []
    for clamp in ("in place", "a copy"):
        leaf = x.clone().requires_grad_(True)
        if clamp == "in place":
            share = encoding.by_feature(leaf)
        else:
            share = (leaf.t().unsqueeze(-1) - encoding.left.unsqueeze(1)).div(encoding.size.unsqueeze(1))
            share = torch.clamp(share, encoding.lower.unsqueeze(1), encoding.upper.unsqueeze(1))
        torch.bmm(share, steps).square().sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_numeric_embeddings_start_linear_and_learn_steps():
    """Each feature's embedding is dim numbers: x * w + c at the start (the step weights are zero), and the
    steps get gradients, so training can learn a threshold."""
    embeddings = NumericEmbeddings(BINS, dim=4)
    x = torch.tensor([[0.5, 0.0, 7.0], [2.0, 3.0, 7.0]])
    out = embeddings(x)
    assert out.shape == (2, 12) and embeddings.out_features == 12
    linear = (x.unsqueeze(-1) * embeddings.weight + embeddings.bias).flatten(1)
    torch.testing.assert_close(out, linear)
    out.sum().backward()
    assert embeddings.steps.grad[0, :3].abs().sum() > 0 and not embeddings.steps.grad[2].any()


def test_numeric_embeddings_are_the_papers_formula_with_learned_steps():
    """With steps learned (non-zero), the embedding is ``x * w + c + PLE(x) @ W_f`` per feature, values and
    gradients, whatever the stem's own layout; input gradients flow through the encoding."""
    torch.manual_seed(0)
    embeddings = NumericEmbeddings(BINS, dim=4)
    with torch.no_grad():
        embeddings.steps.normal_()
    x = torch.tensor([[0.5, 0.0, 7.0], [2.0, 3.0, 7.0], [-2.0, -3.0, 7.0], [6.0, 1.0, -7.0]], requires_grad=True)
    out = embeddings(x)
    expected = x.unsqueeze(-1) * embeddings.weight + embeddings.bias
    expected = expected + torch.einsum("bft,ftd->bfd", embeddings.encoding(x), embeddings.steps)
    torch.testing.assert_close(out, expected.flatten(1))
    grads = torch.autograd.grad(out.square().sum(), [x, embeddings.steps, embeddings.weight])
    reference = torch.autograd.grad(expected.square().sum(), [x, embeddings.steps, embeddings.weight])
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, want)
    assert grads[0][:, 0].abs().sum() > 0 and not grads[1][2].any()  # the constant feature's steps: no gradient


def test_the_mlp_embeds_its_numeric_inputs_by_default_and_the_switch_turns_it_off():
    """The default mlp takes the bins from its inputs record (ModelSpec.inputs, what model.pt keeps) and embeds
    each numeric input; ``numeric_embeddings: none`` is the model without them (the same layers as a dataset
    prepared before the bins gives); the missing indicator goes in as it is."""
    infos = {
        "amount": InputInfo("amount", "numeric", "float32", bins=(0.0, 1.0, 3.0), missing_indicator=True),
        "hour": InputInfo("hour", "numeric", "float32", bins=(-1.0, 0.0, 1.0)),
        "colour": InputInfo("colour", "categorical", "int64", cardinality=5),
    }
    spec = ModelSpec.for_inputs("auto", infos, 2, {})
    assert spec.inputs[0]["bins"] == [0.0, 1.0, 3.0]
    model = build_model(spec)
    assert model.numeric_embeddings.out_features == 2 * 16
    assert model.net[0].in_features == 2 * 16 + 1 + embedding_dim(5)  # embeddings, the indicator, colour
    batch = {
        "amount": torch.tensor([0.5, 5.0]),
        "hour": torch.tensor([0.0, -2.0]),
        "amount.missing": torch.tensor([0.0, 1.0]),
        "colour": torch.tensor([2, 4]),
    }
    assert model(batch).shape == (2, 2)
    plain = build_model(ModelSpec.for_inputs("mlp", infos, 2, {"numeric_embeddings": "none"}))
    assert not hasattr(plain, "numeric_embeddings") and plain.net[0].in_features == 3 + embedding_dim(5)
    older = {name: dataclasses.replace(info, bins=None) for name, info in infos.items()}
    before = build_model(ModelSpec.for_inputs("mlp", older, 2, {}))  # a dataset from before the bins
    assert {k: v.shape for k, v in before.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    with pytest.raises(ValueError, match="numeric_embeddings must be one of"):
        build_model(ModelSpec.for_inputs("mlp", infos, 2, {"numeric_embeddings": "periodic"}))
