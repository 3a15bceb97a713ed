"""String columns through `ddpflow run` end to end, one run: a CSV of short code snippets labelled by language,
one text input with a tokenizer fitted on train, one with a user's tokenizer.json, a categorical, null and empty
text, train.model left at its default (auto: the transformer). It beats the majority class (its share is logged),
the champion's pyfunc answers raw strings (in process and over HTTP with `mlflow models serve`) with what the
evaluation scored, and the run logs its most confidently wrong rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from devtools.model_server import invocations
from tests.flows.cli_runs import cli_env, run_promoted

REPO = Path(__file__).resolve().parents[2]
ROWS = 600
LANGUAGES = {
    "python": ["def", "return", "import", "lambda", "self", "print", "None", "class", "elif"],
    "sql": ["SELECT", "FROM", "WHERE", "JOIN", "GROUP", "ORDER", "BY", "INSERT", "UPDATE"],
    "shell": ["echo", "grep", "sudo", "chmod", "export", "cd", "ls", "cat", "awk"],
}


def snippets(rows: int = ROWS, seed: int = 0) -> pa.Table:
    """``snippet``: words of the row's language (and a few of another); ``title``: a short mixed line; ``site``."""
    rng = np.random.default_rng(seed)
    languages = rng.choice(sorted(LANGUAGES), size=rows)
    snippet, title = [], []
    for i, language in enumerate(languages):
        words = list(rng.choice(LANGUAGES[language], size=rng.integers(2, 12)))
        words += list(rng.choice(LANGUAGES[rng.choice(sorted(LANGUAGES))], size=rng.integers(0, 2)))
        snippet.append(None if i % 31 == 0 else "" if i % 37 == 0 else " ".join(words))
        title.append(f"{rng.choice(LANGUAGES[language])} snippet {i % 13}")
    return pa.table(
        {"snippet": snippet, "title": title, "site": rng.choice(["gh", "so"], size=rows), "lang": languages}
    )


@pytest.mark.torchrun
def test_a_text_classifier_trains_through_ddpflow_run_and_serves_raw_strings(prefect_harness, make_config, tmp_path):
    import mlflow

    from ddpflow.tracking.runs import WRONG_ROWS_ARTIFACT, use_tracking_uri
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split
    from training.kinds.text import fit_tokenizer

    table = snippets()
    source = tmp_path / "snippets.csv"
    pacsv.write_csv(table, source)
    user_tokenizer = tmp_path / "user-tokenizer.json"  # "a pretrained one": fitted elsewhere, on other rows
    user_tokenizer.write_text(fit_tokenizer("wordpiece", 120, [snippets(200, seed=9)["title"].combine_chunks()]))
    inputs = {
        "snippet": {"kind": "text", "max_len": 16, "tokenizer": {"type": "bpe", "vocab_size": 150}},
        "title": {"kind": "text", "max_len": 8, "tokenizer": str(user_tokenizer)},
        "site": "categorical",
    }
    config = make_config(
        **{
            "data.source": str(source),
            "data.label": "lang",
            "data.inputs": inputs,
            "train.epochs": 3,
            "train.batch_size": 32,
            "train.model_kwargs": {"d_model": 16, "n_heads": 2, "n_layers": 1, "hidden": [16]},
        }
    )
    summary, run_dir, dataset = run_promoted(tmp_path, config, prefect_harness)
    manifest = read_manifest(dataset)
    assert sorted(entry["kind"] for entry in manifest.inputs) == ["categorical", "text", "text"]  # yaml sorts keys
    assert (dataset / "tokenizers" / "snippet.json").is_file()
    assert (dataset / "tokenizers" / "title.json").read_text() == user_tokenizer.read_text()
    test = pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset, "test")]).to_pandas()
    majority = test["lang"].value_counts(normalize=True).max()
    accuracy = summary["test_metrics"]["test_accuracy"]
    assert accuracy > majority + 0.2, f"test accuracy {accuracy:.3f} vs the majority class's {majority:.3f}"
    assert summary["test_metrics"]["test_majority_share"] == pytest.approx(majority, abs=1e-12)
    assert summary["test_metrics"]["test_samples"] == len(test)

    with use_tracking_uri(config["mlflow"]["tracking_uri"]):
        served = mlflow.pyfunc.load_model(f"models:/{config['registry']['model_name']}@champion")
        wrong = mlflow.artifacts.load_dict(f"runs:/{summary['mlflow_run_id']}/{WRONG_ROWS_ARTIFACT}")
    raw = test[list(inputs)].copy()
    raw["snippet"] = raw["snippet"].fillna("")  # what a JSON client sends for a missing text
    evaluated = evaluate_split(run_dir / "model.pt", dataset, return_predictions=True)
    labels = np.asarray(manifest.label_mapping)
    np.testing.assert_array_equal(np.asarray(served.predict(raw)), labels[evaluated.predictions])
    assert wrong["columns"][:4] == ["row", "label", "predicted", "confidence"] and "snippet" in wrong["columns"]
    assert len(wrong["data"]) == min(25, int((evaluated.predictions != evaluated.targets).sum()))
    scored = served.predict(raw.head(4), params={"output": "probabilities"})
    assert list(scored.columns) == ["label", *(f"probability_{label}" for label in labels)]
    np.testing.assert_allclose(scored.iloc[:, 1:].sum(axis=1), 1.0, rtol=1e-5)

    # `mlflow models serve`: JSON strings over HTTP (an empty one too), the same answers as the evaluation.
    uri = f"models:/{config['registry']['model_name']}@champion"
    answered = invocations(uri, config["mlflow"]["tracking_uri"], raw.head(20), tmp_path, cli_env())
    np.testing.assert_array_equal(np.asarray(answered), labels[evaluated.predictions[:20]])
