"""A next_token language model past training: the test-split evaluation (each target token once, checked
against a computation by hand), the champion gate on test_loss (lower is better), the served pyfunc's per-row
scores (equal to the evaluation's), and the pipeline flow end to end.

The model.pt files are built in process as the Trainer builds them (``build_objective``, ``ModelSpec``,
``inference_checkpoint`` with the fitted encoders), on log lines prepared by the real prepare stage: the lines'
level is the dataset's label, which a language model does not use."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import load_config

MAX_LEN = 10
TINY_LM = {"d_model": 16, "n_heads": 2, "n_layers": 1}
WORDS = {
    "INFO": ["user", "login", "ok", "session", "started", "request", "served", "in", "ms"],
    "ERROR": ["disk", "full", "timeout", "connection", "refused", "retry", "failed", "on", "host"],
}


def log_lines(rows: int, seed: int = 3) -> pa.Table:
    """Log lines: a level and words of it; null, empty and one-word rows; some longer than MAX_LEN tokens."""
    rng = np.random.default_rng(seed)
    levels = rng.choice(sorted(WORDS), size=rows)
    lines = []
    for i, level in enumerate(levels):
        words = [level, *rng.choice(WORDS[level], size=rng.integers(0, 14))]
        lines.append(None if i % 17 == 0 else "" if i % 19 == 0 else " ".join(words))
    return pa.table({"line": pa.array(lines, pa.string()), "level": levels})


def prepare_lines(root: Path, rows: int = 240, seed: int = 3) -> Path:
    from training.prepare.dataset import prepare_dataset

    source = root / f"lines-{seed}.csv"
    pacsv.write_csv(log_lines(rows, seed), source)
    inputs = {"line": {"kind": "text", "max_len": MAX_LEN, "tokenizer": {"type": "bpe", "vocab_size": 60}}}
    settings = [f"data.source={source}", f"data.root={root / 'shards'}", "data.label=level"]
    settings += [f"data.inputs={json.dumps(inputs)}", "data.rows_per_shard=16"]
    return Path(prepare_dataset(load_config(None, settings).data).dataset_dir)


def language_model_file(dataset: Path, path: Path, steps: int = 40, seed: int = 0) -> Path:
    """A next_token model.pt as the Trainer writes it, after ``steps`` full-batch Adam steps on the train split."""
    from training.core.manifest import read_manifest
    from training.inference.model_file import inference_checkpoint
    from training.inference.token_scoring import encode_texts, modelled_text
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.models.registry import ModelSpec, build_model
    from training.objectives.registry import build_objective

    manifest = read_manifest(dataset)
    train = load_config(None, ["train.objective=next_token", f"train.model_kwargs={json.dumps(TINY_LM)}"]).train
    objective = build_objective(train, manifest)
    torch.manual_seed(seed)
    spec = ModelSpec.for_inputs(
        "auto", inputs_from_manifest(manifest), objective.n_outputs(None), {**objective.model_kwargs(), **TINY_LM}
    )
    model = build_model(spec)
    encoders = read_encoders(dataset, manifest)
    meta = {"model_spec": spec.to_dict(), "features": manifest.features, "encoders": encoders}
    _, codec = modelled_text({**meta, "objective": objective.describe()})
    files = manifest.split_files(dataset, "train")
    lines = pa.concat_arrays([pq.read_table(f)["line"].combine_chunks() for f in files])
    batch = encode_texts(codec, lines)
    targets = objective.targets(batch, None)
    weights = objective.row_weights(targets)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (objective.per_row_loss(model(batch), targets) * weights).sum() / weights.sum()
        loss.backward()
        optimizer.step()
    model.eval()
    metrics = {"train_loss": float(loss.detach())}
    checkpoint = inference_checkpoint(model.state_dict(), spec, manifest, 1, metrics, encoders)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**checkpoint, "objective": objective.describe()}, path)
    return path


def by_hand(model_path: Path, dataset: Path, strings: list[str | None]) -> list[tuple[int, float, int]]:
    """Each row alone, tokenized with tokenizers' own Tokenizer from the dataset's tokenizer file: (target
    tokens, summed -log p of each next token, top-1 hits), from log_softmax over the model's logits."""
    from tokenizers import Tokenizer

    from training.inference.model_file import load_model_checkpoint

    model, _ = load_model_checkpoint(model_path)
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizers" / "line.json"))
    rows = []
    with torch.inference_mode():
        for text in strings:
            ids = tokenizer.encode(text or "", add_special_tokens=False).ids[:MAX_LEN]
            if len(ids) < 2:
                rows.append((0, 0.0, 0))
                continue
            tokens = torch.tensor([ids])
            logits = model({"line": tokens, "line_mask": torch.ones_like(tokens, dtype=torch.bool)})[0]
            log_p = torch.log_softmax(logits.double(), dim=-1)
            nxt = tokens[0, 1:]
            nll = -log_p[torch.arange(len(ids) - 1), nxt].sum()
            hits = int((logits[:-1].argmax(dim=-1) == nxt).sum())
            rows.append((len(ids) - 1, float(nll), hits))
    return rows


def split_strings(dataset: Path) -> list[str | None]:
    from training.core.manifest import read_manifest

    files = read_manifest(dataset).split_files(dataset, "test")
    return [value for f in files for value in pq.read_table(f)["line"].to_pylist()]


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """(dataset, model.pt) shared by the module's tests: preparing and training cost seconds."""
    root = tmp_path_factory.mktemp("next-token")
    dataset = prepare_lines(root)
    return dataset, language_model_file(dataset, root / "runs" / "lm" / "model.pt")


def test_the_evaluation_counts_each_target_token_once_and_its_loss_is_the_mean_per_target_token(lines):
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    dataset, model_path = lines
    manifest = read_manifest(dataset)
    assert len(manifest.split_files(dataset, "test")) > 1, "the test split spans shards"
    # batch_size 7: batches cross row-group and shard boundaries, each padded to its own longest row.
    result = evaluate_split(model_path, dataset, "test", batch_size=7, return_predictions=True)
    strings = split_strings(dataset)
    hand = by_hand(model_path, dataset, strings)
    tokens = sum(t for t, _, _ in hand)
    assert any(t == 0 for t, _, _ in hand) and any(t == MAX_LEN - 1 for t, _, _ in hand)  # empty and cut rows
    assert result.task == "next_token" and result.samples == manifest.rows("test") == len(strings)
    metrics = result.metrics
    assert metrics["test_tokens"] == tokens
    assert metrics["test_scored_rows"] == sum(t > 0 for t, _, _ in hand)
    assert metrics["test_samples"] == len(strings)
    expected_loss = sum(nll for _, nll, _ in hand) / tokens
    assert metrics["test_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["test_perplexity"] == pytest.approx(math.exp(expected_loss), rel=1e-6)
    assert metrics["test_token_accuracy"] == pytest.approx(sum(h for _, _, h in hand) / tokens, abs=1e-12)
    assert 0 < metrics["test_token_accuracy"] < 1
    # Per row: the mean loss per target token (NaN without targets) and the tokens, in shard order.
    assert result.targets.tolist() == [t for t, _, _ in hand]
    per_row = [nll / t if t else math.nan for t, nll, _ in hand]
    np.testing.assert_allclose(result.predictions, per_row, rtol=1e-5, equal_nan=True)
    # Any batch size scores the same rows alike.
    whole = evaluate_split(model_path, dataset, "test", batch_size=10_000)
    assert whole.metrics["test_tokens"] == tokens
    assert whole.metrics["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-6)
    assert json.dumps(whole.to_dict())  # eval/metrics.json
    # The served scorer is the same computation on raw strings (its pyfunc: the registry test below).
    from training.inference.token_scoring import TokenScorer

    scorer = TokenScorer.from_checkpoint(model_path, batch_size=5)
    served = scorer.score(pd.DataFrame({"line": strings}))
    assert served["tokens"].tolist() == result.targets.tolist()
    np.testing.assert_allclose(served["loss"], result.predictions, rtol=1e-6, equal_nan=True)
    with pytest.raises(ValueError, match="missing the text column 'line'"):
        scorer.score(pd.DataFrame({"text": ["a b"]}))


def test_a_batch_of_logits_is_bounded_in_memory():
    from training.inference.token_scoring import rows_per_batch
    from training.kinds.inputs import InputInfo

    text = InputInfo("line", "text", "int64", (), 8000, {"max_len": 256})
    assert rows_per_batch(text, 8000, 65_536, 256 << 20) == (256 << 20) // (4 * 256 * 8000 * 3) == 10
    assert rows_per_batch(text, 50, 7, 256 << 20) == 7
    assert rows_per_batch(text, 10**9, 7, 256 << 20) == 1


def test_a_dataset_without_the_modelled_text_is_incompatible(lines, tmp_path):
    from manifest_datasets import make_dataset

    from training.inference.evaluate import evaluate_split
    from training.inference.model_file import IncompatibleModelError

    _, model_path = lines
    numeric = make_dataset(tmp_path)
    with pytest.raises(IncompatibleModelError, match="next_token model of the text input 'line'.*lacks it"):
        evaluate_split(model_path, numeric, "test")


def test_the_gate_judges_a_language_model_on_test_loss_lower_is_better():
    from ddpflow.tracking.registration import gate_rules
    from training.core.config import PipelineConfig
    from training.core.directions import higher_is_better

    language_model = PipelineConfig.model_validate({"train": {"objective": "next_token"}})
    rules = gate_rules(language_model, "classification")  # the dataset's label is not what it is judged on
    assert (rules.metric, rules.greater_is_better) == ("test_loss", False)
    classifier = gate_rules(PipelineConfig(), "classification")
    assert (classifier.metric, classifier.greater_is_better) == ("test_accuracy", True)
    assert not higher_is_better("test_perplexity") and not higher_is_better("val_perplexity")
    assert higher_is_better("test_token_accuracy")
    chosen = PipelineConfig.model_validate(
        {"train": {"objective": "next_token"}, "registry": {"metric": "test_perplexity"}}
    )
    assert gate_rules(chosen, "classification").greater_is_better is False


def test_a_language_model_is_registered_behind_the_gate_and_its_pyfunc_scores_rows_as_the_evaluation(
    lines, mlflow_store, tmp_path
):
    """Real MLflow on SQLite: the first model is promoted, a better one (lower test_loss) replaces it, a worse
    one waits as challenger; the champion's pyfunc takes the raw text column alone and returns per row the
    evaluation's tokens and loss (NaN without targets), its perplexity the exp."""
    import mlflow
    from mlflow import MlflowClient

    from ddpflow.tracking.registration import register_candidate
    from ddpflow.tracking.runs import log_evaluation, start_pipeline_run, use_tracking_uri
    from training.core.fileio import atomic_write_json
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    dataset, strong = lines
    weak = language_model_file(dataset, tmp_path / "weak" / "model.pt", steps=3)
    uri, artifacts = mlflow_store
    config = load_config(
        None,
        [
            f"mlflow.tracking_uri={uri}",
            f"mlflow.artifact_location={artifacts}",
            "registry.model_name=log-lines",
            "train.objective=next_token",
        ],
    )
    manifest = read_manifest(dataset)
    ddp = {"nproc_per_node": 1, "nnodes": 1, "backend": "gloo"}

    def register(model_path: Path, name: str):
        run_id = start_pipeline_run(config, name, {}, manifest.fingerprint, manifest, ddp, dataset_dir=dataset)
        result = evaluate_split(model_path, dataset, "test", return_predictions=True)
        metrics_path = atomic_write_json(model_path.parent / "eval" / "metrics.json", result.to_dict())
        log_evaluation(uri, run_id, result, metrics_path, model_path, dataset)
        return run_id, register_candidate(config, run_id, str(model_path), str(dataset), result.metrics, uri)

    weak_run, first = register(weak, "weak")
    _, better = register(strong, "strong")
    _, worse = register(weak, "weak-again")
    assert (first.decision, first.metric, first.greater_is_better) == ("promoted", "test_loss", False)
    assert better.decision == "promoted" and better.candidate_value < better.champion_value == first.candidate_value
    assert worse.decision == "challenger" and worse.champion_version == better.version
    client = MlflowClient(uri)
    artifacts_logged = {item.path for item in client.list_artifacts(weak_run, "eval")}
    assert artifacts_logged == {"eval/metrics.json", "eval/row_loss.png"}  # no confusion matrix, no wrong rows
    description = client.get_model_version("log-lines", better.version).description
    assert description.startswith("next_token model")

    evaluation = evaluate_split(strong, dataset, "test", return_predictions=True)
    strings = split_strings(dataset)
    frame = pd.DataFrame({"line": strings, "level": "INFO"})  # extra columns are ignored
    with use_tracking_uri(uri):
        served = mlflow.pyfunc.load_model("models:/log-lines@champion")
        scores = served.predict(frame)
        signature = served.metadata.get_input_schema().input_names()
        outputs = served.metadata.get_output_schema().input_names()
    assert signature == ["line"] and outputs == ["tokens", "loss", "perplexity"]
    assert scores["tokens"].tolist() == evaluation.targets.tolist()
    np.testing.assert_allclose(scores["loss"], evaluation.predictions, rtol=1e-6, equal_nan=True)
    np.testing.assert_allclose(scores["perplexity"], np.exp(scores["loss"]), rtol=1e-9, equal_nan=True)
    empty = scores["tokens"] == 0
    assert empty.any() and scores["loss"][empty].isna().all() and scores["perplexity"][empty].isna().all()
    weighted = (scores["loss"][~empty] * scores["tokens"][~empty]).sum() / scores["tokens"].sum()
    assert weighted == pytest.approx(evaluation.metrics["test_loss"], rel=1e-6)
    # A line longer than max_len is scored on its first MAX_LEN tokens, as in training.
    long_line = "ERROR " + "disk full " * 20
    cut = " ".join(long_line.split()[:MAX_LEN])
    pair = served.predict(pd.DataFrame({"line": [long_line, cut]}))
    assert pair["tokens"].tolist() == [MAX_LEN - 1, MAX_LEN - 1] and pair["loss"][0] == pytest.approx(pair["loss"][1])
    with pytest.raises(Exception, match=r"missing inputs \['line'\]"):  # MLflow's schema check says so
        served.predict(pd.DataFrame({"level": ["INFO"]}))


def classifier_file(dataset: Path, path: Path) -> Path:
    """A text classifier of the lines' level (untrained: the gate only needs it to score), as the Trainer saves it."""
    from training.core.manifest import read_manifest
    from training.inference.model_file import inference_checkpoint
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.models.registry import ModelSpec, build_model

    manifest = read_manifest(dataset)
    torch.manual_seed(0)
    spec = ModelSpec.for_inputs("auto", inputs_from_manifest(manifest), manifest.n_outputs, TINY_LM)
    checkpoint = inference_checkpoint(
        build_model(spec).state_dict(), spec, manifest, 1, {}, read_encoders(dataset, manifest)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**checkpoint, "objective": {"name": "softmax", "kwargs": {}}}, path)
    return path


def test_a_classifier_champion_is_incompatible_with_a_language_model_candidate(lines, mlflow_store, tmp_path):
    """Both report a test_loss, per row and per target token: the gate does not compare them."""
    from ddpflow.tracking.registration import register_candidate
    from ddpflow.tracking.runs import start_pipeline_run
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    dataset, language_model = lines
    uri, artifacts = mlflow_store
    manifest = read_manifest(dataset)
    settings = [f"mlflow.tracking_uri={uri}", f"mlflow.artifact_location={artifacts}", "registry.model_name=lines"]
    decisions = []
    for model_path, objective in (
        (classifier_file(dataset, tmp_path / "clf" / "model.pt"), "auto"),
        (language_model, "next_token"),
    ):
        config = load_config(None, [*settings, f"train.objective={objective}", "registry.metric=test_loss"])
        run_id = start_pipeline_run(config, objective, {}, manifest.fingerprint, manifest, {}, dataset_dir=dataset)
        metrics = evaluate_split(model_path, dataset, "test").metrics
        decisions.append(register_candidate(config, run_id, str(model_path), str(dataset), metrics, uri))
    assert [d.decision for d in decisions] == ["promoted", "promoted"]
    assert decisions[1].champion_status == "incompatible: it is a classification model; the candidate is next_token"


@pytest.mark.torchrun
def test_the_pipeline_trains_evaluates_and_registers_a_language_model(prefect_harness, mlflow_store, tmp_path):
    """The flow ``ddpflow run`` runs (flows/pipeline.py: train_pipeline), in process under the session's Prefect
    harness: prepare, drift, 1 gloo rank under torchrun, evaluate per target token, the gate on test_loss, the
    champion's pyfunc scoring raw lines."""
    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri
    from flows.pipeline import train_pipeline
    from tests.flows.flow_logs import flow_run_logs
    from training.inference.evaluate import evaluate_split

    uri, artifacts = mlflow_store
    source = tmp_path / "lines.csv"
    pacsv.write_csv(log_lines(240), source)
    inputs = {"line": {"kind": "text", "max_len": MAX_LEN, "tokenizer": {"type": "bpe", "vocab_size": 60}}}
    config = {
        "data": {"source": str(source), "root": str(tmp_path / "shards"), "label": "level", "inputs": inputs},
        "train": {
            "objective": "next_token", "model": "auto", "model_kwargs": TINY_LM, "epochs": 2, "batch_size": 32,
            "lr": 0.01, "nproc_per_node": 1, "backend": "gloo", "num_threads": 1, "run_root": str(tmp_path / "runs"),
            "max_restarts": 0, "timeout_s": 300, "collective_timeout_s": 60,
        },
        "registry": {"model_name": "nightly-log-lines"},
        "mlflow": {"tracking_uri": uri, "artifact_location": artifacts, "experiment": "next-token-flow"},
    }  # fmt: skip
    summary = train_pipeline(config=config)
    assert summary["decision"] == "promoted", summary["reason"]
    assert "test_loss=" in summary["reason"]  # the first model: judged on its test_loss
    metrics = summary["test_metrics"]
    assert metrics["test_tokens"] > 0 and metrics["test_perplexity"] == pytest.approx(math.exp(metrics["test_loss"]))
    run_dir, dataset = Path(summary["run_dir"]), Path(summary["dataset_dir"])
    assert json.loads((run_dir / "eval" / "metrics.json").read_text())["task"] == "next_token"
    evaluation = evaluate_split(run_dir / "model.pt", dataset, "test", return_predictions=True)
    assert evaluation.metrics["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-9)
    skipped = "need a label per row and are not made for a language model"
    assert skipped in flow_run_logs(summary["flow_run_id"], skipped)
    with use_tracking_uri(uri):
        served = mlflow.pyfunc.load_model("models:/nightly-log-lines@champion")
        scores = served.predict(pd.DataFrame({"line": split_strings(dataset)}))
    assert scores["tokens"].tolist() == evaluation.targets.tolist()
    np.testing.assert_allclose(scores["loss"], evaluation.predictions, rtol=1e-6, equal_nan=True)
