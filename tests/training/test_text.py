"""Text models (training/models/text.py): padding never changes a row's output, empty rows pool to zero, text
mixes with tabular inputs, ``auto`` picks the transformer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import load_config
from training.kinds.inputs import InputInfo
from training.models.registry import ModelSpec, build_model, pick_model

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
    with pytest.raises(ValueError, match="transformer needs at least one text input.*set train.model: auto or mlp$"):
        build_model(ModelSpec.for_inputs("transformer", tabular, 2, {}))
    with pytest.raises(
        ValueError,
        match="mlp takes numeric, categorical, hashed, vector and datetime inputs.*snippet \\(text\\).*; "
        "set train.model: auto or transformer$",
    ):
        build_model(ModelSpec.for_inputs("mlp", INPUTS, 2, {}))


def test_the_most_confidently_wrong_rows_are_kept_across_batches_with_text_cut_for_display():
    import pyarrow as pa

    from training.inference.wrong_rows import ConfidentlyWrong

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

    from training.objectives.next_token import IGNORE, NextToken

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


# --- real torchrun launches (gloo, CPU): the exact update of a text model, evaluation, serving: TWO launches --

REPO = Path(__file__).resolve().parents[2]
EXACT = 1e-5
TINY = {"d_model": 16, "n_heads": 2, "n_layers": 1, "hidden": [16]}
LANGUAGES = {
    "python": ["def", "return", "import", "lambda", "self", "print", "None", "class"],
    "sql": ["SELECT", "FROM", "WHERE", "JOIN", "GROUP", "ORDER", "BY", "INSERT"],
    "shell": ["echo", "grep", "sudo", "chmod", "export", "cd", "ls", "cat"],
}


def write_snippets(root: Path, rows: int = 157) -> Path:
    """Short "code" snippets labelled by language (a few words of it, some of another; null and empty rows),
    with a categorical site, through the real prepare stage; the train split ends on a short global step."""
    from training.prepare.dataset import prepare_dataset

    rng = np.random.default_rng(7)
    languages = rng.choice(sorted(LANGUAGES), size=rows)
    text = []
    for i, language in enumerate(languages):
        words = list(rng.choice(LANGUAGES[language], size=rng.integers(1, 10)))
        words += list(rng.choice(LANGUAGES[rng.choice(sorted(LANGUAGES))], size=rng.integers(0, 3)))
        text.append(None if i % 23 == 0 else "" if i % 29 == 0 else " ".join(words))
    table = pa.table(
        {"snippet": pa.array(text, pa.string()), "site": rng.choice(["a", "b"], size=rows), "language": languages}
    )
    source = root / "snippets.csv"
    pacsv.write_csv(table, source)
    inputs = {
        "snippet": {"kind": "text", "max_len": 12, "tokenizer": {"type": "bpe", "vocab_size": 100}},
        "site": "categorical",
    }
    settings = [f"data.source={source}", f"data.root={root / 'shards'}", "data.label=language"]
    data = load_config(None, [*settings, f"data.inputs={json.dumps(inputs)}"]).data
    return Path(prepare_dataset(data).dataset_dir)


# The exact-update pairs of the two objectives: case -> its train settings. SGD: the attention's key bias has a
# gradient of exactly 0 (softmax ignores a shift shared by every key), so under Adam its summation-order rounding
# is divided by its own size and steps ~lr (measured: 1.3e-4 at lr 0.002 with AdamW, every other tensor within
# 2.4e-7); SGD keeps the comparison about the gradients.
TEXT_CASES = {
    "classifier": {"optimizer": "sgd", "lr": 0.1},
    "next_token": {"objective": "next_token", "optimizer": "sgd", "lr": 0.1},
}


def launch(root: Path, dataset_dir: Path, nproc: int, batch_size: int) -> dict[str, Path]:
    """Every TEXT_CASES case on ``nproc`` ranks in ONE torchrun launch (tests/multi_case.py: the production
    argv and environment, the real Trainer per case): case -> its run directory."""
    from ddpflow.launch.command import launch_env
    from tests.multi_case import launch_cases

    settings = {"epochs": 2, "num_threads": 1, "lr": 0.002, "model": "auto", "model_kwargs": TINY}
    settings |= {"collective_timeout_s": 60, "nproc_per_node": nproc, "max_restarts": 0, "batch_size": batch_size}
    cases = {
        name: (load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in (settings | train).items()]),
               dataset_dir)
        for name, train in TEXT_CASES.items()
    }  # fmt: skip
    root.mkdir(parents=True)
    base = {name: value for name, value in os.environ.items() if not name.startswith("DDPFLOW_")}
    env = launch_env(next(iter(cases.values()))[0], root, gpus=0, base=base)
    results = launch_cases(root, cases, env, timeout_s=300)
    for result in results.values():
        assert result.returncode == 0, result.output[-4000:]
    return {name: result.run_dir for name, result in results.items()}


@pytest.fixture(scope="module")
def snippets_dataset(tmp_path_factory) -> Path:
    return write_snippets(tmp_path_factory.mktemp("snippets"))


@pytest.fixture(scope="module")
def two_ranks(snippets_dataset, tmp_path_factory) -> dict[str, Path]:
    """2 ranks x 8, both objectives in one launch."""
    return launch(tmp_path_factory.mktemp("text") / "w2", snippets_dataset, nproc=2, batch_size=8)


@pytest.fixture(scope="module")
def one_rank(snippets_dataset, tmp_path_factory) -> dict[str, Path]:
    """1 rank x 16, both objectives in one launch."""
    return launch(tmp_path_factory.mktemp("text") / "w1", snippets_dataset, nproc=1, batch_size=16)


def same_weights(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=EXACT, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.torchrun
def test_a_text_classifier_on_two_ranks_trains_the_weights_of_one_rank_evaluates_and_serves_alike(
    snippets_dataset, two_ranks, one_rank
):
    """2 ranks x 8 against 1 rank x 16 on text + a categorical (an uneven split: the last step is short, null
    and empty rows inside); evaluation's predictions are what the Predictor serves on the raw strings; the most
    confidently wrong rows are kept."""
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor

    dataset = snippets_dataset
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["splits"]["train"]["rows"] % 16, "pick rows whose last global step is short"
    two, one = two_ranks["classifier"], one_rank["classifier"]
    model_two = torch.load(two / "model.pt", weights_only=True)
    assert model_two["model_spec"]["model"] == "transformer"
    assert any(name.startswith("encoders.snippet.encoder.layers.0") for name in model_two["model"])
    difference = same_weights(model_two["model"], torch.load(one / "model.pt", weights_only=True)["model"])
    print(f"\n[exactness] text 2 ranks x 8 vs 1 rank x 16: max |weight difference| = {difference:.2e}")
    for a, b in zip(metrics_of(two), metrics_of(one)):
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-6)
    assert metrics_of(two)[-1]["val_accuracy"] > 0.6  # the words tell the language

    evaluation = evaluate_split(two / "model.pt", dataset, "test", return_predictions=True)
    frame = pd.concat([pq.read_table(dataset / s["file"]).to_pandas() for s in manifest["splits"]["test"]["shards"]])
    predictor = Predictor.from_checkpoint(two / "model.pt")
    served = predictor.predict(frame[["snippet", "site"]])
    assert (served == np.asarray(manifest["label_mapping"])[evaluation.predictions]).all()
    columns, data = evaluation.confidently_wrong["columns"], evaluation.confidently_wrong["data"]
    assert columns == ["row", "label", "predicted", "confidence", "snippet"]
    wrong = [dict(zip(columns, row)) for row in data]
    assert len(wrong) == min(25, int((evaluation.predictions != evaluation.targets).sum()))
    assert all(w["label"] != w["predicted"] for w in wrong)
    assert [w["confidence"] for w in wrong] == sorted((w["confidence"] for w in wrong), reverse=True)
    # Longer than max_len: scored on its first 12 tokens, as in training.
    long = frame.iloc[:1].copy()
    long["snippet"] = [frame["snippet"].fillna("").iloc[0] + " zzz" * 40]
    cut = long.copy()
    cut["snippet"] = [" ".join((long["snippet"].iloc[0]).split()[:12])]
    codec = predictor._codecs["snippet"]
    assert codec.encode_ragged(pa.array(long["snippet"]))[1][0] == 12


@pytest.mark.torchrun
def test_next_token_on_two_ranks_trains_the_weights_of_one_rank_per_target_token(snippets_dataset, two_ranks, one_rank):
    """A language model of the snippets (the label column unused): the step's denominator is its target tokens
    on all ranks (a row of n tokens has n - 1; null, empty and one-token rows none), so 2 ranks x 8 and 1 rank x
    16 take the same steps on an uneven split; val_loss is per target token, val_perplexity its exp."""
    from training.core.manifest import read_manifest
    from training.loading.batches import load_split, manifest_codecs

    dataset = snippets_dataset
    two, one = two_ranks["next_token"], one_rank["next_token"]
    model_two = torch.load(two / "model.pt", weights_only=True)
    assert model_two["objective"]["kwargs"] == {"input": "snippet", "vocab_size": model_two["model_spec"]["n_outputs"]}
    assert model_two["model_spec"]["model_kwargs"]["language_model"] == "snippet"
    difference = same_weights(model_two["model"], torch.load(one / "model.pt", weights_only=True)["model"])
    print(f"\n[exactness] next_token 2 ranks x 8 vs 1 rank x 16: max |weight difference| = {difference:.2e}")
    for a, b in zip(metrics_of(two), metrics_of(one)):
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-6)
        assert a["val_perplexity"] == pytest.approx(np.exp(a["val_loss"]), rel=1e-9)
    first, last = metrics_of(two)[0], metrics_of(two)[-1]
    assert last["val_loss"] < first["val_loss"]  # it learns
    manifest = read_manifest(dataset)
    lengths = load_split(dataset, manifest, "train").with_codecs(manifest_codecs(dataset, manifest))
    assert (lengths.inputs["snippet"].lengths() <= 1).any()  # rows without a target token are in the split
    # model.pt loads back as the language model and scores the test split per target token: the same for both.
    from training.inference.evaluate import evaluate_split

    scored_two, scored_one = (evaluate_split(run / "model.pt", dataset, "test") for run in (two, one))
    assert scored_two.task == "next_token" and scored_two.metrics["test_tokens"] > 0
    assert scored_two.metrics["test_tokens"] == scored_one.metrics["test_tokens"]
    assert scored_two.metrics["test_loss"] == pytest.approx(scored_one.metrics["test_loss"], abs=1e-6)
