"""One table through ddpflow as a user runs it, beside scikit-learn's HistGradientBoosting on the same split.

What the ``tables`` and ``real_tables`` families share (each keeps its own tables and its report):

- ddpflow, as a user runs it: ``data.inputs`` declares every column by kind, nothing else is set but 2 ranks and
  what the table's own data needs (``data.on_invalid``, ``data.key``: ``extra_data``); the default model
  (``train.model: auto``) and every default training setting, the epoch budget and early stopping included.
  Prepare, the train stage through torchrun (``ddpflow.launch``: what the Prefect task runs), ``evaluate_split``
  on the test split. ``BENCH_TABLES_SET`` (``train.epochs=40;train.lr=0.002``, ``;`` between overrides) sets
  more for an experiment; the figures of docs/benchmarks.md are measured without it.
- HistGradientBoosting with its defaults (``random_state=0`` so that a rerun is the same), fitted on the rows
  of ddpflow's own train split and scored on its own test split, read from the prepared shards: numeric
  columns as float (NaN as is), dates as their seconds since 1970, categoricals as pandas categoricals
  (``categorical_features="from_dtype"``);
  an id with more values than the 255 bins it takes for a categorical is target-encoded (scikit-learn's
  ``TargetEncoder``, cross-fitted on the train split in 5 folds drawn with a fixed seed, so a rerun scores the same
  reference), what scikit-learn advises for many categories.

The metric: ROC AUC for two classes, accuracy for several, R² for regression (``METRIC``). The gap is boosting
minus ddpflow (positive: ddpflow trails); ``gap_interval`` is its spread over the test rows (a paired bootstrap),
for the small test splits of real tables.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from bench import ddpflow_api
from bench.harness.results import Result, Row, Stats, Timer

BINARY, MULTICLASS, REGRESSION = "binary", "multiclass", "regression"
METRIC = {BINARY: "roc_auc", MULTICLASS: "accuracy", REGRESSION: "r2"}  # what each task is judged by
MAX_BINS = 255  # HistGradientBoosting's categorical limit (its max_bins default)
# The gap's interval over the test rows: a paired bootstrap of this many draws, its central GAP_LEVEL share.
GAP_RESAMPLES, GAP_LEVEL = 2000, 0.90
EXPERIMENT_ENV = "BENCH_TABLES_SET"  # an experiment's overrides, ``;`` between them


class Table(Protocol):
    """What measuring needs of a table's spec (``bench/workloads/tables.py``, ``real_tables.py``)."""

    name: str
    task: str  # BINARY | MULTICLASS | REGRESSION
    label: str


def experiment_overrides() -> list[str]:
    """``BENCH_TABLES_SET``'s overrides (none when unset)."""
    return [item for item in os.environ.get(EXPERIMENT_ENV, "").split(";") if item.strip()]


def user_config(
    root: Path,
    spec: Table,
    source: Path,
    inputs: dict[str, str],
    batch_size: int | None = None,
    extra_data: dict[str, Any] | None = None,
    overrides: list[str] = (),
):
    """A user's natural config: inputs by kind, the label, 2 ranks; defaults otherwise (``batch_size``: what the
    user sets after ddpflow refused the default on a small table; ``extra_data``: what the table's data needs;
    ``overrides``, then ``BENCH_TABLES_SET``: an experiment's or a seed's settings)."""
    data = {"source": str(source), "root": str(root / "shards"), "label": spec.label, "inputs": inputs}
    raw = ddpflow_api.apply_overrides(
        {
            "data": {**data, **(extra_data or {})},
            "train": {
                "nproc_per_node": 2,
                "run_root": str(root / "runs"),
                **({"batch_size": batch_size} if batch_size else {}),
            },
            "mlflow": {
                "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                "artifact_location": (root / "mlartifacts").as_uri(),
                "experiment": "bench-tables",
            },
            "registry": {"model_name": f"bench-{spec.name}"},
        },
        [*overrides, *experiment_overrides()],
    )
    return ddpflow_api.pipeline_config(raw)


def run_ddpflow(config, spec: Table) -> dict:
    """Prepare, train (torchrun, 2 ranks), evaluate on test: the metric, the seconds of each stage."""
    with Timer() as prepare:
        dataset = ddpflow_api.prepare(config.data)
    run_dir = Path(config.train.run_root) / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun in a kept --workdir starts over, not from last.pt
    with Timer() as train:
        trained = ddpflow_api.launch_training(config, dataset, run_dir, on_line=lambda line: None, timeout_s=900)
    with Timer() as evaluate:
        metrics = ddpflow_api.evaluate_metrics(trained.model_path, dataset)
    return {
        "dataset": dataset,
        "metric": metrics[f"test_{METRIC[spec.task]}"],
        "epochs": trained.metrics.get("epoch"),
        "model_path": trained.model_path,
        "seconds": {"prepare": prepare.seconds, "train": train.seconds, "evaluate": evaluate.seconds},
    }


def boosting_features(frame, inputs: dict[str, str], categories: dict[str, list]):
    """What HistGradientBoosting takes natively: floats with NaN, pandas categoricals (train's categories). An id
    with more values than its bins is left out here: ``wide_ids`` names them, ``run_boosting`` target-encodes."""
    import pandas as pd

    features = pd.DataFrame(index=frame.index)
    for name, kind in inputs.items():
        if kind != "categorical":
            features[name] = numeric_values(frame[name], kind)
        elif len(categories[name]) <= MAX_BINS:
            features[name] = pd.Categorical(frame[name], categories=categories[name])
    return features


def numeric_values(column, kind: str):
    """A numeric or datetime input as float64, nulls as NaN: a date or timestamp (an ISO string, a date, a
    timestamp with or without a zone) as its seconds since 1970 in UTC, the number a tree splits on."""
    import numpy as np
    import pandas as pd

    if kind == "datetime":
        moments = pd.to_datetime(column, utc=True)
        return (moments - pd.Timestamp(0, tz="UTC")).dt.total_seconds().astype(np.float64)
    return pd.to_numeric(column).astype(np.float64)


def wide_ids(categories: dict[str, list]) -> list[str]:
    return [name for name, values in categories.items() if len(values) > MAX_BINS]


def split_frames(dataset: Path, inputs: dict[str, str], splits=("train", "test")) -> dict:
    """The prepared splits as frames, and the train split's categories of each categorical input."""
    frames = {split: ddpflow_api.split_frame(dataset, split) for split in splits}
    train = frames[splits[0]]
    categories = {name: sorted(train[name].dropna().unique()) for name, kind in inputs.items() if kind == "categorical"}
    return {**frames, "categories": categories}


def score(task: str, y_test, predicted) -> float:
    """The task's metric (``METRIC``) of ``predicted``: class-1 probabilities (binary), class indices (several
    classes) or values (regression). The shards hold class indices (manifest.label_mapping); ddpflow's positive
    class is index 1."""
    from sklearn.metrics import accuracy_score, r2_score, roc_auc_score

    if task == REGRESSION:
        return float(r2_score(y_test, predicted))
    if task == BINARY:
        return float(roc_auc_score(y_test == 1, predicted))
    return float(accuracy_score(y_test, predicted))


def run_boosting(spec: Table, dataset: Path, inputs: dict[str, str]) -> dict:
    """HistGradientBoosting (defaults) on ddpflow's train split rows, scored on its test split rows."""
    import pandas as pd
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from sklearn.model_selection import KFold, StratifiedKFold
    from sklearn.preprocessing import TargetEncoder

    frames = split_frames(dataset, inputs)
    train, test, categories = frames["train"], frames["test"], frames["categories"]
    y_train, y_test = train[spec.label], test[spec.label]
    with Timer() as fit:
        x_train, x_test = (boosting_features(frame, inputs, categories) for frame in (train, test))
        wide = wide_ids(categories)
        if wide:  # scikit-learn's advice for many categories: target encoding, cross-fitted on train
            # Cross-fitting folds drawn with a fixed seed, so that a rerun scores the same reference (the default
            # shuffles at random: card_fraud's ROC AUC moved 0.860-0.872 between runs of one split).
            folds = (KFold if spec.task == REGRESSION else StratifiedKFold)(5, shuffle=True, random_state=0)
            encoder = TargetEncoder(target_type="continuous" if spec.task == REGRESSION else "auto", cv=folds)
            encoded = encoder.fit_transform(train[wide].astype(object), y_train)
            names = list(encoder.get_feature_names_out())
            x_train = pd.concat([x_train, pd.DataFrame(encoded, columns=names, index=x_train.index)], axis=1)
            tested = encoder.transform(test[wide].astype(object))
            x_test = pd.concat([x_test, pd.DataFrame(tested, columns=names, index=x_test.index)], axis=1)
        model_class = HistGradientBoostingRegressor if spec.task == REGRESSION else HistGradientBoostingClassifier
        model = model_class(categorical_features="from_dtype", random_state=0)
        model.fit(x_train, y_train)
    if spec.task == BINARY:
        predicted = model.predict_proba(x_test)[:, list(model.classes_).index(1)]
    else:
        predicted = model.predict(x_test)
    return {"metric": score(spec.task, y_test, predicted), "seconds": fit.seconds, "train_rows": len(train),
            "test_rows": len(test), "wide": wide, "test": test, "labels": y_test.to_numpy(),
            "predicted": predicted}  # fmt: skip


def ddpflow_predicted(task: str, model_path: Path, test):
    """ddpflow's model's predictions on the test split's rows (``test``: the frame boosting was scored on) as
    ``score`` reads them: values, class index 1's probability (two classes) or class indices."""
    predictions = ddpflow_api.frame_predictions(model_path, test)
    if task == REGRESSION:
        return predictions
    indices, probabilities = predictions
    return probabilities[:, 1] if task == BINARY else indices


def gap_interval(task: str, labels, ours, theirs, resamples: int = GAP_RESAMPLES, seed: int = 0) -> list[float]:
    """The gap's (boosting − ddpflow) GAP_LEVEL interval over the test rows: a paired bootstrap (rows drawn with
    replacement, both models scored on the same draw), which tells a gap the test split resolves from the luck of
    a few rows. A draw with one class only (no ROC AUC) is drawn again."""
    import numpy as np

    rng, gaps = np.random.default_rng(seed), []
    while len(gaps) < resamples:
        rows = rng.integers(0, len(labels), len(labels))
        if task == BINARY and len(np.unique(labels[rows])) < 2:
            continue
        gaps.append(score(task, labels[rows], theirs[rows]) - score(task, labels[rows], ours[rows]))
    low, high = np.quantile(gaps, [(1 - GAP_LEVEL) / 2, (1 + GAP_LEVEL) / 2])
    return [float(low), float(high)]


def measure(
    root: Path,
    spec: Table,
    source: Path,
    inputs: dict[str, str],
    extra_data: dict[str, Any] | None = None,
    overrides: list[str] = (),
    interval: bool = False,
) -> dict:
    """ddpflow and boosting on one table: the figures docs/benchmarks.md shows (``ddpflow``, ``boosting``,
    ``gap``, the rows of each split, the seconds, the load; ``interval``: the gap's ``gap_interval`` too), and
    ``dataset``, the prepared split both used."""
    config = user_config(root, spec, source, inputs, extra_data=extra_data, overrides=overrides)
    load = os.getloadavg()[0]
    refused = ""
    try:
        ours = run_ddpflow(config, spec)
    except Exception as error:
        if "train.batch_size" not in str(error):
            raise
        # The default batch is refused on a small table: set what the error asks (a power of two that fits).
        refused = str(error).partition(";")[0]
        share = ddpflow_api.manifest(ddpflow_api.prepare(config.data)).rows("train") // 2
        batch = 2 ** (share.bit_length() - 1)
        config = user_config(root, spec, source, inputs, batch, extra_data, overrides)
        ours = run_ddpflow(config, spec)
        refused = f"default refused ({refused}); rerun with train.batch_size {batch}"
    theirs = run_boosting(spec, ours["dataset"], inputs)
    spread = None
    if interval:
        predicted = ddpflow_predicted(spec.task, ours["model_path"], theirs["test"])
        spread = gap_interval(spec.task, theirs["labels"], predicted, theirs["predicted"])
    return {
        "table": spec.name,
        "task": spec.task,
        "metric": METRIC[spec.task],
        "ddpflow": ours["metric"],
        "boosting": theirs["metric"],
        "gap": theirs["metric"] - ours["metric"],
        "dropped_rows": ddpflow_api.manifest(ours["dataset"]).dropped_rows,
        "train_rows": theirs["train_rows"],
        "test_rows": theirs["test_rows"],
        "ddpflow_s": ours["seconds"],
        "boosting_fit_s": theirs["seconds"],
        "load_1min": load,
        "target_encoded": theirs["wide"],
        "epochs_run": ours["epochs"],
        "refused": refused,
        **({"gap_interval": spread} if spread else {}),
        "dataset": ours["dataset"],
    }


def gap_results(
    name: str,
    title: str,
    gaps: tuple[float, float],
    targets: tuple[float, float],
    labels: tuple[str, str],
    rows: list[Row],
    notes: tuple[list[str], list[str]],
) -> list[Result]:
    """A tables family's two results: ``NAME-mean-gap`` (the mean gap over the tables, with every table's row)
    and ``NAME-worst-gap`` (the largest), each a gap (boosting − ddpflow) checked against its target (≤)."""
    what = "mean over the tables of (HistGradientBoosting − ddpflow's default model), ROC AUC / accuracy / R²"
    return [
        Result(f"{name}-mean-gap", title, Stats.of([gaps[0]]), targets[0], "le", f"{what}{labels[0]}", rows, notes[0]),
        Result(
            f"{name}-worst-gap",
            title.replace(": gap", ": worst gap"),
            Stats.of([gaps[1]]),
            targets[1],
            "le",
            f"the largest gap (boosting − ddpflow){labels[1]}",
            notes=notes[1],
        ),
    ]
