"""Text models (training/text_models.py): padding never changes a row's output, empty rows pool to zero, text
mixes with tabular inputs, ``auto`` picks the transformer."""

from __future__ import annotations

import pytest
import torch

from training.models import ModelSpec, build_model, pick_model
from training.spec.inputs import InputInfo

VOCAB, MAX_LEN = 50, 12


def text_info(name="snippet"):
    return InputInfo(name, "text", "int64", (), VOCAB, {"max_len": MAX_LEN, "tokenizer": {"type": "bpe"}})


INPUTS = {
    "stars": InputInfo("stars", "numeric", "float32"),
    "snippet": text_info(),
    "site": InputInfo("site", "categorical", "int64", (), 5),
}


def padded(rows: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(1, max(map(len, rows)))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row, dtype=torch.int64), True
    return ids, mask


def batch_of(rows, width=None):
    ids, mask = padded(rows, width)
    count = len(rows)
    return {
        "stars": torch.linspace(-1, 1, count),
        "snippet": ids,
        "snippet_mask": mask,
        "site": torch.arange(count) % 5,
    }


def model(seed=0, **kwargs):
    torch.manual_seed(seed)
    spec = ModelSpec.for_inputs("auto", INPUTS, 3, {"d_model": 16, "n_heads": 2, "n_layers": 2, **kwargs})
    assert spec.model == "transformer"
    return build_model(spec)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_padding_never_changes_a_rows_output(mode):
    net = model().train(mode == "train")
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [], [3]]
    together = batch_of(rows)
    context = torch.inference_mode() if mode == "eval" else torch.enable_grad()
    with context:
        out = net(together)
        for i, row in enumerate(rows):
            alone = {name: tensor[i : i + 1] for name, tensor in batch_of(rows).items()}
            alone["snippet"], alone["snippet_mask"] = padded([row])
            assert torch.allclose(net(alone), out[i : i + 1], atol=1e-6, rtol=0), (mode, i)
        wider = net(batch_of(rows, width=MAX_LEN))  # more padding than the longest row
        assert torch.allclose(wider, out, atol=1e-6, rtol=0)
    assert torch.isfinite(out).all()


def test_an_empty_row_pools_to_zero_and_gets_gradients_only_where_it_should():
    net = model()
    ids, mask = padded([[], [4, 5]])
    encoder = net.encoders["snippet"]
    pooled = encoder.pooled(ids, mask)
    assert torch.equal(pooled[0], torch.zeros(16)) and pooled[1].abs().sum() > 0
    loss = net(batch_of([[], []])).sum()
    loss.backward()  # no NaN in any gradient from a batch of empty rows
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_text_mixes_with_tabular_inputs_each_of_which_changes_the_output():
    net = model().eval()
    base = batch_of([[5, 6, 7], [8, 9]])
    with torch.inference_mode():
        out = net(base)
        for name, change in (("stars", lambda t: t + 1), ("site", lambda t: (t + 1) % 5), ("snippet", lambda t: t + 1)):
            changed = {**base, name: change(base[name])}
            assert not torch.allclose(net(changed), out), name


def test_auto_is_mlp_without_text_and_transformer_needs_text():
    tabular = {name: info for name, info in INPUTS.items() if info.kind != "text"}
    assert pick_model("auto", tabular) == "mlp"
    assert pick_model("auto", INPUTS) == "transformer"
    with pytest.raises(ValueError, match="transformer needs at least one text input"):
        build_model(ModelSpec.for_inputs("transformer", tabular, 2, {}))
    with pytest.raises(
        ValueError, match="mlp takes numeric, categorical, hashed and vector inputs.*snippet \\(text\\)"
    ):
        build_model(ModelSpec.for_inputs("mlp", INPUTS, 2, {}))


def test_the_most_confidently_wrong_rows_are_kept_across_batches_with_text_cut_for_display():
    import pyarrow as pa

    from training.wrong_rows import ConfidentlyWrong

    wrong = ConfidentlyWrong(["snippet"], ["py", "sql"], count=2, max_chars=8)
    first = pa.record_batch({"snippet": ["SELECT 1", "import os, sys, re", None]})
    wrong.add(
        0, first, torch.tensor([1, 1, 0]), torch.tensor([0, 1, 1]), torch.tensor([[0.7, 0.3], [0.1, 0.9], [0.4, 0.6]])
    )
    second = pa.record_batch({"snippet": ["def f(): pass", "ok"]})
    wrong.add(3, second, torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([[0.95, 0.05], [0.99, 0.01]]))
    rows = wrong.rows()
    assert [(r["row"], r["label"], r["predicted"]) for r in rows] == [(3, "sql", "py"), (0, "sql", "py")]
    assert rows[0]["confidence"] == pytest.approx(0.95) and rows[0]["snippet"] == "def f()…"
    assert rows[1]["snippet"] == "SELECT 1"


def test_next_token_targets_loss_per_target_token_and_a_causal_model_blind_to_padding():
    import torch.nn.functional as F

    from training.spec.next_token import IGNORE, NextToken

    objective = NextToken(input="snippet", vocab_size=VOCAB)
    torch.manual_seed(0)
    net = build_model(
        ModelSpec.for_inputs("auto", INPUTS, VOCAB, {"d_model": 16, "n_heads": 2, **objective.model_kwargs()})
    )
    rows = [[5, 6, 7, 8], [9], [], [3, 4]]
    batch = batch_of(rows)
    targets = objective.targets(batch, None)
    assert targets.tolist() == [[6, 7, 8, IGNORE], [IGNORE] * 4, [IGNORE] * 4, [4, IGNORE, IGNORE, IGNORE]]
    outputs = net(batch)
    assert outputs.shape == (4, 4, VOCAB)
    weights = objective.row_weights(targets)
    assert weights.tolist() == [3, 0, 0, 1]
    # Σ w·ℓ over rows is the sum over every target token: the mean per token once divided by Σ w.
    total = (objective.per_row_loss(outputs, targets) * weights).sum()
    flat = F.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    assert torch.allclose(total, flat, rtol=1e-6)
    # Causal: a position's logits see only the tokens before it, so a longer row's prefix scores as the prefix.
    with torch.no_grad():
        prefix = net(batch_of([[5, 6]]))
        assert torch.allclose(net(batch)[0, :2], prefix[0], atol=1e-6)
        wider = net(batch_of(rows, width=MAX_LEN))[:, :4]
        real = torch.stack([torch.tensor([True] * len(r) + [False] * (4 - len(r))) for r in rows])
        assert torch.allclose(wider[real], net(batch)[real], atol=1e-6)
