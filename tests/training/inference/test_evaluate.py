"""training/inference/evaluate.py and training/inference/predict.py on tiny datasets built from the manifest
contract."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.manifest import read_manifest, write_manifest
from training.inference.evaluate import evaluate_split
from training.inference.model_file import IncompatibleModelError, load_model_checkpoint
from training.inference.predict import Predictor


def read_split(dataset_dir, split="test") -> pd.DataFrame:
    manifest = read_manifest(dataset_dir)
    return pa.concat_tables([pq.read_table(path) for path in manifest.split_files(dataset_dir, split)]).to_pandas()


def reference_outputs(model_path, frame: pd.DataFrame) -> torch.Tensor:
    """The whole split in one forward pass: what streaming must reproduce."""
    model, meta = load_model_checkpoint(model_path)
    x = torch.tensor(frame[meta["features"]].to_numpy(np.float32))
    with torch.no_grad():
        return model((x - torch.tensor(meta["feature_mean"])) / torch.tensor(meta["feature_std"]))


def test_every_row_counted_once_when_batches_do_not_divide_the_split(dataset_factory, model_factory):
    # 997 test rows in shards of 400/400/197, read 128 rows at a time: no batch size divides anything.
    dataset = dataset_factory(rows={"train": 1200, "val": 100, "test": 997}, shard_rows=400)
    model_path = model_factory(dataset)
    result = evaluate_split(model_path, dataset, "test", batch_size=128, return_predictions=True)

    frame = read_split(dataset)
    assert len(read_manifest(dataset).splits["test"].shards) == 3
    assert result.samples == 997 == len(frame)
    assert result.metrics["test_samples"] == 997
    expected = reference_outputs(model_path, frame).argmax(dim=1).numpy()
    np.testing.assert_array_equal(result.predictions, expected)
    np.testing.assert_array_equal(result.targets, frame["label"].to_numpy())
    assert result.metrics["test_accuracy"] == pytest.approx((expected == frame["label"].to_numpy()).mean())
    assert sum(map(sum, result.confusion_matrix)) == 997
    assert result.metrics["test_accuracy"] > 0.8  # the fixture model learned something: normalisation applied


def test_classification_metrics_match_a_direct_computation(dataset_factory, model_factory):
    dataset = dataset_factory(n_classes=3, rows={"train": 900, "val": 60, "test": 301})
    model_path = model_factory(dataset, steps=5)  # weak on purpose: classes get confused
    result = evaluate_split(model_path, dataset, batch_size=50)
    frame = read_split(dataset)
    logits = reference_outputs(model_path, frame)
    target = torch.tensor(frame["label"].to_numpy())
    predicted = logits.argmax(dim=1)
    assert result.metrics["test_loss"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, target)), rel=1e-5
    )
    f1s = []
    for index, label in enumerate(["cat", "dog", "eel"]):
        tp = int(((predicted == index) & (target == index)).sum())
        precision = tp / max(1, int((predicted == index).sum()))
        recall = tp / max(1, int((target == index).sum()))
        assert result.metrics[f"test_precision_{label}"] == pytest.approx(precision)
        assert result.metrics[f"test_recall_{label}"] == pytest.approx(recall)
        assert result.per_class[label]["support"] == int((target == index).sum())
        f1s.append(0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
    assert result.metrics["test_macro_f1"] == pytest.approx(np.mean(f1s))
    assert result.class_labels == ["cat", "dog", "eel"]


def test_regression_metrics(dataset_factory, model_factory):
    dataset = dataset_factory(task="regression", rows={"train": 1000, "val": 50, "test": 333})
    model_path = model_factory(dataset, steps=150)
    result = evaluate_split(model_path, dataset, batch_size=100, return_predictions=True, max_predictions=250)
    frame = read_split(dataset)
    predicted = reference_outputs(model_path, frame).reshape(-1).double().numpy()
    truth = frame["label"].to_numpy().astype(np.float64)
    error = predicted - truth
    assert result.samples == 333
    assert result.metrics["test_rmse"] == pytest.approx(np.sqrt(np.mean(error**2)), rel=1e-5)
    assert result.metrics["test_mae"] == pytest.approx(np.mean(np.abs(error)), rel=1e-5)
    assert result.metrics["test_r2"] == pytest.approx(
        1 - np.sum(error**2) / np.sum((truth - truth.mean()) ** 2), rel=1e-5
    )
    assert result.metrics["test_r2"] > 0.5
    assert len(result.predictions) == 250  # bounded: only the first rows are kept for a plot


def test_reordered_classes_are_remapped(dataset_factory, model_factory, tmp_path):
    dataset = dataset_factory(rows={"train": 1000, "val": 50, "test": 400})
    model_path = model_factory(dataset)
    baseline = evaluate_split(model_path, dataset).metrics["test_accuracy"]
    # The same rows, but this dataset numbers the classes in reverse order.
    manifest = read_manifest(dataset)
    for shard in manifest.split_files(dataset, "test"):
        table = pq.read_table(shard)
        flipped = pa.array(len(manifest.label_mapping) - 1 - table["label"].to_numpy())
        pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", flipped), shard)
    write_manifest(
        dataset, manifest.__class__(**{**manifest.__dict__, "label_mapping": list(reversed(manifest.label_mapping))})
    )
    assert evaluate_split(model_path, dataset).metrics["test_accuracy"] == pytest.approx(baseline)


def test_incompatible_dataset_is_named(dataset_factory, model_factory):
    model_path = model_factory(dataset_factory(rows={"train": 300, "val": 30, "test": 30}))
    other = dataset_factory(
        rows={"train": 300, "val": 30, "test": 30}, features=["a", "b", "c", "d", "e", "f"], fingerprint="other"
    )
    with pytest.raises(IncompatibleModelError, match=r"\['f0'"):
        evaluate_split(model_path, other)
    regression = dataset_factory(task="regression", rows={"train": 300, "val": 30, "test": 30})
    with pytest.raises(IncompatibleModelError, match="classification model"):
        evaluate_split(model_path, regression)


def test_checkpoint_without_inference_keys_is_rejected(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"model": {}, "optimizer": {}, "epoch": 1}, path)
    with pytest.raises(ValueError, match=r"last.pt lacks keys \['model_spec'"):
        load_model_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_model_checkpoint(tmp_path / "nope.pt")


def test_predictor_normalises_raw_columns_and_returns_original_labels(dataset_factory, model_factory):
    dataset = dataset_factory(rows={"train": 1000, "val": 50, "test": 300})
    model_path = model_factory(dataset)
    result = evaluate_split(model_path, dataset, return_predictions=True)
    frame = read_split(dataset)
    # Columns in another order and as float64: what a user's DataFrame looks like.
    raw = frame[list(reversed(read_manifest(dataset).features))].astype("float64")
    labels = Predictor.from_checkpoint(model_path, batch_size=64).predict(raw)
    np.testing.assert_array_equal(labels, np.asarray(["cat", "dog", "eel", "fox"])[result.predictions])
    with pytest.raises(ValueError, match=r"missing feature columns \['f2'\]"):
        Predictor.from_checkpoint(model_path).predict(raw.drop(columns=["f2"]))


def test_served_regression_predictions_are_on_the_original_scale(dataset_factory, model_factory, tmp_path):
    """A target with mean ~150: the model.pt predicts its standardised value; evaluation, Predictor and the
    MLflow pyfunc model all answer on the original scale."""
    import mlflow.pyfunc

    from training.inference.serving import MODEL_ARTIFACT, MODEL_CODE

    dataset = dataset_factory(
        task="regression", rows={"train": 1000, "val": 50, "test": 333}, label_offset=150.0, target_stats=True
    )
    manifest = read_manifest(dataset)
    assert 140 < manifest.label_mean < 160 and manifest.label_std > 1
    model_path = model_factory(dataset, steps=150)
    model, meta = load_model_checkpoint(model_path)
    assert (meta["label_mean"], meta["label_std"]) == (manifest.label_mean, manifest.label_std)

    frame = read_split(dataset)
    truth = frame["label"].to_numpy().astype(np.float64)
    by_hand = reference_outputs(model_path, frame).reshape(-1).double().numpy() * meta["label_std"] + meta["label_mean"]
    result = evaluate_split(model_path, dataset, batch_size=100, return_predictions=True)
    np.testing.assert_allclose(result.predictions, by_hand, rtol=1e-6)
    assert result.metrics["test_rmse"] == pytest.approx(np.sqrt(np.mean((by_hand - truth) ** 2)), rel=1e-5)
    assert result.metrics["test_rmse"] < 0.3 * manifest.label_std

    raw = frame[manifest.features].astype("float64")  # raw columns, as a user has them
    served = Predictor.from_checkpoint(model_path, batch_size=64).predict(raw)
    np.testing.assert_allclose(served, by_hand, rtol=1e-6)
    assert abs(served.mean() - truth.mean()) < 0.3 * manifest.label_std

    # The pyfunc model as MLflow saves and loads it (the same files log_pyfunc_model logs), no tracking server.
    saved = tmp_path / "pyfunc"
    mlflow.pyfunc.save_model(
        saved,
        python_model=str(MODEL_CODE),
        artifacts={MODEL_ARTIFACT: str(model_path)},
        code_paths=[str(MODEL_CODE.parent)],
        pip_requirements=["torch"],
    )
    np.testing.assert_allclose(np.asarray(mlflow.pyfunc.load_model(str(saved)).predict(raw)), by_hand, rtol=1e-6)


def test_a_model_pt_without_target_statistics_predicts_on_the_raw_scale(dataset_factory, model_factory, tmp_path):
    """model.pt files written before target standardisation: mean 0, std 1."""
    dataset = dataset_factory(task="regression", rows={"train": 600, "val": 30, "test": 120})
    model_path = model_factory(dataset, steps=100)
    checkpoint = torch.load(model_path, weights_only=True)
    assert checkpoint["label_mean"] is None  # this dataset's manifest has none
    old = {key: value for key, value in checkpoint.items() if key not in ("label_mean", "label_std")}
    torch.save(old, tmp_path / "old.pt")
    frame = read_split(dataset)
    outputs = reference_outputs(tmp_path / "old.pt", frame).reshape(-1).numpy()
    np.testing.assert_allclose(Predictor.from_checkpoint(tmp_path / "old.pt").predict(frame), outputs, rtol=1e-6)
    result = evaluate_split(tmp_path / "old.pt", dataset, return_predictions=True)
    np.testing.assert_allclose(result.predictions, outputs, rtol=1e-6)


# --- metrics per objective ------------------------------------------------------------------------------


def binary_model_file(dataset_dir, path, steps: int = 40):
    """A model.pt of the binary objective (one logit), trained full-batch on the train split."""
    from training.inference.model_file import inference_checkpoint
    from training.kinds.normalisation import Normaliser
    from training.models.registry import ModelSpec, build_model
    from training.objectives.builtin import Binary

    manifest = read_manifest(dataset_dir)
    frame = read_split(dataset_dir, "train")
    x = Normaliser.from_manifest(manifest).features(torch.tensor(frame[manifest.features].to_numpy(np.float32)))
    y = torch.tensor(frame["label"].to_numpy())
    torch.manual_seed(0)
    spec = ModelSpec("mlp", manifest.n_features, 1, {"hidden": [16]})
    model = build_model(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        Binary(2).per_row_loss(model(x), y).mean().backward()
        optimizer.step()
    checkpoint = inference_checkpoint(model.state_dict(), spec, manifest, epochs=1, metrics={})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**checkpoint, "objective": {"name": "binary", "kwargs": {}}}, path)
    return path


def pairwise_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC by its definition, every (positive, negative) pair: 1 when the positive scores higher, 1/2 on a tie."""
    pos, neg = scores[positive], scores[~positive]
    return float(((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean())


def average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    """Average precision by its definition: at each distinct score, from the highest, the precision of every row
    scored at least that, times the share of the positives that score adds."""
    total = 0.0
    for threshold in np.unique(scores)[::-1]:
        chosen = scores >= threshold
        added = positive[scores == threshold].sum() / positive.sum()
        total += added * positive[chosen].mean()
    return float(total)


def test_a_two_class_softmax_model_reports_roc_auc_pr_auc_and_the_majority_share(dataset_factory, model_factory):
    """The default objective on a two-class label: ROC AUC and PR AUC over the log-odds of the second class, and
    the share of the most frequent class in the split beside the accuracy, each exact over every row."""
    dataset = dataset_factory(n_classes=2, rows={"train": 400, "val": 50, "test": 203}, shard_rows=90)
    model_path = model_factory(dataset)
    result = evaluate_split(model_path, dataset, batch_size=64)
    frame = read_split(dataset)
    outputs = reference_outputs(model_path, frame)
    scores, positive = (outputs[:, 1] - outputs[:, 0]).numpy(), frame["label"].to_numpy() == 1
    assert result.metrics["test_roc_auc"] == pytest.approx(pairwise_auc(scores, positive), abs=1e-9)
    assert result.metrics["test_pr_auc"] == pytest.approx(average_precision(scores, positive), abs=1e-9)
    counts = np.bincount(frame["label"].to_numpy(), minlength=2)
    assert counts.min() > 0 and result.metrics["test_majority_share"] == counts.max() / 203
    assert result.metrics["test_accuracy"] > result.metrics["test_majority_share"]


def test_binary_evaluation_reports_the_exact_roc_auc_and_serves_labels(dataset_factory, tmp_path):
    dataset = dataset_factory(n_classes=2, rows={"train": 600, "val": 50, "test": 257}, shard_rows=100)
    model_path = binary_model_file(dataset, tmp_path / "binary" / "model.pt")
    result = evaluate_split(model_path, dataset, batch_size=64, return_predictions=True)
    frame = read_split(dataset)
    logits = reference_outputs(model_path, frame).reshape(-1)
    target = frame["label"].to_numpy()
    assert result.metrics["test_roc_auc"] == pytest.approx(pairwise_auc(logits.numpy(), target == 1), abs=1e-12)
    assert 0.8 < result.metrics["test_roc_auc"] <= 1.0
    assert result.metrics["test_pr_auc"] == pytest.approx(average_precision(logits.numpy(), target == 1), abs=1e-9)
    np.testing.assert_array_equal(result.predictions, (logits > 0).long().numpy())
    assert result.metrics["test_accuracy"] == pytest.approx(float(((logits > 0).numpy() == target).mean()))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(target, dtype=torch.float32))
    assert result.metrics["test_log_loss"] == pytest.approx(float(bce), rel=1e-5)
    assert {"test_macro_f1", "test_precision_cat", "test_recall_dog"} <= result.metrics.keys()
    served = Predictor.from_checkpoint(model_path).predict(frame[read_manifest(dataset).features])
    np.testing.assert_array_equal(served, np.asarray(["cat", "dog"])[result.predictions])


def test_above_fifty_classes_there_is_no_confusion_matrix_but_every_class_is_reported(
    dataset_factory, model_factory, tmp_path
):
    import dataclasses

    from ddpflow.tracking.plots import evaluation_figure

    dataset = dataset_factory(n_classes=51, n_features=8, rows={"train": 2000, "val": 50, "test": 300})
    manifest = read_manifest(dataset)
    write_manifest(dataset, dataclasses.replace(manifest, label_mapping=[f"c{i}" for i in range(51)]))
    result = evaluate_split(model_factory(dataset, steps=20), dataset)
    assert result.confusion_matrix is None and result.to_dict()["confusion_matrix"] is None
    assert len(result.per_class) == 51 and sum(v["support"] for v in result.per_class.values()) == 300
    assert {"test_precision_c50", "test_recall_c0", "test_top5_accuracy", "test_log_loss"} <= result.metrics.keys()
    assert result.metrics["test_top5_accuracy"] >= result.metrics["test_accuracy"]
    figure, name = evaluation_figure(result)
    assert name == "per_class_recall.png"  # says so, instead of a 51 x 51 matrix
    assert "above 50 classes" in figure.axes[0].get_title()
